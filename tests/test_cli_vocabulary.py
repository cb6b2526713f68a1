"""One CLI vocabulary: the new spellings work, each old one still works and says once on stderr what
replaced it, and --json gives JSON alone on stdout on every command that runs without a checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ZERO3 = REPO / "shardkit" / "ds_configs" / "zero3.json"


@pytest.fixture
def zero3_config(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(ZERO3.read_text() if ZERO3.is_file() else json.dumps(
        {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}))
    return cfg


@pytest.mark.parametrize("argv, note", [
    (["smoke", "--nproc", "0"], "--nproc is now --world-size"),
    (["preflight", "--nproc", "0", "CFG"], "--nproc is now --world-size"),
    (["preflight", "--timeout", "0", "CFG"], "--timeout is now --rank-wait"),
])
def test_an_old_spelling_does_what_it_did_and_names_its_replacement(run_cli, zero3_config, argv, note):
    code, out, err = run_cli(*[str(zero3_config) if a == "CFG" else a for a in argv])
    assert code == 2  # the value reached the same check the new spelling reaches
    assert note in err and "the old spelling still works" in err
    assert err.count(note) == 1


def test_the_new_spelling_gives_no_note_and_the_same_refusal(run_cli):
    code, _, err = run_cli("smoke", "--world-size", "0")
    assert code == 2 and "--world-size 0: must be at least 1" in err
    assert "note:" not in err


def test_engine_old_spelling_is_mapped_with_a_note(run_cli):
    code, out, err = run_cli("estimate", "--engine", "fsdp", "--params", "1B", "--json")
    assert code == 0, err
    assert "--engine fsdp is now --engine fsdp2" in err
    assert json.loads(out)["engine"]  # the estimate of the FSDP2 config, as --engine fsdp2 gives


def test_smoke_model_takes_llama_size_and_refuses_what_it_cannot_build(run_cli):
    code, _, err = run_cli("smoke", "--model", "tiny", "--world-size", "0")
    assert "--model tiny is now --model llama:tiny" in err and code == 2
    code, _, err = run_cli("smoke", "--model", "pkg.module:factory")
    assert code == 2 and "smoke builds Llama models only: llama:SIZE" in err


def test_preflight_json_dash_prints_json_alone_on_stdout(run_cli, zero3_config):
    code, out, err = run_cli("preflight", zero3_config, "--static", "--world-size", "2", "--json", "-")
    assert code == 0, err
    data = json.loads(out)  # nothing but the JSON: the table went to stderr
    assert data["ok"] is True and data["static_only"] is True
    assert "no findings" in err or "warning" in err


def test_preflight_json_path_is_the_old_json_file(run_cli, zero3_config, tmp_path):
    target = tmp_path / "placement.json"
    code, out, err = run_cli("preflight", zero3_config, "--static", "--world-size", "2", "--json", target)
    assert code == 0, err
    assert f"--json {target} is now --json-file {target}" in err
    assert json.loads(target.read_text())["command"] == "preflight"
    assert "{" not in out  # the human report stayed on stdout, the JSON went to the file


@pytest.mark.parametrize("argv", [
    ["check", "CFG"],
    ["versions"],
    ["estimate", "--params", "1B", "--world-size", "8"],
    ["config", "zero3", "--world-size", "8", "--no-accelerator"],
    ["config", "fsdp", "--no-accelerator"],
])
def test_json_alone_on_stdout(run_cli, zero3_config, argv):
    code, out, err = run_cli(*[str(zero3_config) if a == "CFG" else a for a in argv], "--json")
    assert code in (0, 1), err
    json.loads(out)  # raises when anything but the JSON reached stdout


def test_json_file_is_written_and_the_table_stays_on_stdout(run_cli, zero3_config, tmp_path):
    target = tmp_path / "report.json"
    code, out, _ = run_cli("check", zero3_config, "--json-file", target)
    data = json.loads(target.read_text())
    assert data["subject"] and code == (0 if data["ok"] else 1)
    assert out.strip() and not out.lstrip().startswith("{")


def test_a_failure_under_json_is_a_json_result_naming_the_error(run_cli, tmp_path):
    missing = tmp_path / "nope"
    code, out, err = run_cli("reshard", missing, "--world-size", "2", "-o", tmp_path / "out", "--json")
    assert code == 1
    data = json.loads(out)
    assert data == {"command": "reshard", "ok": False, "exit_code": 1, "error": data["error"]}
    assert str(missing) in data["error"] and str(missing) in err
    assert not (tmp_path / "out").exists()


def test_launch_json_dry_run_in_a_real_process(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('from the script')\n")
    r = subprocess.run([sys.executable, "-m", "shardkit", "launch", "--launcher", "torchrun", "--dry-run", "--json",
                        "--nproc_per_node", "1", str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["dry_run"] is True and data["exit_code"] is None and str(script) in data["argv"]
    assert "would run" in r.stderr


def test_launch_json_moves_the_scripts_output_to_stderr(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('from the script', flush=True)\n")
    # --standalone: a free port of torchrun's choosing, not its default 29500 (another test worker's job may hold it)
    r = subprocess.run([sys.executable, "-m", "shardkit", "launch", "--launcher", "torchrun", "--no-preflight",
                        "--json", "--standalone", "--nproc_per_node", "1", str(script)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)  # the script's line did not land on stdout
    assert data["exit_code"] == 0 and data["ok"] is True
    assert "from the script" in r.stderr


def test_an_os_error_under_json_is_a_json_result_too(run_cli, tmp_path, monkeypatch):
    import shardkit.checks as checks

    def denied(path, **_):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(checks, "check_file", denied)
    cfg = tmp_path / "ds.json"
    cfg.write_text("{}")
    code, out, err = run_cli("check", cfg, "--json")
    assert code == 1 and err.strip() == f"shardkit check: error: {cfg}: Permission denied"
    assert json.loads(out) == {"command": "check", "ok": False, "exit_code": 1, "error": f"{cfg}: Permission denied"}
