"""``SHARDKIT_HASH=blake3`` without the blake3 package: refused at start-up by every command, before any
work, with the fix (pip install blake3, or SHARDKIT_HASH=sha256); inside someone's training loop a save
warns once and uses sha256 instead of failing the run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_NO_BLAKE3 = 'raise ImportError("blake3 blocked by the test (as on a platform without its wheel)")\n'


def test_a_hash_whose_package_does_not_import_is_refused_when_read_and_warned_about_during_a_run(monkeypatch, capsys):
    from shardkit.core import env_settings
    from shardkit.core.errors import UsageError
    from shardkit.storage.digest import default_algorithm

    monkeypatch.setitem(sys.modules, "blake3", None)  # `import blake3` raises ImportError
    monkeypatch.setattr(env_settings, "_WARNED", set())
    env = {"SHARDKIT_HASH": "blake3"}
    with pytest.raises(UsageError) as e:
        env_settings.check_all(env)
    assert str(e.value).startswith("SHARDKIT_HASH='blake3' needs the Python package blake3 (the content digest")
    assert str(e.value).endswith(": pip install blake3, or set SHARDKIT_HASH=sha256")
    # a save inside someone's training loop: warned once, sha256 used, the run goes on
    assert default_algorithm(env) == "sha256" and default_algorithm(env) == "sha256"
    assert capsys.readouterr().err.count("shardkit: warning: SHARDKIT_HASH='blake3' needs the Python package") == 1


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("command", ["reshard", "convert"])
def test_the_cli_refuses_shardkit_hash_blake3_without_its_package_before_any_work(tmp_path, command):
    from tests import _ranks_zero3 as R

    source = R.build_sources(tmp_path.parent / "no_blake3_zero3")["fp32"]
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "blake3.py").write_text(_NO_BLAKE3)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDKIT_")}
    env.update(SHARDKIT_HASH="blake3", PYTHONPATH=os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")])))
    out = tmp_path / "out"
    args = ["reshard", source, "--world-size", "3"] if command == "reshard" else ["convert", source, "--to", "fsdp2"]
    r = subprocess.run([sys.executable, "-m", "shardkit", *map(str, args), "-o", str(out)], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 2, r.stderr[-3000:]
    assert (f"shardkit {command}: error: SHARDKIT_HASH='blake3' needs the Python package blake3 (the content digest "
            "new manifests use") in r.stderr, r.stderr[-3000:]
    assert "blake3 blocked by the test" in r.stderr and "pip install blake3, or set SHARDKIT_HASH=sha256" in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()
