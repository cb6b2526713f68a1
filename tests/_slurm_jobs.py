"""What the Slurm tests share: a command run in its own process group with a hard timeout, and the
sbatch of launch/slurm_multinode.sbatch waited for and read back (tests/test_slurm.py on one node,
tests/test_slurm_two_node.py on two)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests._ports import free_port

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "launch" / "slurm_local_cluster.sh"
TEMPLATE = REPO / "launch" / "slurm_multinode.sbatch"
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def run_grouped(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run in its own process group; at the timeout kill the whole group and raise TimeoutExpired."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise subprocess.TimeoutExpired(argv, timeout, output=out) from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


@dataclass
class Job:
    job_id: int
    state: str
    """Slurm's JobState at the end (COMPLETED, FAILED ...)."""
    exit_code: str
    """Slurm's ExitCode, "status:signal"."""
    output: str
    """The job's --output file: the batch script, srun, torchrun and every rank."""
    preflight: dict | None
    """Rank 0's preflight report (SHARDKIT_AUTOPREFLIGHT_JSON), when it wrote one."""
    master_port: int
    folder: Path
    """The job's working folder (its output, and what its ranks wrote)."""


def scontrol_job(job_id: int, env: dict[str, str]) -> dict[str, str]:
    r = run_grouped(["scontrol", "show", "job", "-o", str(job_id)], env, 30)
    return dict(re.findall(r"(\w+)=(\S*)", r.stdout))


def submit(env: dict[str, str], folder: Path, script: Path, ds_config: str, *script_args: str, nodes: int,
           timeout_s: float, extra_env: dict[str, str] | None = None) -> Job:
    """sbatch the template on ``nodes`` nodes x 2 CPU ranks, wait for it (cancelled after ``timeout_s``),
    read its output and rank 0's preflight report. A job stuck past ``timeout_s`` fails the test
    with every process's stacks and the daemons' logs; at once when a daemon of the cluster died."""
    job = _submit_once(env, folder, script, ds_config, *script_args, nodes=nodes, timeout_s=timeout_s,
                       extra_env=extra_env)
    if isinstance(job, str):
        pytest.fail(job)
    return job


def _submit_once(env: dict[str, str], folder: Path, script: Path, ds_config: str, *script_args: str, nodes: int,
                 timeout_s: float, extra_env: dict[str, str] | None) -> Job | str:
    """One sbatch of the template, waited for; a stuck job is stopped and described instead."""
    folder.mkdir(parents=True, exist_ok=True)
    report = folder / "preflight.json"
    # a free port per job: the template's default (20000 + job id) could meet another cluster's job
    master_port = free_port()
    job_env = {
        **env,
        # the job runs `shardkit` from PATH: this interpreter's console scripts first
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
        "DEVICE": "cpu", "NPROC_PER_NODE": "2", "SCRIPT": str(script), "DS_CONFIG": ds_config,
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "SHARDKIT_AUTOPREFLIGHT_JSON": str(report),
        "MASTER_PORT": str(master_port),
        # a job stuck past its timeout is asked where it is: SIGABRT makes every Python process
        # of it write its threads' stacks into the job's output (_stop_stuck_job)
        "PYTHONFAULTHANDLER": "1",
        **(extra_env or {}),
    }
    # 2 CPUs for the launcher and its ranks, or all the node has (a 1-CPU runner could never start it)
    node_cpus = int(run_grouped(["sinfo", "-h", "-N", "-o", "%c"], env, 30).stdout.split()[0])
    r = run_grouped(
        ["sbatch", "--parsable", f"--nodes={nodes}", "--gpus-per-node=0", f"--cpus-per-task={min(2, node_cpus)}",
         "--time=10", f"--chdir={folder}", f"--output={folder}/job-%j.out", str(TEMPLATE), *script_args],
        job_env, 60,
    )
    assert r.returncode == 0, f"sbatch refused the template: {r.stdout}"
    job_id = int(r.stdout.strip().splitlines()[-1].split(";")[0])
    deadline = time.monotonic() + timeout_s
    info = scontrol_job(job_id, env)
    while info.get("JobState") not in TERMINAL_STATES:
        if time.monotonic() > deadline:
            return _stop_stuck_job(job_id, info.get("JobState"), timeout_s, folder, env)
        if not all(_daemon_states(env).values()):
            # a dead slurmd never answers again: waiting out the timeout would only delay the failure
            return (f"a cluster daemon died while job {job_id} was {info.get('JobState')}: "
                    + _stop_stuck_job(job_id, info.get("JobState"), timeout_s, folder, env))
        time.sleep(2)
        info = scontrol_job(job_id, env)
    output = (folder / f"job-{job_id}.out").read_text(errors="replace")
    preflight = json.loads(report.read_text()) if report.exists() else None
    return Job(job_id, info["JobState"], info.get("ExitCode", "?"), output, preflight, master_port, folder)


def job_processes(job_id: int) -> dict[int, str]:
    """pid -> command line of every process of Slurm job ``job_id`` on this machine (its
    SLURM_JOB_ID in the process environment: the batch script, srun, launchers, ranks)."""
    found: dict[int, str] = {}
    marker = f"SLURM_JOB_ID={job_id}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
    return found


def _stop_stuck_job(job_id: int, state: str | None, timeout_s: float, folder: Path, env: dict[str, str]) -> str:
    """Where the job is stuck (each process's state, each Python process's stacks, the daemons'
    logs), after cancelling it and making sure none of its processes is left holding a node: the
    next job would otherwise wait out its own timeout PENDING behind this one."""
    out = folder / f"job-{job_id}.out"
    procs = job_processes(job_id)
    table = ""
    if procs:
        ps = subprocess.run(["ps", "-ww", "-o", "pid,ppid,stat,wchan:24,etime,args", "-p", ",".join(map(str, procs))],
                            capture_output=True, text=True, timeout=30)
        table = ps.stdout
        parents = {int(line.split()[1]) for line in table.splitlines()[1:] if len(line.split()) > 1}
        python = [pid for pid in procs if "python" in Path(f"/proc/{pid}/exe").resolve().name]
        # the ranks (no child) first: a launcher aborted first would have its ranks killed unheard
        for batch in ([p for p in python if p not in parents], [p for p in python if p in parents]):
            for pid in batch:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGABRT)
            time.sleep(3)  # the stacks reach the output file
    run_grouped(["scancel", str(job_id)], env, 30)
    gone_by = time.monotonic() + 30
    while job_processes(job_id) and time.monotonic() < gone_by:
        time.sleep(1)
    left = job_processes(job_id)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    idle_by = time.monotonic() + 60
    nodes = ""
    while time.monotonic() < idle_by:
        nodes = run_grouped(["sinfo", "-h", "-N", "-o", "%N=%t"], env, 30).stdout.split()
        if all(n.endswith("=idle") for n in nodes):
            break
        time.sleep(2)
    text = out.read_text(errors="replace") if out.exists() else "(no output)"
    return (f"job {job_id} still {state} after {timeout_s}s (cancelled; {len(left)} process(es) killed after "
            f"scancel; nodes now {nodes}). {_daemons(env)}\nIts processes when it was stopped:\n{table}\n"
            f"Its output ({out}), with every Python process's stacks at the end:\n{text[-12000:]}")


def _daemons(env: dict[str, str]) -> str:
    """Which of the cluster's daemons are alive, and the end of each one's log (the state folder
    goes with the cluster: a daemon that died is only explained here)."""
    state = Path(env.get("SHARDKIT_SLURM_DIR", "/nonexistent"))
    alive = [f"{name} {'alive' if up else 'GONE'}" for name, up in _daemon_states(env).items()]
    logs = []
    for log in sorted((state / "log").glob("*.log")):
        with contextlib.suppress(OSError):
            logs.append(f"--- {log.name}:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-12:]))
    return "Daemons: " + ", ".join(alive) + "\n" + "\n".join(logs)


def _daemon_states(env: dict[str, str]) -> dict[str, bool]:
    """Each daemon of the cluster (its pid file's name) -> alive."""
    states = {}
    for pid_file in sorted((Path(env.get("SHARDKIT_SLURM_DIR", "/nonexistent")) / "run").glob("*.pid")):
        try:
            os.kill(int(pid_file.read_text().strip()), 0)
            states[pid_file.stem] = True
        except (OSError, ValueError):
            states[pid_file.stem] = False
    return states

