"""Traps that make a job hang in silence: a DeepSpeed op build lock left by a
killed build, a socket interface this host lacks, and ranks that wait with nothing printed.

Every lock here is made by torch's own FileBaton (the one DeepSpeed's JIT load takes) in a
TORCH_EXTENSIONS_DIR of the test's own, and every command is the real CLI in a subprocess with a
hard timeout: a regression shows up as a failed assertion, never as a hung test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from shardkit.platform.environment.ext_lock import inspect_locks
from shardkit.platform.environment.interfaces import host_interfaces, missing_interfaces
from shardkit.run.spawn.silence import LockWatch

REPO = Path(__file__).resolve().parents[1]
ZERO3 = REPO / "ds_configs" / "zero3.json"
NO_SUCH_IF = "shardkit_no_such0"

# Takes a real FileBaton on <lock> (O_CREAT|O_EXCL, descriptor kept open, as torch's builder does),
# says so, then sleeps like a build in progress.
_HOLD_BATON = textwrap.dedent("""
    import sys, time
    from torch.utils.file_baton import FileBaton
    baton = FileBaton(sys.argv[1])
    assert baton.try_acquire()
    print("holding", flush=True)
    time.sleep(600)
""")


def _env(ext_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    return {**env, "TORCH_EXTENSIONS_DIR": str(ext_dir), **extra}


def _shardkit(*args: object, env: dict[str, str], cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardkit", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)


def _hold_baton(lock: Path) -> subprocess.Popen[str]:
    lock.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_BATON, str(lock)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
    return proc


@pytest.fixture
def stale_lock(tmp_path: Path) -> Path:
    """The trap itself: a builder holding the baton is SIGKILLed (an OOM kill, a job time limit)."""
    lock = tmp_path / "ext" / "cpu_adam" / "lock"
    builder = _hold_baton(lock)
    builder.send_signal(signal.SIGKILL)
    builder.wait(timeout=30)
    assert lock.exists(), "a killed FileBaton holder leaves its lock behind"
    return lock


def _commands(tmp_path: Path) -> dict[str, list[object]]:
    return {
        "versions": ["versions", "--json"],  # the table wraps long paths across lines
        "preflight": ["preflight", ZERO3, "--nproc", "2", "--device", "cpu"],
        "smoke": ["smoke", "--engine", "zero3", "--nproc", "2", "--device", "cpu", "--quiet"],
        "launch": ["launch", "--launcher", "torchrun", "--standalone", "--nproc_per_node", "2",
                   REPO / "launch" / "train_tiny.py", "--deepspeed_config", ZERO3],
    }


@pytest.mark.parametrize("command", ["versions", "preflight", "smoke", "launch"])
@pytest.mark.slow
def test_stale_lock_stops_the_command_before_ranks_start(command: str, stale_lock: Path, tmp_path: Path) -> None:
    r = _shardkit(*_commands(tmp_path)[command], env=_env(stale_lock.parent.parent), cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    flat = " ".join(out.split())  # rich wraps the versions table
    assert "stale build lock" in flat and "cpu_adam" in flat
    assert str(stale_lock) in "".join(ch for ch in out if not ch.isspace() and ch != "│")  # tmp paths hold no spaces
    assert "rm " in flat and "no build is running" in flat
    assert "spawning" not in out and "starting:" not in out and "Building extension" not in out
    assert stale_lock.exists(), "shardkit names the lock; it never removes it by itself"


@pytest.mark.slow
def test_lock_held_by_a_live_builder_is_a_build_in_progress(tmp_path: Path) -> None:
    lock = tmp_path / "ext" / "cpu_adam" / "lock"
    builder = _hold_baton(lock)
    try:
        env = _env(lock.parent.parent)
        r = _shardkit("versions", "--json", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "is being built" in r.stdout and f"pid {builder.pid}" in r.stdout and "stale" not in r.stdout
        dry = _shardkit("launch", "--launcher", "torchrun", "--dry-run", "--standalone", "--nproc_per_node", "2",
                        REPO / "launch" / "train_tiny.py", "--deepspeed_config", ZERO3, env=env, cwd=tmp_path)
        assert dry.returncode == 0, dry.stderr
        assert "warning:" in dry.stderr and "is being built" in dry.stderr and f"pid {builder.pid}" in dry.stderr
    finally:
        builder.kill()
        builder.wait(timeout=30)
    [found] = inspect_locks(_env(lock.parent.parent))
    assert found.verdict == "stale", "once its builder is gone, the same lock is stale"


def test_a_process_working_in_the_build_folder_counts_as_a_live_builder(tmp_path: Path) -> None:
    """ninja and the compiler hold no lock descriptor, only files in the folder (the builder that
    created the lock may be another process)."""
    folder = tmp_path / "ext" / "fused_adam"
    folder.mkdir(parents=True)
    (folder / "lock").touch()
    worker = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1], 'w'); print('ok', flush=True); "
                               "time.sleep(600)", str(folder / "fused_adam.o")], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "ok"
        [found] = inspect_locks(_env(folder.parent))
        assert found.verdict == "building" and f"pid {worker.pid}" in found.evidence
    finally:
        worker.kill()
        worker.wait(timeout=30)


def test_on_a_network_filesystem_a_lock_is_stale_only_after_a_quiet_spell(tmp_path: Path) -> None:
    """Another node may be building on a shared cache: /proc here cannot see it, so the lock's
    quiet time decides (SHARDKIT_STALE_LOCK_S)."""
    folder = tmp_path / "ext" / "cpu_adam"
    folder.mkdir(parents=True)
    (folder / "lock").touch()
    mounts = tmp_path / "mounts"
    mounts.write_text(f"server:/export {tmp_path} nfs4 rw 0 0\n")
    [young] = inspect_locks({"TORCH_EXTENSIONS_DIR": str(folder.parent)}, mounts=mounts)
    assert young.verdict == "unknown" and "nfs4" in young.evidence
    [old] = inspect_locks({"TORCH_EXTENSIONS_DIR": str(folder.parent), "SHARDKIT_STALE_LOCK_S": "600"},
                          mounts=mounts, now=time.time() + 601)
    assert old.verdict == "stale" and "SHARDKIT_STALE_LOCK_S" in old.evidence


@pytest.mark.slow
def test_bogus_gloo_interface_is_named_before_ranks_start(tmp_path: Path) -> None:
    env = _env(tmp_path / "ext", GLOO_SOCKET_IFNAME=NO_SUCH_IF)
    r = _shardkit("preflight", ZERO3, "--nproc", "2", "--device", "cpu", env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"GLOO_SOCKET_IFNAME='{NO_SUCH_IF}'" in r.stderr and "does not have" in r.stderr
    assert any(name in r.stderr for name in host_interfaces()), "the host's interfaces are listed"
    assert "Fix:" in r.stderr and "spawning" not in r.stdout
    versions = _shardkit("versions", env=env)
    assert versions.returncode == 1 and "GLOO_SOCKET_IFNAME" in " ".join(versions.stdout.split())


def test_interface_rules_follow_gloo_and_nccl() -> None:
    have = ["eth0", "ib0", "lo"]
    assert missing_interfaces("GLOO_SOCKET_IFNAME", "eth0,ib1", have) == ["ib1"]  # gloo: exact, every one
    assert missing_interfaces("GLOO_SOCKET_IFNAME", "eth", have) == ["eth"]
    assert missing_interfaces("NCCL_SOCKET_IFNAME", "eth", have) == []  # NCCL: prefixes, one match enough
    assert missing_interfaces("NCCL_SOCKET_IFNAME", "=eth", have) == ["eth"]  # '=': exact
    assert missing_interfaces("NCCL_SOCKET_IFNAME", "ens,bond", have) == ["ens", "bond"]
    assert missing_interfaces("NCCL_SOCKET_IFNAME", "^docker,lo", have) == []  # exclusions name nothing


def test_launch_watch_names_a_lock_whose_builder_died_during_the_run(stale_lock: Path) -> None:
    watch = LockWatch(_env(stale_lock.parent.parent), after_s=0.1)
    [line] = watch.check()
    assert str(stale_lock) in line and "stale" in line and f"rm {stale_lock}" in line
    assert watch.check() == [], "each lock is named once"


# A tiny real job: 2 gloo ranks through shardkit's own run_ranks; rank 1 sleeps, rank 0 waits for it
# in a barrier. The rank target lives in this file (ranks import it by name).
def sleepy_rank(seconds: float) -> str:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(seconds)
    dist.barrier()
    return "done"


@pytest.mark.slow
def test_silence_watchdog_names_the_silent_ranks_and_why(tmp_path: Path) -> None:
    code = ("from shardkit.run.spawn.process import run_ranks\n"
            "from tests.test_silent_hangs import sleepy_rank\n"
            "run_ranks(sleepy_rank, 2, args=(12,), timeout=150, device='cpu')\n")
    env = {**_env(tmp_path / "ext"), "SHARDKIT_SILENCE_S": "3"}
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=240)
    assert r.returncode == 0, r.stderr
    summary = [line for line in r.stderr.splitlines() if line.startswith("shardkit: silent rank(s)")]
    assert summary, r.stderr
    said = "\n".join(summary)
    assert "rank 1 has printed nothing" in said and "sleepy_rank" in said and "test_silent_hangs.py" in said
    assert "rank 0 has printed nothing" in said and "blocked in the collective barrier" in said
    # the 12 s sleep plus two ranks' start-up (torch imports: 10-20 s each on a loaded 2-core CI box),
    # far from the hang the watchdog could cause (the ranks' own 150 s timeout)
    assert time.monotonic() - start < 120


@pytest.mark.slow
def test_a_rank_waiting_on_a_stale_build_lock_says_so(stale_lock: Path) -> None:
    code = textwrap.dedent("""
        import sys
        from shardkit.run.spawn.silence import start_from_env
        start_from_env()
        from torch.utils.file_baton import FileBaton
        FileBaton(sys.argv[1]).wait()
    """)
    env = {**_env(stale_lock.parent.parent), "SHARDKIT_SILENCE_S": "2", "RANK": "3"}
    proc = subprocess.Popen([sys.executable, "-c", code, str(stale_lock)], stderr=subprocess.PIPE, text=True, env=env,
                            cwd=REPO)
    killer = threading.Timer(60, proc.kill)  # a watchdog that never speaks must not hang the test
    killer.start()
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # the watchdog's line: FileBaton itself never prints
    finally:
        killer.cancel()
        proc.kill()
        proc.wait(timeout=30)
    assert line.startswith("shardkit: rank 3 has printed nothing"), line
    assert f"build lock {stale_lock}" in line and "stale build lock" in line and f"rm {stale_lock}" in line


@pytest.mark.slow
def test_a_rank_alone_at_the_rendezvous_says_so(tmp_path: Path) -> None:
    """Rank 0 of 2 forms its group through a file:// rendezvous rank 1 never reaches."""
    code = textwrap.dedent("""
        import sys
        from shardkit.run.spawn.silence import start_from_env
        start_from_env()
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=2)
    """)
    env = {**_env(tmp_path / "ext"), "SHARDKIT_SILENCE_S": "2", "RANK": "0"}
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "rendezvous")], stderr=subprocess.PIPE,
                            text=True, env=env, cwd=REPO)
    killer = threading.Timer(60, proc.kill)
    killer.start()
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
    finally:
        killer.cancel()
        proc.kill()
        proc.wait(timeout=30)
    assert line.startswith("shardkit: rank 0 has printed nothing"), line
    assert "waiting at the rendezvous" in line and f"file://{tmp_path / 'rendezvous'}" in line
    assert "MASTER_ADDR" in line and "Fix:" in line


def test_parent_names_which_ranks_are_at_the_rendezvous_and_which_never_joined(tmp_path: Path) -> None:
    import io
    import json

    from shardkit.run.spawn.silence import STATUS_SUFFIX, SilenceReporter

    out = io.StringIO()
    reporter = SilenceReporter(tmp_path, world_size=3, out=out)
    assert reporter.poll() is None  # nobody silent: nothing said
    for rank in (0, 2):
        (tmp_path / f"rank{rank}{STATUS_SUFFIX}").write_text(json.dumps(
            {"rank": rank, "kind": "rendezvous", "line": f"shardkit: rank {rank} has printed nothing for 130 s: waiting"}))
    reporter._next = 0.0
    line = reporter.poll()
    assert line is not None and line.startswith("shardkit: silent rank(s) [0, 2] of 3")
    assert "rank(s) [0, 2] wait in it, rank(s) [1] have not joined" in line
    reporter._next = 0.0
    assert reporter.poll() is None, "the same silent ranks are named once"


def test_a_run_that_loads_no_deepspeed_op_is_only_warned(stale_lock: Path) -> None:
    """FSDP2 smoke/preflight ranks never load an op: the stale lock is named, the run goes on."""
    from shardkit.platform.environment.report import EnvironmentCheckError, require_no_hang_traps

    env = _env(stale_lock.parent.parent)
    said: list[str] = []
    [lock] = require_no_hang_traps(env, loads_deepspeed_ops=False, warn=said.append)
    assert lock.verdict == "stale" and said == [said[0]] and said[0].startswith("warning: stale build lock")
    with pytest.raises(EnvironmentCheckError, match=r"stale build lock .*cpu_adam/lock.* Fix: `rm "):
        require_no_hang_traps(env, warn=said.append)


def sleepy_model() -> object:
    """A `--model` factory whose rank 1 never returns: the rank is silent in user code, and rank 0
    goes on into DeepSpeed's initialization and waits there for it."""
    from shardkit.engines.model_factory import tiny_llama

    if os.environ.get("RANK") == "1":
        time.sleep(600)
    return tiny_llama()


@pytest.mark.slow
def test_preflight_names_a_rank_silent_in_its_model_factory(tmp_path: Path) -> None:
    """The real CLI: rank 1 never leaves its --model factory; the parent names it, with the place,
    and rank 0 waiting for it in DeepSpeed's group set-up, within seconds of SHARDKIT_SILENCE_S."""
    env = {**_env(tmp_path / "ext"), "SHARDKIT_SILENCE_S": "5"}
    env.pop("TORCH_EXTENSIONS_DIR")  # the session's built ops: this run must get as far as DeepSpeed
    proc = subprocess.Popen([sys.executable, "-m", "shardkit", "preflight", ZERO3, "--nproc", "2", "--device", "cpu",
                             "--model", "tests.test_silent_hangs:sleepy_model"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    killer = threading.Timer(150, proc.kill)
    killer.start()
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("shardkit: silent rank(s) [0, 1] of 2"):
                break
    finally:
        killer.cancel()
        proc.terminate()  # passed on to the ranks' process groups
        proc.wait(timeout=60)
    said = [line for line in lines if line.startswith("shardkit: silent rank(s)")]
    assert said and said[-1].startswith("shardkit: silent rank(s) [0, 1] of 2"), "".join(lines)
    assert "rank 1 has printed nothing" in said[-1] and "sleepy_model (" in said[-1]
    assert "rank 0 has printed nothing" in said[-1]


@pytest.mark.slow
def test_a_loopback_rendezvous_across_nodes_is_warned(tmp_path: Path) -> None:
    r = _shardkit("launch", "--launcher", "torchrun", "--dry-run", "--nnodes", "2", "--nproc_per_node", "1",
                  "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:29555", REPO / "launch" / "train_tiny.py",
                  "--deepspeed_config", ZERO3, env=_env(tmp_path / "ext"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "warning: the rendezvous host 'localhost' is this machine's loopback" in r.stderr
    assert "spans 2 nodes" in r.stderr and "Fix:" in r.stderr


def test_loopback_rule() -> None:
    from shardkit.platform.environment.interfaces import loopback_rendezvous_warning

    assert loopback_rendezvous_warning("n1", 2, resolve=lambda h: ["10.0.0.5"]) is None
    assert loopback_rendezvous_warning("localhost", 1) is None  # one node: loopback is right
    line = loopback_rendezvous_warning("sk-other-node", 4, resolve=lambda h: ["127.0.1.1"])
    assert line is not None and "'sk-other-node'" in line and "127.0.1.1" in line and "4 nodes" in line
    # this node's own name may map to 127.0.1.1 here (Debian /etc/hosts); the other nodes resolve it properly
    assert loopback_rendezvous_warning(socket.gethostname(), 4, resolve=lambda h: ["127.0.1.1"]) is None


@pytest.mark.slow
def test_a_rank_of_shardkit_launch_that_goes_silent_says_where_it_waits(tmp_path: Path) -> None:
    """`shardkit launch` ranks get the watchdog at interpreter start-up (shardkit's sitecustomize):
    rank 1 sleeps before the barrier, and both ranks' lines come out of the launched job, naming
    rank 1's own call and rank 0's barrier."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import time
        import torch.distributed as dist

        def sleepy_section():
            time.sleep(10)

        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            sleepy_section()
        dist.barrier()
        dist.destroy_process_group()
        print("trained", flush=True)
    """))
    env = {**_env(tmp_path / "ext"), "SHARDKIT_SILENCE_S": "3", "OMP_NUM_THREADS": "1"}
    r = _shardkit("launch", "--launcher", "torchrun", "--nproc_per_node", "2", "--standalone", script,
                  env=env, cwd=tmp_path, timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and out.count("trained") == 2, out[-3000:]
    lines = [line for line in out.splitlines() if "has printed nothing for" in line]
    assert any(line.startswith("shardkit: rank 1 ") and "sleepy_section" in line for line in lines), out[-3000:]
    assert any(line.startswith("shardkit: rank 0 ") and "collective barrier" in line for line in lines), out[-3000:]
