"""What the Slurm tests share: a command run in its own process group with a hard timeout, and the
sbatch of launch/slurm_multinode.sbatch waited for and read back (tests/test_slurm.py on one node,
tests/test_slurm_two_node.py on two)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


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
    read its output and rank 0's preflight report."""
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
            run_grouped(["scancel", str(job_id)], env, 30)
            out = folder / f"job-{job_id}.out"
            pytest.fail(f"job {job_id} still {info.get('JobState')} after {timeout_s}s (cancelled): "
                        f"{out.read_text()[-3000:] if out.exists() else '(no output)'}")
        time.sleep(2)
        info = scontrol_job(job_id, env)
    output = (folder / f"job-{job_id}.out").read_text(errors="replace")
    preflight = json.loads(report.read_text()) if report.exists() else None
    return Job(job_id, info["JobState"], info.get("ExitCode", "?"), output, preflight, master_port, folder)
