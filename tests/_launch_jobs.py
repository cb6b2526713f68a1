"""What the tests of `shardkit launch --launcher deepspeed --hostfile ...` over DeepSpeed's multi-node
runners share (tests/test_launch_pdsh.py, tests/test_launch_mpi.py): the two namespaced nodes and the
pdsh/ssh stand-in that reaches them, the ZeRO-3 training script every rank runs, the job folder, one
launch run with a hard timeout, and the assertions on how a job ended."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardkit.autopreflight import EXIT_CODE

NODES = {"sknodeA": "127.0.77.1", "sknodeB": "127.0.77.2"}
JOB_TIMEOUT_S = 240  # 50-75 s each on 2 busy cores (DeepSpeed's import in the launch(es) and both ranks)

# pdsh -S -f FANOUT -w host1,host2 CMD... (deepspeed.launcher.multinode_runner.PDSHRunner) and
# ssh [-o X] [-p N] host CMD... (the runner's reachability check): each host's command runs in its
# own UTS + mount namespace with only HOME, PATH and LANG, as an ssh login would give it. %n is
# the host's index (pdsh's own substitution). SKPDSH_DROP=NAME drops `export NAME=...;` (a runner
# that does not carry that variable). -S: the largest exit status of the hosts.
STAND_IN = textwrap.dedent(r"""
    #!/bin/bash
    set -u
    me="$(basename "$0")"
    hosts=""
    if [ "$me" = pdsh ]; then
        while [ $# -gt 0 ]; do
            case "$1" in -S) shift ;; -f) shift 2 ;; -w) hosts="$2"; shift 2 ;; *) break ;; esac
        done
    else
        while [ $# -gt 0 ]; do
            case "$1" in -o|-p) shift 2 ;; -*) shift ;; *) hosts="$1"; shift; break ;; esac
        done
    fi
    cmd="$*"
    if [ -n "${SKPDSH_DROP:-}" ]; then
        cmd="$(printf '%s' "$cmd" | sed -E "s/export ${SKPDSH_DROP}=[^;]*; //")"
    fi
    IFS=, read -ra list <<<"$hosts"
    pids=()
    i=0
    for h in "${list[@]}"; do
        one="${cmd//%n/$i}"
        unshare -u -m sh -c 'hostname "$1" && mount --bind "$2" /etc/hosts &&
            exec env -i HOME="$HOME" PATH="$PATH" LANG="${LANG:-C.UTF-8}" bash -c "$3"' \
            sh "$h" "$SKPDSH_HOSTS" "$one" &
        pids+=($!)
        i=$((i + 1))
    done
    worst=0
    for p in "${pids[@]}"; do wait "$p"; rc=$?; [ "$rc" -gt "$worst" ] && worst=$rc; done
    exit "$worst"
""").lstrip()

DS_TRAIN = textwrap.dedent(
    """
    import os
    import socket
    import sys

    # the test session's ninja first (job_folder's SKTEST_NINJA_DIR): OpenMPI puts /usr/bin ahead on PATH,
    # and a ninja of another version takes the shared op cache as stale and rebuilds it
    if os.environ.get("SKTEST_NINJA_DIR"):
        os.environ["PATH"] = os.environ["SKTEST_NINJA_DIR"] + os.pathsep + os.environ["PATH"]

    import deepspeed
    import torch
    import torch.nn as nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(16, 32)
            self.out_head = nn.Linear(32, 4)

        def forward(self, x):
            return self.out_head(torch.relu(self.body(x)))


    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3}}
    torch.manual_seed(0)
    engine, _, _, _ = deepspeed.initialize(model=Net(), model_parameters=None, config=config)
    if "--replace-head" in sys.argv:
        engine.module.out_head = nn.Linear(32, 4)  # replaced after deepspeed.initialize: never partitioned
    loss = engine(torch.randn(2, 16)).square().mean()
    engine.backward(loss)
    engine.step()
    print(f"rank {engine.global_rank} trained on {socket.gethostname()}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # Done and flushed: leave without interpreter finalization (docs/slurm.md). DeepSpeed keeps its
    # gloo groups, so destroy_process_group does not end them; a gloo worker thread that frees the
    # last collective's tensors after finalization began aborted the rank (-6) in 1 run of 3 under load.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
    """
)


def can_make_nodes() -> str | None:
    """Why this machine cannot give a process its own hostname and /etc/hosts (None: it can)."""
    try:
        r = subprocess.run(["unshare", "-u", "-m", "sh", "-c", "hostname sk-probe && mount --bind /etc/hosts /etc/hosts"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare did not run: {exc}"
    return None if r.returncode == 0 else f"`unshare -u -m` + `mount --bind` refused here (a container needs CAP_SYS_ADMIN): {r.stderr.strip()}"


def nodes_hosts_file(folder: Path) -> Path:
    """The /etc/hosts each node's namespace gets: localhost and both nodes' addresses."""
    hosts = folder / "hosts"
    hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{ip} {name}\n" for name, ip in NODES.items()))
    return hosts


def job_folder(folder: Path, hostfile: str, script: str = DS_TRAIN) -> dict[str, str]:
    """train.py, hostfile, .deepspeed_env and an empty bin/ (first on PATH, for stand-ins) in
    `folder`; returns the environment to launch from."""
    (folder / "bin").mkdir()
    (folder / "train.py").write_text(script)
    (folder / "hostfile").write_text(hostfile)
    # what a user puts in .deepspeed_env for CPU ranks: these do not start with PYTHON, so the runner
    # carries them only from this file
    lines = "DS_ACCELERATOR=cpu\nOMP_NUM_THREADS=1\nCUDA_VISIBLE_DEVICES=\n"
    # The ranks load DeepSpeed's ops with the `ninja` on their PATH, and a ninja of another version than
    # the session's (Debian's 1.11 in /usr/bin beside the venv's 1.13, OpenMPI puts /usr/bin first)
    # reads the shared ~/.cache/torch_extensions as stale: the rank rebuilds fused_adam for minutes under
    # the lock every other DeepSpeed test (the other xdist worker's too) waits on, and a job killed at
    # JOB_TIMEOUT_S mid-build leaves that lock behind. DS_TRAIN puts this folder first.
    ninja = shutil.which("ninja")
    if ninja:
        lines += f"SKTEST_NINJA_DIR={Path(ninja).parent}\n"
    (folder / ".deepspeed_env").write_text(lines)
    return {
        **os.environ, "PATH": f"{folder / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1",
    }


def install_stand_in(folder: Path, *names: str) -> None:
    """The ssh/pdsh stand-in as each of `names` in folder/bin."""
    for name in names:
        (folder / "bin" / name).write_text(STAND_IN)
        (folder / "bin" / name).chmod(0o755)


def run_launch(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`shardkit launch --launcher deepspeed --hostfile hostfile ARGS` in its own process group; at
    JOB_TIMEOUT_S the whole group is killed and the test fails with the output so far."""
    argv = [sys.executable, "-m", "shardkit", "launch", "--launcher", "deepspeed", "--hostfile", "hostfile", *args]
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{argv} did not finish within {JOB_TIMEOUT_S}s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


def last_launch_line(out: str) -> str:
    """The launch's closing line (its verdict on the ranks' preflight)."""
    return [line for line in out.splitlines() if line.startswith("shardkit launch: ")][-1]


def assert_passed_on_both_ranks(r: subprocess.CompletedProcess[str], hosts: tuple[str, str] | None = None) -> None:
    """Exit 0, both ranks trained (on these hosts, where given) and the launch's line says passed on 2 of 2."""
    assert r.returncode == 0, r.stdout[-4000:]
    for rank, host in enumerate(hosts or ("", "")):
        assert f"rank {rank} trained on {host}" in r.stdout, r.stdout[-4000:]
    passed = "shardkit launch: placement preflight passed on 2 of 2 rank(s)"
    if hosts:
        passed += f" (hosts: {', '.join(sorted(set(hosts)))})"
        assert last_launch_line(r.stdout) == passed, r.stdout[-3000:]
    else:
        assert last_launch_line(r.stdout).startswith(passed), r.stdout[-3000:]


def assert_stopped_on_both_ranks(r: subprocess.CompletedProcess[str], tensor: str = "module.out_head.weight") -> None:
    """The replaced module stopped both ranks before their first optimizer step: exit 3, no rank
    trained, DeepSpeed's own error never reached, the tensor named, and the launch's line says so."""
    assert r.returncode == EXIT_CODE, r.stdout[-4000:]
    assert "ds_active_sub_modules" not in r.stdout and "trained on" not in r.stdout, r.stdout[-4000:]
    assert tensor in r.stdout, r.stdout[-4000:]  # the table names the replaced module's tensors
    assert last_launch_line(r.stdout).startswith(
        "shardkit launch: placement preflight failed on rank(s) [0, 1] of 2 before the first optimizer step: "
        "placement preflight (deepspeed-zero3, 2 rank(s)"), r.stdout[-3000:]
