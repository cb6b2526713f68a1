"""Shared fixtures. Multi-rank tests use shardkit.run.spawn.process.run_ranks (file:// rendezvous, hard
timeout that kills the children, child tracebacks in the failure message)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
DS_CONFIGS = REPO / "ds_configs"

# Spawned ranks and CLI subprocesses must import this checkout's shardkit and tests package.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(REPO), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
)
# Keep DeepSpeed/torch quiet and single-threaded per rank: 2 cores are shared by all ranks.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_configure(config: pytest.Config) -> None:
    """Build DeepSpeed's JIT ops once, in the controller, before any test or xdist worker starts.

    A cold build takes minutes; done lazily it would race between workers and could be killed
    mid-build by a test's timeout, leaving a stale lock that hangs every later DeepSpeed test.
    """
    if hasattr(config, "workerinput"):  # an xdist worker: the controller already did it
        # the worker names each test's group when the controller schedules by group (below)
        config.option.loadgroup = bool(getattr(config, "workerinput").get("shardkit_loadgroup"))
        return
    # Under -n, the tests marked xdist_group("slurm") share one worker (xdist's loadgroup instead
    # of its default load): two Slurm clusters at once would fight over this machine's cores, and
    # a second two-node cluster over its node names and addresses (docs/slurm.md). The scheduler
    # below also keeps each module on one worker, so its module fixtures run once (tests/_schedule.py).
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", None) == "load":
        config.option.dist = "loadgroup"
    import subprocess

    code = "from shardkit.engines.deepspeed import prebuild_ops; print(prebuild_ops())"
    try:
        subprocess.run([sys.executable, "-c", code], timeout=1200, capture_output=True, check=False)
    except subprocess.TimeoutExpired:
        pass  # the tests that need the ops will fail with DeepSpeed's own message


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent under -p no:xdist
def pytest_configure_node(node: Any) -> None:
    """xdist's controller, for each worker it starts: whether tests are scheduled by group (the
    worker parses the command line itself and would not know it)."""
    node.workerinput["shardkit_loadgroup"] = node.config.option.dist == "loadgroup"


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent under -p no:xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under -n (dist turned to loadgroup above): a module, or an xdist group, is one unit of work,
    the costliest units first (tests/_schedule.py). An explicit other --dist keeps xdist's own."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from tests import _schedule

    return _schedule.make_scheduler(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: units in the order the scheduler deals them
        from tests import _schedule

        _schedule.costliest_first(items)
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def restore_env():
    """Give a test free rein over os.environ and put it back afterwards."""
    saved = dict(os.environ)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def run_cli(capsys):
    """Call the CLI in-process; returns (exit_code, stdout, stderr)."""
    from shardkit.cli import main

    def _run(*argv: str) -> tuple[int, str, str]:
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse usage errors and --help/--version
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    return _run


@pytest.fixture
def python_exe() -> str:
    return sys.executable


@pytest.fixture(scope="session")
def sweep_sources(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The hostile sweep's four real sources, built once per session (tests/_hostile_sweep.py)."""
    from tests import _hostile_sweep

    return _hostile_sweep.sources_for(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def sweep_tally() -> Any:
    """A hostile-sweep module adds its cases to the tally file when it ends (its pytestmark uses this)."""
    yield
    from tests import _hostile_sweep

    _hostile_sweep.write_tally()
