"""`shardkit reshard` split across processes and against careless use: under torchrun every launched
process writes its share and the result is byte-identical to one process's; a rank killed mid-write
or never started fails the run, named, with nothing published; two runs writing one output at once:
one wins, the other refuses; SIGTERM stops the writers and removes the staging folder; a corrupted
or changing source is never published. Real processes (torchrun, the CLI), hard timeouts."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks._scale_zero3 import scale_checkpoint
from shardkit.core.errors import CheckpointError, UsageError
from shardkit.storage.manifest import read_manifest
from shardkit.storage.shared_save import launch_from_env
from shardkit.storage.tags import STAGING_PREFIX
from tests import _ranks_zero3 as R
from tests._ports import job_port
from tests._slow_writes import slow_fsync_cli

pytestmark = pytest.mark.slow

TIMEOUT_S = 180


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    return R.build_sources(tmp_path_factory.getbasetemp() / "zero3")


@pytest.fixture(scope="session")
def big(sources, tmp_path_factory) -> Path:
    """The fp32 source scaled 150x (~250 MB, sealed): large enough to interrupt mid-write."""
    return scale_checkpoint(sources["fp32"], tmp_path_factory.mktemp("big"), 150).parent


def _cli(*args: object, env: dict[str, str] | None = None) -> list[str]:
    return [sys.executable, "-m", "shardkit", *map(str, args)]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")}
    env.update(extra)
    return env


def _files(out: Path) -> dict[str, tuple[int, str]]:
    m = read_manifest(out / (out / "latest").read_text())
    return {e.path: (e.size, e.digest) for e in m.files}


def _nothing_published(out: Path) -> None:
    assert not out.exists() or [p.name for p in out.iterdir()] == [], list(out.iterdir())


def test_two_processes_under_torchrun_write_the_bytes_one_process_writes(sources, tmp_path):
    one = tmp_path / "one"
    done = subprocess.run(_cli("reshard", sources["bf16_offload"], "--world-size", "3", "-o", one), env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "shardkit",
           "reshard", str(sources["bf16_offload"]), "--world-size", "3", "-o", str(two), "--workers", "1"]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr + done.stdout
    assert re.search(r"wrote .*two/global_step1 by 2 processes \(torchrun\): 6 files", done.stdout), done.stdout
    assert re.search(r"rank 1 of 2 \(torchrun\): wrote its share, [1-5] files", done.stdout), done.stdout
    assert _files(two) == _files(one)  # same names, sizes and digests: byte-identical files
    assert not any(p.name.startswith(STAGING_PREFIX) for p in two.iterdir())
    verify = subprocess.run(_cli("verify", two), env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert verify.returncode == 0, verify.stdout


def _start_rank(rank: int, world: int, src: Path, out: Path, port: str, slow: bool = False,
                **extra: str) -> subprocess.Popen[str]:
    """``slow``: every fsync of the process takes seconds (tests/_slow_writes.py), so a kill lands mid-share."""
    env = _env(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra)
    argv = ("reshard", src, "--world-size", "3", "-o", out, "--workers", "1")
    return subprocess.Popen(slow_fsync_cli(*argv) if slow else _cli(*argv), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path_glob: Path, pattern: str, timeout: float = 60) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list(path_glob.glob(pattern)) if path_glob.exists() else []
        if found:
            return found[0]
        time.sleep(0.005)
    raise AssertionError(f"{pattern} never appeared under {path_glob}")


def test_a_rank_killed_mid_write_fails_the_run_naming_it(big, tmp_path):
    out = tmp_path / "out"
    fast = {"SHARDKIT_STALE_S": "3"}
    port = job_port()
    # rank 1's fsyncs slowed: its whole share took under a second, and a test process the load kept
    # off the CPU that long would kill a rank that had finished (rank 0 then publishes: exit 0, not 1)
    r1 = _start_rank(1, 2, big, out, port, slow=True, **fast)
    r0 = _start_rank(0, 2, big, out, port, **fast)
    try:
        _wait_for(out, f"{STAGING_PREFIX}*/.shardkit-verdict.json")  # both agreed: rank 1 writes its share now
    except BaseException:
        _stop(r0, r1)
        raise
    rank0_names_killed_rank1(r0, r1, out)


def _stop(*procs: subprocess.Popen[str]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def rank0_names_killed_rank1(r0: subprocess.Popen[str], r1: subprocess.Popen[str], out: Path) -> None:
    """SIGKILL rank 1 mid-share: rank 0 fails within a minute naming it by its stopped heartbeat,
    and nothing is published in ``out``."""
    try:
        os.kill(r1.pid, signal.SIGKILL)  # rank 1 dies with its share half written
        started = time.monotonic()
        _, err = r0.communicate(timeout=TIMEOUT_S)
    finally:
        _stop(r0, r1)
    assert r0.returncode == 1, err
    assert re.search(r"rank 1 of 2 stopped while writing its share: no heartbeat for \d+ s \(killed, or its node went "
                     r"down\).*run the whole command again", err), err
    assert time.monotonic() - started < 60
    _nothing_published(out)


def test_a_rank_that_never_starts_is_named_within_the_timeout(sources, tmp_path):
    out = tmp_path / "out"
    r0 = _start_rank(0, 2, sources["fp32"], out, job_port(), SHARDKIT_JOIN_TIMEOUT_S="3")
    _, err = r0.communicate(timeout=TIMEOUT_S)
    assert r0.returncode == 1
    assert re.search(r"rank 1 of 2 never joined within 3 s \(torchrun job .*\): it did not start, or its node does not "
                     r"see .* \(-o must be on storage every node shares\)", err), err
    _nothing_published(out)
    # the other way round: rank 1 alone waits for a claim that never comes, and says so
    r1 = _start_rank(1, 2, sources["fp32"], out, job_port(), SHARDKIT_JOIN_TIMEOUT_S="2")
    _, err = r1.communicate(timeout=TIMEOUT_S)
    assert r1.returncode == 1 and "rank 0 did not claim the staging folder" in err and "it does not exist" in err, err


def test_two_runs_writing_one_output_at_once_one_wins_the_other_refuses(big, tmp_path):
    out = tmp_path / "out"
    runs = [subprocess.Popen(_cli("reshard", big, "--world-size", "3", "-o", out), env=_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=TIMEOUT_S), p.stderr.read() if p.stderr else "") for p in runs]
    for p in runs:
        p.stdout.close() if p.stdout else None
        p.stderr.close() if p.stderr else None
    codes = sorted(code for code, _ in results)
    assert codes == [0, 1], results
    loser = next(err for code, err in results if code == 1)
    # at once: the live claim is named; a moment later: the finished checkpoint is
    assert ("another shardkit run (" in loser and "is writing this output right now" in loser) or \
        "already holds checkpoint 'global_step2'" in loser, loser
    verify = subprocess.run(_cli("verify", out), env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert verify.returncode == 0, verify.stdout


def test_sigterm_mid_write_stops_the_writers_and_removes_the_staging_folder(big, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "older").mkdir()
    scale_checkpoint(big, out, 1)  # a checkpoint already there: 'latest' must still name it afterwards
    before = (out / "latest").read_text()
    # fsyncs slowed (tests/_slow_writes.py): the rest of the 250 MB write can end between two polls of a
    # test process the load keeps off the CPU, and the SIGTERM then comes after the publish (exit 0)
    run = subprocess.Popen(slow_fsync_cli("reshard", big, "--world-size", "3", "-o", out, "--tag", "new"), env=_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(out, f"{STAGING_PREFIX}new/*optim_states.pt")
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=TIMEOUT_S)
    finally:
        run.kill()
        run.wait()
    assert run.returncode == 143, err
    assert "terminated (SIGTERM); nothing was published: the partial output (staging folder or temporary file) was removed" in err
    assert sorted(p.name for p in out.iterdir()) == sorted(["older", before, "latest"])
    assert (out / "latest").read_text() == before


def test_a_corrupted_source_is_never_published(sources, tmp_path):
    """The repartition reads byte ranges; the source's digest is checked beside the writes and
    nothing is published unless it matched."""
    from tests._corrupt import flip_a_byte

    src = tmp_path / "src"
    scale_checkpoint(sources["fp32"], src, 2)
    victim = next((src / "global_step2").glob("*rank_1*optim_states.pt"))
    flip_a_byte(victim)
    from shardkit.checkpoint.ops.reshard import reshard_checkpoint

    with pytest.raises(CheckpointError, match=rf"refusing to publish the reshard of .*: {re.escape(str(victim))} fails "
                       r"verification: its blake3 is [0-9a-f]{64}, its manifest says [0-9a-f]{64}.*Nothing was written"):
        reshard_checkpoint(src, tmp_path / "out", 3)
    _nothing_published(tmp_path / "out")
    done = reshard_checkpoint(src, tmp_path / "unverified", 3, verify=False, warn=lambda m: None)
    assert done.verified == "sizes"


def test_a_source_rewritten_while_it_is_read_is_refused(sources, tmp_path, monkeypatch):
    import shardkit.checkpoint.ops.reshard as reshard

    src = tmp_path / "src"
    shutil.copytree(sources["fp32"], src)
    victim = next((src / "global_step2").glob("*rank_0*optim_states.pt"))
    real = reshard.write_torch_zip

    def write_then_a_save_rewrites_the_source(path, data, records, **kw):
        out = real(path, data, records, **kw)
        os.utime(victim, ns=(time.time_ns(), time.time_ns() + 10**9))
        return out

    monkeypatch.setattr(reshard, "write_torch_zip", write_then_a_save_rewrites_the_source)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(victim))}: was modified while the reshard read it "
                       r"\(size/mtime/inode changed\): the output would mix two saves\. Nothing was published"):
        reshard.reshard_checkpoint(src, tmp_path / "out", 3, warn=lambda m: None)
    _nothing_published(tmp_path / "out")


@pytest.mark.parametrize(("env", "want"), [
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}, (0, 1, "single process")),  # the sbatch script itself
    ({"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "4", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}, (2, 4, "srun")),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, (1, 2, "torchrun")),
    ({"RANK": "0", "WORLD_SIZE": "1"}, (0, 1, "single process")),
    ({}, (0, 1, "single process")),
])
def test_the_share_comes_from_the_launcher_of_the_step(env, want):
    launch = launch_from_env(env)
    assert (launch.rank, launch.world, launch.launcher) == want


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "1", "WORLD_SIZE": "2"}, r"RANK=1 WORLD_SIZE=2 without MASTER_ADDR/MASTER_PORT or TORCHELASTIC_RUN_ID"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, r"RANK=2 with WORLD_SIZE=2: the rank must be in 0\.\.1"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, r"RANK='x' / WORLD_SIZE='2': not integers"),
])
def test_launcher_variables_that_cannot_be_a_share_are_refused(env, message):
    with pytest.raises(UsageError, match=message):
        launch_from_env(env)


def test_two_converts_writing_one_output_at_once_one_wins_the_other_refuses(big, tmp_path):
    """The save sequence every writer shares (staged_save.atomic_checkpoint) claims its staging
    folder exclusively: two converts into one -o no longer share it (both used to exit 0 with a
    published checkpoint failing verify)."""
    out = tmp_path / "out"
    runs = [subprocess.Popen(_cli("convert", big, "--to", "fsdp2", "-o", out), env=_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=TIMEOUT_S) + (p.returncode,) for p in runs]
    codes = sorted(code for _, _, code in results)
    assert codes in ([0, 1], [0, 2]), results
    loser = next(err for _, err, code in results if code != 0)
    assert ("another shardkit run (" in loser and "is writing this output right now" in loser) or \
        "already holds checkpoint" in loser, loser
    verify = subprocess.run(_cli("verify", out), env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert verify.returncode == 0, verify.stdout


@pytest.mark.parametrize(("command", "sig", "code"), [
    ("reshard", signal.SIGINT, 130), ("convert", signal.SIGTERM, 143), ("convert", signal.SIGINT, 130)])
def test_an_interrupt_mid_write_leaves_no_staging_folder(big, tmp_path, command, sig, code):
    """Ctrl-C or a scheduler's SIGTERM while the files are written: the writers stop, the staging
    folder is removed (the shared save sequence convert uses included), nothing is published."""
    out = tmp_path / "out"
    argv = (["reshard", big, "--world-size", "3", "-o", out] if command == "reshard"
            else ["convert", big, "--to", "fsdp2", "-o", out])
    # fsyncs slowed: the signal must land mid-write, not after a run that finished first (tests/_slow_writes.py)
    run = subprocess.Popen(slow_fsync_cli(*argv), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(out, f"{STAGING_PREFIX}*")
        run.send_signal(sig)
        _, err = run.communicate(timeout=TIMEOUT_S)
    finally:
        run.kill()
        run.wait()
    assert run.returncode == code, err
    assert ("interrupted" if code == 130 else "terminated (SIGTERM)") in err and "Traceback" not in err, err
    _nothing_published(out)


@pytest.mark.parametrize("command", ["reshard", "convert"])
def test_an_interrupt_between_sealing_and_the_rename_leaves_no_staging_folder(sources, tmp_path, monkeypatch, command):
    """Seal removes the owner file the clean-up looks for before it renames the folder into place:
    a Ctrl-C in that window (caught by CI under load) must still remove the staging folder."""
    import shardkit.storage.shared_save as shared_save
    from shardkit.checkpoint.ops.convert.to_dcp import convert_to_dcp
    from shardkit.checkpoint.ops.reshard import reshard_checkpoint

    def interrupted(*_args: object, **_kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(shared_save, "publish_tag", interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        if command == "reshard":
            reshard_checkpoint(sources["fp32"], out, world_size=3)
        else:
            convert_to_dcp(sources["fp32"], out)
    _nothing_published(out)
