import pytest

from shardkit.core.errors import DistributedError
from shardkit.run.spawn.process import run_ranks
from tests import _ranks_spawn as targets


@pytest.mark.slow
def test_ranks_form_a_group_and_return_values():
    results = run_ranks(targets.all_reduce_rank, 3, timeout=120, backend="gloo")
    assert [r.value for r in results] == [(0, 0, 3.0), (1, 1, 3.0), (2, 2, 3.0)]


@pytest.mark.slow
def test_failing_rank_is_reported_with_its_traceback_and_peers_are_killed(monkeypatch):
    import shardkit.run.spawn.process as spawn

    monkeypatch.setattr(spawn, "FAILURE_GRACE_S", 2.0)
    with pytest.raises(DistributedError, match=r"(?s)ranks failed.*rank 1.*ValueError: boom on rank 1"):
        run_ranks(targets.rank1_raises, 2, timeout=120, backend="gloo")


@pytest.mark.slow
def test_hanging_ranks_are_killed_at_the_timeout_and_named():
    results = run_ranks(targets.sleeps_forever, 2, timeout=3, backend="gloo", raise_on_error=False)
    assert [r.ok for r in results] == [False, False]
    assert "did not finish within 3s" in results[0].error
    with pytest.raises(DistributedError, match=r"ranks \[0, 1\] did not finish within 3s"):
        run_ranks(targets.sleeps_forever, 2, timeout=3, backend="gloo")


def test_a_rank_that_exits_without_a_result_is_a_failure_not_a_silent_none():
    with pytest.raises(DistributedError, match=r"rank 0 exited with code 0 without reporting a result"):
        run_ranks(targets.exits_silently, 1, timeout=60, backend="gloo")


@pytest.mark.slow
def test_a_reused_workdir_never_returns_an_earlier_runs_result(tmp_path):
    run_ranks(targets.all_reduce_rank, 1, timeout=60, backend="gloo", workdir=tmp_path)
    results = run_ranks(targets.exits_silently, 1, timeout=60, backend="gloo", workdir=tmp_path, raise_on_error=False)
    assert results[0].value is None and not results[0].ok


@pytest.mark.slow
def test_the_timeout_also_kills_what_a_rank_started(tmp_path):
    import os

    pid_file = tmp_path / "child.pid"
    # long enough for a loaded CI machine to start the rank (it sleeps an hour, so the timeout fires)
    run_ranks(targets.leaves_a_child, 1, args=(str(pid_file),), timeout=20, backend="gloo", raise_on_error=False)
    assert pid_file.exists(), "the rank did not start its child within the 20 s timeout (a very slow machine?)"
    child = int(pid_file.read_text())
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        import time

        time.sleep(0.1)
    os.kill(child, 9)
    raise AssertionError(f"rank's child process {child} survived the timeout")


# ---------------------------------------------------------------- ranks sized to the machine


def test_more_ranks_than_visible_gpus_is_refused_naming_both_numbers_and_the_fix():
    from shardkit.core.errors import UsageError
    from shardkit.run.spawn.plan import plan_ranks

    with pytest.raises(UsageError, match=r"--world-size 2 asks for 2 ranks but 1 GPU\(s\) are visible.*--world-size 1 \(or fewer\), or --device cpu"):
        plan_ranks(2, "auto", gpus=1, cores=16)
    with pytest.raises(UsageError, match=r"--world-size 3 asks for 3 ranks but 2 GPU"):
        plan_ranks(3, "gpu", gpus=2, cores=16)
    with pytest.raises(UsageError, match=r"--device gpu: no CUDA GPU is visible.*--device cpu"):
        plan_ranks(None, "gpu", gpus=0, cores=16)
    with pytest.raises(UsageError, match=r"--device 'tpu': choose one of auto, cpu, gpu"):
        plan_ranks(None, "tpu", gpus=0, cores=16)  # type: ignore[arg-type]


def test_default_is_one_rank_per_gpu_else_two_cpu_ranks_and_cpu_is_always_allowed():
    from shardkit.run.spawn.plan import plan_ranks

    assert (plan_ranks(None, "auto", gpus=8, cores=16).nproc, plan_ranks(None, "auto", gpus=8, cores=16).backend) == (8, "nccl")
    assert plan_ranks(None, "auto", gpus=0, cores=2).device == "cpu" and plan_ranks(None, "auto", gpus=0, cores=2).nproc == 2
    cpu = plan_ranks(4, "cpu", gpus=1, cores=2)  # more ranks than GPUs, but on the CPU: fine
    assert (cpu.nproc, cpu.backend, cpu.warnings) == (4, "gloo", ())
    assert cpu.env == {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    assert plan_ranks(1, "auto", gpus=1, cores=2).env == {}


def test_a_rank_count_far_beyond_the_cores_gets_a_warning():
    from shardkit.run.spawn.plan import plan_ranks

    (warning,) = plan_ranks(64, "cpu", gpus=0, cores=2).warnings
    assert "--world-size 64 starts 64 CPU ranks on 2 core(s)" in warning and "use --world-size 2" in warning


def test_cpu_ranks_cannot_see_a_gpu_and_deepspeed_is_forced_to_its_cpu_accelerator():
    results = run_ranks(targets.sees_devices, 2, timeout=120, device="cpu")
    for r in results:
        assert r.value == {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", "cuda_devices": 0, "backend": "gloo"}


def test_a_failed_ranks_log_ends_with_its_traceback(tmp_path):
    results = run_ranks(targets.logs_then_raises, 1, args=(str(tmp_path),), timeout=60, backend="gloo", raise_on_error=False)
    assert results[0].error_type == "ValueError"
    log = (tmp_path / "rank0.log").read_text()
    assert "engine chatter" in log and "Traceback (most recent call last)" in log
    assert log.rstrip().endswith("ValueError: Type fp16 is not supported on your device.")


# ---------------------------------------------------------------- ranks never outlive their parent

_PARENT = """
import sys
from shardkit.run.spawn.process import run_ranks
from tests import _ranks_spawn as targets
run_ranks(targets.writes_pid_then_sleeps, 2, args=(sys.argv[1],), timeout=600, backend="gloo")
"""


def _start_parent_and_wait_for_ranks(tmp_path):
    import subprocess
    import sys
    import time

    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path)], start_new_session=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and len(list(tmp_path.glob("rank*.pid"))) < 2:
        assert parent.poll() is None, f"parent exited early with {parent.returncode}"
        time.sleep(0.1)
    pids = [tuple(int(x) for x in f.read_text().split()) for f in sorted(tmp_path.glob("rank*.pid"))]
    assert len(pids) == 2, "ranks did not start within 90 s"
    return parent, [p for p, _ in pids], [c for _, c in pids]


def _gone_within(pids, seconds):
    import os
    import time

    deadline = time.monotonic() + seconds
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.1)
    for p in alive:  # do not leave them behind for the next test
        try:
            os.kill(p, 9)
        except ProcessLookupError:
            pass
    return alive


def _alive(pid):
    import os

    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead, merely unreaped
    except FileNotFoundError:
        return False
    except OSError:
        os.kill(pid, 0)
        return True


@pytest.mark.slow
def test_ranks_die_when_their_parent_is_killed_with_sigkill(tmp_path):
    import os
    import signal

    parent, ranks, children = _start_parent_and_wait_for_ranks(tmp_path)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(10)
    # the kernel's parent-death signal reaches each rank, whose handler kills its whole group:
    # what the rank started (a JIT build, DataLoader workers) goes with it
    assert _gone_within(ranks + children, 5) == [], "ranks or their children outlived a SIGKILLed parent"


@pytest.mark.slow
def test_sigterm_to_the_parent_reaches_the_ranks_and_what_they_started(tmp_path):
    import os
    import signal

    parent, ranks, children = _start_parent_and_wait_for_ranks(tmp_path)
    os.kill(parent.pid, signal.SIGTERM)
    assert parent.wait(10) == -signal.SIGTERM  # the parent still dies of the signal it got
    assert _gone_within(ranks + children, 5) == [], "ranks or their children outlived a SIGTERMed parent"


def test_a_handler_set_from_c_is_left_alone_and_restore_does_not_raise(monkeypatch):
    """signal.getsignal() is None for a handler installed from C (an embedding host, a native
    library); signal.signal(sig, None) would raise TypeError inside run_ranks' finally and hide the
    real error."""
    import signal

    from shardkit.run.spawn.lifetime import _ForwardSignals

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(signal, "getsignal", lambda sig: None)
    forwarding = _ForwardSignals([])
    forwarding.install()
    assert forwarding.previous == {}
    forwarding.restore()  # TypeError before the fix
    monkeypatch.undo()
    assert {s: signal.getsignal(s) for s in before} == before
