"""Every SHARDKIT_* variable: declared once (shardkit.core.env_settings.SETTINGS), listed in docs/cli.md,
read through one helper that refuses a bad value naming the variable, the value and the accepted form
(or warns once where a run is under way), checked by every command before it works, and a name shardkit
does not read warned about."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardkit.core import env_settings
from shardkit.core.env_settings import SETTINGS, check_all, read_choice, read_seconds, unknown_settings, warn_unknown
from shardkit.core.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
# names that are Python identifiers, not environment variables (an import alias of the release string)
_NOT_VARIABLES = {"SHARDKIT_VERSION"}


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(env_settings, "_WARNED", set())


def test_docs_table_is_the_settings_table():
    page = (REPO / "docs" / "cli.md").read_text()
    section = page.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    assert env_settings.docs_table() in section, "docs/cli.md: regenerate the table with env_settings.docs_table()"
    listed = re.findall(r"^\| `(SHARDKIT_[A-Z0-9_]+)`", section, re.M)
    assert listed == list(SETTINGS)


def test_every_shardkit_variable_named_in_the_code_is_declared():
    used: dict[str, str] = {}
    for path in (REPO / "shardkit").rglob("*.py"):
        if path.name == "env_settings.py":  # the table itself (and its docstrings' typo example)
            continue
        for name in re.findall(r"(?<![A-Za-z0-9_])SHARDKIT_[A-Z0-9_]*[A-Z0-9]", path.read_text()):
            used.setdefault(name, str(path.relative_to(REPO)))
    undeclared = {n: p for n, p in used.items() if n not in SETTINGS and n not in _NOT_VARIABLES
                  and not n.startswith(env_settings._OTHER_PREFIXES)}
    assert not undeclared, f"declare these in shardkit/core/env_settings.py SETTINGS (and docs/cli.md): {undeclared}"
    assert "SHARDKIT_SILENCE_S" in used and "SHARDKIT_HASH" in used  # the scan sees real reads


def test_the_table_defaults_are_the_defaults_the_code_uses():
    from shardkit.autopreflight.rank_env import DEFAULT_TIMEOUT_S
    from shardkit.platform.environment.ext_lock import DEFAULT_STALE_S
    from shardkit.run.spawn.silence import DEFAULT_SILENCE_S

    assert float(SETTINGS["SHARDKIT_SILENCE_S"].default) == DEFAULT_SILENCE_S
    assert float(SETTINGS["SHARDKIT_STALE_LOCK_S"].default) == DEFAULT_STALE_S
    assert float(SETTINGS["SHARDKIT_AUTOPREFLIGHT_TIMEOUT"].default) == DEFAULT_TIMEOUT_S


@pytest.mark.parametrize("raw, why", [("abc", "is not a number"), ("-1", "is not a finite number >= 0"),
                                      ("nan", "is not a finite number >= 0"), ("inf", "is not a finite number >= 0"),
                                      ("1e999", "is not a finite number >= 0")])
def test_bad_seconds_are_refused_naming_the_variable_the_value_and_the_form(raw, why):
    with pytest.raises(UsageError, match=rf"SHARDKIT_SILENCE_S='{re.escape(raw)}' {why}: expected a number of seconds "
                                         r">= 0 .*unset it for the default \(120\)"):
        read_seconds("SHARDKIT_SILENCE_S", 120.0, {"SHARDKIT_SILENCE_S": raw})
    assert read_seconds("SHARDKIT_SILENCE_S", 120.0, {"SHARDKIT_SILENCE_S": " 0 "}) == 0.0  # 0: never report
    with pytest.raises(UsageError, match=r"SHARDKIT_STALE_S='0' is 0, a wait of nothing: expected a number of seconds > 0"):
        read_seconds("SHARDKIT_STALE_S", 60.0, {"SHARDKIT_STALE_S": "0"})


def test_during_a_run_a_bad_value_is_warned_about_once_and_the_default_used(capsys):
    from shardkit.platform.environment.ext_lock import stale_after_s
    from shardkit.run.spawn.silence import silence_s

    env = {"SHARDKIT_SILENCE_S": "abc", "SHARDKIT_STALE_LOCK_S": "-5"}
    assert silence_s(env, during_run=True) == 120.0
    assert silence_s(env, during_run=True) == 120.0
    assert stale_after_s(env, during_run=True) == 600.0
    err = capsys.readouterr().err
    assert err.count("SHARDKIT_SILENCE_S='abc' is not a number") == 1, err
    assert "using 120 for this run" in err and "SHARDKIT_STALE_LOCK_S='-5'" in err and "using 600 for this run" in err
    with pytest.raises(UsageError, match="SHARDKIT_SILENCE_S='abc'"):  # before work starts: refused
        silence_s(env)
    with pytest.raises(UsageError, match="SHARDKIT_STALE_LOCK_S='-5'"):
        stale_after_s(env)


def test_choices_and_check_all():
    from shardkit.storage.digest import default_algorithm

    assert read_choice("SHARDKIT_HASH", "blake3", {"SHARDKIT_HASH": "SHA256"}) == "sha256"
    with pytest.raises(UsageError, match=r"SHARDKIT_HASH='md5' is not one of blake3, sha256: expected blake3 or sha256"):
        default_algorithm({"SHARDKIT_HASH": "md5"}, during_run=False)
    assert default_algorithm({"SHARDKIT_HASH": "sha256"}) == "sha256"
    check_all({"SHARDKIT_SILENCE_S": "30", "SHARDKIT_HASH": "blake3", "SHARDKIT_AUTOPREFLIGHT_JSON": "any text"})
    with pytest.raises(UsageError, match="SHARDKIT_JOIN_TIMEOUT_S='soon'"):
        check_all({"SHARDKIT_JOIN_TIMEOUT_S": "soon"})


def test_a_name_shardkit_does_not_read_is_warned_about_with_the_nearest_declared_name(capsys):
    env = {"SHARDKIT_SILENSE_S": "5", "SHARDKIT_BENCH_RUNS": "3", "SHARDKIT_HASH": "sha256", "SHARDKIT_ZZZ": "1"}
    assert unknown_settings(env) == ["SHARDKIT_SILENSE_S", "SHARDKIT_ZZZ"]
    warn_unknown(env)
    err = capsys.readouterr().err
    assert "SHARDKIT_SILENSE_S is set, but shardkit reads no such variable" in err
    assert "did you mean SHARDKIT_SILENCE_S?" in err and "SHARDKIT_ZZZ" in err and "docs/cli.md" in err


def _cli(args: list[str], tmp_path: Path, **env_extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDKIT_")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "shardkit", *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_every_command_refuses_a_bad_value_before_it_works(tmp_path):
    # smoke would spawn ranks and reshard would read a checkpoint: both stop first, exit 2, nothing written
    for args in (["smoke", "--engine", "zero3"], ["reshard", "src", "--world-size", "2", "-o", "out"]):
        r = _cli(args, tmp_path, SHARDKIT_SILENCE_S="abc")
        assert r.returncode == 2, (args, r.stderr)
        assert f"shardkit {args[0]}: error: SHARDKIT_SILENCE_S='abc' is not a number: expected a number of seconds" \
            in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()
    # the commands that write manifests refuse it too, although a library save only warns (below)
    for args in (["versions"], ["convert", "src", "--to", "zero3", "-o", "out"]):
        r = _cli(args, tmp_path, SHARDKIT_HASH="md5")
        assert r.returncode == 2 and "SHARDKIT_HASH='md5' is not one of blake3, sha256" in r.stderr, (args, r.stderr)
        assert "using blake3 for this run" not in r.stderr
    assert not (tmp_path / "out").exists()
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1}')
    r = _cli(["check", str(cfg), "--no-accelerator"], tmp_path, SHARDKIT_SILENSE_S="5")
    assert r.returncode == 0, r.stderr
    assert "SHARDKIT_SILENSE_S is set, but shardkit reads no such variable" in r.stderr


# A training loop that saves twice with a bad SHARDKIT_HASH: the saves must not raise (that would lose
# the run's steps since the last checkpoint), the warning comes once, and the manifests use the default.
_SAVE_TWICE = """
import json, sys
import torch
from shardkit.checkpoint.ops.torch_training import save_training
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in (1, 2):
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    save_training(sys.argv[1], model=model, optimizer=opt, step=step)
for step in (1, 2):
    manifest = json.load(open(f"{sys.argv[1]}/step{step}/shardkit_manifest.json"))
    print(step, sorted({k for entry in manifest["files"] for k in entry if k in ("blake3", "sha256")}))
"""


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_bad_shardkit_hash_at_a_save_inside_a_training_run_is_warned_once_and_the_default_used(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDKIT_")}
    r = subprocess.run([sys.executable, "-c", _SAVE_TWICE, str(tmp_path / "ckpt")], capture_output=True, text=True,
                       env={**env, "SHARDKIT_HASH": "md5"}, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    warning = ("shardkit: warning: SHARDKIT_HASH='md5' is not one of blake3, sha256: expected blake3 or sha256 "
               "(the content digest new manifests use")
    assert r.stderr.count(warning) == 1, r.stderr[-3000:]
    assert "using blake3 for this run" in r.stderr, r.stderr[-3000:]
    assert r.stdout.split("\n")[:2] == ["1 ['blake3']", "2 ['blake3']"], r.stdout
