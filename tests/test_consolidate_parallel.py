"""`shardkit consolidate` split across launched processes (srun/torchrun): 2 or 3 processes write
the file one process writes, byte for byte; a process killed mid-copy or never started fails the
run, named, leaving neither the output nor the temporary file; a corrupted source share is never
published; processes of different shardkit releases (consolidate and reshard) are refused. Plain subprocesses with the launcher's variables (RANK/WORLD_SIZE, MASTER_* naming the
job only: nothing rendezvouses), hard timeouts."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks._scale_zero3 import scale_checkpoint
from shardkit._version import __version__ as shardkit_version_string
from shardkit.checkpoint.ops.consolidate import consolidate_checkpoint
from shardkit.storage.shared_save import launch_from_env
from shardkit.storage.tags import STAGING_PREFIX
from tests import test_reshard_parallel as reshard_tests
from tests._ports import job_port
from tests._slow_writes import slow_fsync_cli
from tests.test_reshard_parallel import (
    TIMEOUT_S,
    _cli,
    _env,
    _nothing_published,
    _stop,
    _wait_for,
    rank0_names_killed_rank1,
)

pytestmark = pytest.mark.slow

# the session's shared checkpoints: the tiny ZeRO-3 sources and the 150x one big enough to interrupt
sources = reshard_tests.sources
big = reshard_tests.big

NAME = "model.safetensors"


def _start(rank: int, world: int, src: Path, out: Path, port: str, *args: str, slow: bool = False,
           **extra: str) -> subprocess.Popen[str]:
    """Process ``rank`` of ``world`` as torchrun would start it (MASTER_PORT tells this run's job apart);
    ``slow``: its every fsync takes seconds (tests/_slow_writes.py), so a kill lands mid-share."""
    env = _env(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra)
    argv = ("consolidate", src, "-o", out / NAME, "--workers", "1", *args)
    return subprocess.Popen(slow_fsync_cli(*argv) if slow else _cli(*argv), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str, str]]:
    """Each process's (exit code, stdout, stderr); all are killed if one outlives the timeout."""
    try:
        outs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
        return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize(("world", "label", "args"), [
    (2, "bf16_offload", ()),  # fp32 out: file-to-file copies, no torch
    (3, "fp32", ("--dtype", "bf16")),  # a cast: each process maps the rank files of its pieces
])
def test_launched_processes_write_the_bytes_one_process_writes(sources, tmp_path, world, label, args):
    src = Path(sources[label])
    if label == "fp32":  # sealed with a manifest: every process also hashes its share of the source
        src = scale_checkpoint(src, tmp_path / "src", 1).parent
    one = tmp_path / "one" / NAME
    consolidate_checkpoint(src, one, dtype=args[1] if args else "fp32", launch=launch_from_env({}), warn=lambda m: None)
    out, port = tmp_path / "out", job_port()
    results = _finish([_start(r, world, src, out, port, *args) for r in range(world)])
    for rank, (code, stdout, err) in enumerate(results):
        assert code == 0, f"rank {rank}: {err}{stdout}"
    assert re.search(rf"wrote .*{NAME} by {world} processes \(torchrun\): 21 tensors", results[0][1]), results[0][1]
    for rank in range(1, world):
        assert re.search(rf"rank {rank} of {world} \(torchrun\): copied its share, [1-9]\d* pieces", results[rank][1])
    assert (out / NAME).read_bytes() == one.read_bytes()
    assert [p.name for p in out.iterdir()] == [NAME]  # no staging folder, no temporary file


def test_a_process_killed_mid_copy_fails_the_run_naming_it(big, tmp_path):
    out = tmp_path / "out"
    fast = {"SHARDKIT_STALE_S": "3"}
    port = job_port()
    r1 = _start(1, 2, big, out, port, slow=True, **fast)  # slowed: still copying when the kill comes
    r0 = _start(0, 2, big, out, port, **fast)
    try:
        staged = _wait_for(out, f"{STAGING_PREFIX}{NAME}")
        _wait_for(staged, ".shardkit-alive-1")
        _wait_for(staged, NAME)  # rank 0 created the sized file: rank 1 is opening it or copying into it
    except BaseException:
        _stop(r0, r1)
        raise
    rank0_names_killed_rank1(r0, r1, out)


def test_a_process_that_never_joins_is_named_within_the_timeout(sources, tmp_path):
    out = tmp_path / "out"
    # built on first use (a 2-rank ZeRO-3 run, 40 s on a loaded 2-core box): before the clock starts
    src = sources["fp32"]
    started = time.monotonic()
    [(code, _, err)] = _finish([_start(0, 2, src, out, job_port(), SHARDKIT_JOIN_TIMEOUT_S="3")])
    assert code == 1
    assert re.search(r"rank 1 of 2 never joined within 3 s \(torchrun job .*\): it did not start, or its node does not "
                     r"see .* \(-o must be on storage every node shares\)", err), err
    assert time.monotonic() - started < 60
    _nothing_published(out)
    # the other way round: rank 1 alone waits for a claim that never comes, and says so
    [(code, _, err)] = _finish([_start(1, 2, src, out, job_port(), SHARDKIT_JOIN_TIMEOUT_S="2")])
    assert code == 1 and "rank 0 did not claim the staging folder" in err and "it does not exist" in err, err
    _nothing_published(out)


def test_a_corrupted_source_share_is_never_published(sources, tmp_path):
    """Each process hashes its share of the source beside its copy; a mismatch in any share fails the
    run naming the file, and nothing is renamed into place."""
    from tests._corrupt import flip_a_byte

    src = scale_checkpoint(sources["fp32"], tmp_path / "src", 2).parent
    victim = next((src / (src / "latest").read_text()).glob("*rank_1*optim_states.pt"))
    flip_a_byte(victim)
    out, port = tmp_path / "out", job_port()
    results = _finish([_start(r, 2, src, out, port) for r in range(2)])
    # rank 1 hashes the odd share of the files: the victim is named by whichever process hashed it
    assert "its manifest says" in results[0][2] + results[1][2]
    assert results[0][0] == 1, results
    assert re.search(rf"{re.escape(str(victim))} fails verification: its blake3 is [0-9a-f]{{64}}, its manifest says",
                     results[0][2]), results[0][2]
    _nothing_published(out)


@pytest.mark.parametrize("command", ["reshard", "consolidate"])
def test_processes_running_different_shardkit_releases_are_refused_naming_both(sources, tmp_path, command):
    """Mixed versions across nodes: rank 1 runs another shardkit release (a sitecustomize
    sets its version, as tests/test_slurm_two_node.py does for a node); it refuses before writing,
    rank 0 names it, and nothing is published."""
    skew = tmp_path / "skew"
    skew.mkdir()
    (skew / "sitecustomize.py").write_text(
        "import shardkit._version\nshardkit._version.__version__ = '0.0.0+skew'\n"
        "import shardkit.platform.versions as v\nv.SHARDKIT_VERSION = '0.0.0+skew'\n")
    out = tmp_path / "out"
    target = ["-o", out / NAME] if command == "consolidate" else ["--world-size", "3", "-o", out]
    procs, port = [], job_port()
    for rank in range(2):
        extra = {"PYTHONPATH": os.pathsep.join(filter(None, [str(skew), os.environ.get("PYTHONPATH")]))} if rank else {}
        env = _env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra)
        procs.append(subprocess.Popen(_cli(command, sources["fp32"], *target), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    (code0, _, err0), (code1, _, err1) = _finish(procs)
    version = shardkit_version_string
    assert code1 == 1 and re.search(rf"rank 1 of 2 \(host .*\) runs shardkit 0\.0\.0\+skew, rank 0 \(host .*\) runs "
                                     rf"shardkit {re.escape(version)}: every process of one run must run the same "
                                     r"release.*Install the same shardkit on every node", err1), err1
    assert code0 == 1 and "rank 1 of 2" in err0 and "runs shardkit 0.0.0+skew" in err0, err0
    _nothing_published(out)
