"""Leftovers of issue 27: one definition per fact, public names across modules, a hash choice refused at
start-up, and no staging folder left by an interrupt of consolidate's shared step."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardkit.checkpoint.ops.convert.to_zero3_plan import single_adam_step
from shardkit.core.errors import CheckpointError

PACKAGE = Path(__file__).resolve().parent.parent / "shardkit"


def _definitions(name: str) -> list[str]:
    """Modules of shardkit that define ``name`` at top level (a function, or a constant assigned)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                found.append(str(path.relative_to(PACKAGE)))
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                found.append(str(path.relative_to(PACKAGE)))
    return found


@pytest.mark.parametrize("name", ["dcp_model_key", "dcp_optim_key", "MODEL_KEY", "OPTIM_KEY", "training_precision"])
def test_each_checkpoint_fact_is_defined_in_one_module(name: str) -> None:
    # two copies of the DCP key spelling drift apart silently: a convert would write keys dcp.load misses
    assert len(_definitions(name)) == 1, _definitions(name)


def test_the_one_step_check_names_the_parameters_that_disagree_and_the_rule() -> None:
    with pytest.raises(CheckpointError) as e:
        single_adam_step(["a.weight", "b.weight"], {"a.weight": 3.0, "b.weight": 5.0}, "ckpt: param group 0",
                         "its parameters", "ZeRO-1/2 keeps one step per param group")
    assert "ckpt: param group 0: its parameters have different Adam step counts (a.weight: 3, b.weight: 5)" in str(e.value)
    assert "ZeRO-1/2 keeps one step per param group" in str(e.value)
    with pytest.raises(CheckpointError, match=r"no Adam step recorded for \['b.weight'\]"):
        single_adam_step(["a.weight", "b.weight"], {"a.weight": 3.0}, "ckpt", "x", "y")
    assert single_adam_step(["a.weight", "b.weight"], {"a.weight": 4.0, "b.weight": 4.0}, "ckpt", "x", "y") == 4


def test_no_checkpoint_module_imports_another_modules_private_names() -> None:
    # a helper borrowed as `_x` from another module has no owner: renaming it there breaks the borrower
    borrowed = []
    for path in sorted((PACKAGE / "checkpoint").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardkit.checkpoint"):
                borrowed += [f"{path.relative_to(PACKAGE)}: {node.module}.{a.name}" for a in node.names
                             if a.name.startswith("_") and a.name != "__version__"]
    assert borrowed == []


def test_an_interrupt_while_consolidate_removes_its_staging_folder_still_removes_it(tmp_path, monkeypatch):
    """After the rename, process 0 removes the staging folder; rmtree may take the owner file (that the
    clean-up looks for) before a Ctrl-C lands: the folder must still go."""
    import shutil
    import types

    from shardkit.checkpoint.ops import consolidate_shared
    from shardkit.storage.atomic import staging_dir
    from shardkit.storage.request import RunRequest
    from shardkit.storage.shared_save import OWNER_NAME, Launch

    calls = []

    def rmtree_interrupted_after_the_owner_file(path, ignore_errors=False):
        calls.append(Path(path))
        if len(calls) == 1:  # the rmtree after the rename: the owner file goes first, then the interrupt
            (Path(path) / OWNER_NAME).unlink()
            raise KeyboardInterrupt
        shutil.rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(consolidate_shared, "shutil", types.SimpleNamespace(rmtree=rmtree_interrupted_after_the_owner_file))
    out = tmp_path / "model.safetensors"
    request = RunRequest("consolidate", str(tmp_path / "src"), str(out), None, {})
    with pytest.raises(KeyboardInterrupt):
        consolidate_shared.write_shared(out, Launch(0, 1, "job-h5", "single process", "host"), request,
                                        lambda fd: os.pwrite(fd, b"header", 0), lambda fd: None, [], 1, "nothing kept")
    assert out.read_bytes() == b"header"  # published before the interrupt
    assert calls and not staging_dir(tmp_path, out.name).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


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

    source = R.build_sources(tmp_path.parent / "h5_zero3")["fp32"]
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
