"""A real Slurm job: launch/slurm_local_cluster.sh brings up a single-node cluster on this machine
(munged, slurmctld, slurmd, a generated slurm.conf), and launch/slurm_multinode.sbatch goes through
`sbatch` with 1 node x 2 CPU ranks: ZeRO-3 trains with the automatic preflight on both ranks, and a
replaced module fails the job with exit 3. Skipped, with the reason, where the machine cannot host
the cluster (not root, no apt-get, the install failed, the daemons did not come up in time)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from tests._slurm_jobs import CLUSTER, REPO, TEMPLATE, Job, free_port, run_grouped, submit
from tests.test_launch import GOOD_AND_BAD

# One worker runs both Slurm modules, one after the other (loadgroup, tests/conftest.py): two
# clusters at once would share this machine's two cores, and the two-node ones their node names
# and addresses.
pytestmark = pytest.mark.xdist_group("slurm")

# A fresh machine installs slurm-wlm + munge first (about 20 s here, minutes on a slow mirror).
START_TIMEOUT_S = 240
# A 2-rank ZeRO-3 job took 60-75 s on this shared 2-core machine.
JOB_TIMEOUT_S = 240


def _live_daemons(state: Path) -> dict[str, int]:
    """The cluster's daemons still alive, from their pid files."""
    alive: dict[str, int] = {}
    for name in ("slurmd", "slurmctld", "munged"):
        pid_file = state / "run" / f"{name}.pid"
        try:
            pid = int(pid_file.read_text().strip())
            os.kill(pid, 0)
        except (OSError, ValueError):
            continue
        alive[name] = pid
    return alive


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, str]]:
    """A running single-node cluster; the environment to talk to it (SLURM_CONF). Stopped, and its
    daemons checked gone, at the end of the module."""
    # /tmp, short: the munge socket lives in the state folder (a socket path has ~100 characters),
    # and munged wants every folder above it searchable by all (pytest's tmp folders are 0700).
    state = Path(tempfile.mkdtemp(prefix="sk-slurm-", dir="/tmp" if os.path.isdir("/tmp") else None))
    ctld_port = free_port(2)
    slurmd_port = ctld_port + 1
    env = {
        **os.environ,
        "SHARDKIT_SLURM_DIR": str(state),
        "SHARDKIT_SLURM_CTLD_PORT": str(ctld_port),
        "SHARDKIT_SLURM_SLURMD_PORT": str(slurmd_port),
        "SHARDKIT_SLURM_START_TIMEOUT": "60",
        "SLURM_CONF": str(state / "slurm.conf"),
    }
    try:
        try:
            r = run_grouped(["bash", str(CLUSTER), "start"], env, START_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            pytest.skip(f"the Slurm cluster did not come up within {START_TIMEOUT_S}s (install included): {str(exc.output)[-800:]}")
        if r.returncode in (2, 3):  # 2: cannot host (root, apt-get, install); 3: daemons did not come up
            pytest.skip(f"no local Slurm cluster on this machine (slurm_local_cluster.sh exit {r.returncode}): {r.stdout[-1500:]}")
        assert r.returncode == 0, r.stdout
        assert "cluster up in" in r.stdout, r.stdout
        yield env
    finally:
        stop = run_grouped(["bash", str(CLUSTER), "stop"], env, 120)
        survivors = _live_daemons(state)
        for pid in survivors.values():
            os.kill(pid, signal.SIGKILL)
        logs = stop.stdout
        shutil.rmtree(state, ignore_errors=True)
        assert not survivors, f"`slurm_local_cluster.sh stop` left {survivors} running (killed now): {logs}"


@pytest.fixture(scope="module")
def zero3_job(cluster: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The template's default: train_tiny.py with DeepSpeed ZeRO-3 (the shipped preset), 2 CPU ranks."""
    folder = tmp_path_factory.mktemp("zero3-job")
    return submit(cluster, folder, REPO / "launch" / "train_tiny.py", str(REPO / "ds_configs" / "zero3.json"),
                  "--steps", "3", nodes=1, timeout_s=JOB_TIMEOUT_S)


@pytest.mark.slurm
@pytest.mark.slow
def test_the_template_trains_zero3_on_two_cpu_ranks_through_sbatch(zero3_job: Job):
    assert (zero3_job.state, zero3_job.exit_code) == ("COMPLETED", "0:0"), zero3_job.output[-4000:]
    assert "step 2 loss" in zero3_job.output and "training finished" in zero3_job.output


@pytest.mark.slurm
@pytest.mark.slow
def test_the_preflight_ran_on_both_ranks_before_the_first_step(zero3_job: Job):
    out = zero3_job.output
    passed = "shardkit autopreflight: placement preflight passed on 2 rank(s)"
    assert passed in out and "(DeepSpeed engine)" in out, out[-4000:]
    assert out.index(passed) < out.index("step 0 loss")
    # rank 0's report holds its own records and every rank's summary (ranks ship summaries, not
    # records), both ranks judged with their tensors counted
    report = zero3_job.preflight
    assert report is not None, "rank 0 wrote no SHARDKIT_AUTOPREFLIGHT_JSON report"
    assert report["ok"] and report["world_size"] == 2 and not report["missing_ranks"]
    assert [r["rank"] for r in report["ranks"]] == [0] and report["ranks"][0]["records"]
    assert sorted(s["rank"] for s in report["summaries"]) == [0, 1]
    assert all(s["n_tensors"] and s["engine"] == "deepspeed-zero3" for s in report["summaries"])


@pytest.mark.slurm
@pytest.mark.slow
def test_one_launcher_per_node_with_the_rendezvous_on_the_first_node(zero3_job: Job, cluster: dict[str, str]):
    node = run_grouped(["sinfo", "-h", "-N", "-o", "%N"], cluster, 30).stdout.split()[0]
    port = zero3_job.master_port  # the port the job was given (the template derives one from the job id without it)
    starts = [line for line in zero3_job.output.splitlines() if line.startswith("shardkit launch: ") and "starting: " in line]
    assert len(starts) == 1, starts  # one `shardkit launch` (one torchrun agent) on the one node
    assert "zero3.json checked" in starts[0]
    assert (f"--nnodes 1 --nproc_per_node 2 --rdzv_id {zero3_job.job_id} --rdzv_backend c10d "
            f"--rdzv_endpoint {node}:{port} ") in starts[0]
    assert f"1 node(s) ({node}) x 2 rank(s), rendezvous {node}:{port}" in zero3_job.output


@pytest.mark.slurm
@pytest.mark.slow
def test_a_module_replaced_after_init_fails_the_job_with_exit_3(cluster: dict[str, str], tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(GOOD_AND_BAD)
    job = submit(cluster, tmp_path / "job", script, "", "--replace-head", nodes=1, timeout_s=JOB_TIMEOUT_S)
    # the rank's exit 3 reaches Slurm: torchrun -> shardkit launch -> srun -> the batch script
    assert (job.state, job.exit_code) == ("FAILED", "3:0"), job.output[-4000:]
    assert "shardkit launch: placement preflight failed on rank(s) [0, 1] of 2 before the first optimizer step" in job.output
    assert "out_head.weight" in job.output and "trained" not in job.output


@pytest.mark.slurm
@pytest.mark.slow
def test_a_second_cluster_on_the_same_ports_exits_3_with_the_daemons_logs(cluster: dict[str, str]):
    state = Path(tempfile.mkdtemp(prefix="sk-slurm-", dir="/tmp" if os.path.isdir("/tmp") else None))
    env = {**cluster, "SHARDKIT_SLURM_DIR": str(state), "SLURM_CONF": str(state / "slurm.conf")}
    try:
        r = run_grouped(["bash", str(CLUSTER), "start"], env, 90)
        assert r.returncode == 3, r.stdout
        assert "the node is not idle after" in r.stdout and "exited: slurmctld slurmd); logs follow" in r.stdout
        assert "Address already in use" in r.stdout  # from the daemons' logs, printed with the failure
        assert _live_daemons(state) == {}  # its munged was stopped with the rest
    finally:
        run_grouped(["bash", str(CLUSTER), "stop"], env, 60)
        for pid in _live_daemons(state).values():
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(state, ignore_errors=True)


# ---------------------------------------------------------------- no cluster needed


@pytest.mark.parametrize("nproc", ["", "0", "two"])
def test_the_template_without_a_rank_count_stops_naming_the_fix(nproc: str):
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_GPUS_ON_NODE", "NPROC_PER_NODE")}
    r = run_grouped(["bash", str(TEMPLATE)], {**env, "NPROC_PER_NODE": nproc, "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"}, 30)
    assert r.returncode == 2, r.stdout
    assert (f"slurm_multinode.sbatch: NPROC_PER_NODE='{nproc}' (SLURM_GPUS_ON_NODE=''): cannot tell how many ranks "
            "to start per node; request GPUs (--gpus-per-node=N) or set NPROC_PER_NODE=N (with DEVICE=cpu for CPU ranks)") in r.stdout


def test_the_template_outside_a_slurm_job_says_to_submit_it():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = run_grouped(["bash", str(TEMPLATE)], {**env, "NPROC_PER_NODE": "2"}, 30)
    assert r.returncode == 2, r.stdout
    assert ("slurm_multinode.sbatch: not inside a Slurm job (SLURM_JOB_ID='', SLURM_JOB_NODELIST=''): "
            "submit it with `sbatch launch/slurm_multinode.sbatch`") in r.stdout


def test_the_cluster_script_names_its_modes():
    r = run_grouped(["bash", str(CLUSTER), "restart"], dict(os.environ), 30)
    assert r.returncode == 1
    assert "usage: " in r.stdout and "start|stop|status|env (got 'restart')" in r.stdout


def test_the_cluster_script_prints_the_client_environment(tmp_path: Path):
    r = run_grouped(["bash", str(CLUSTER), "env"], {**os.environ, "SHARDKIT_SLURM_DIR": str(tmp_path)}, 30)
    assert r.returncode == 0 and r.stdout.strip() == f"export SLURM_CONF={tmp_path}/slurm.conf"


def test_the_cluster_script_without_slurm_and_no_install_exits_2_saying_how_to_get_it(tmp_path: Path):
    # a PATH with only the tools the script uses before it looks for Slurm: no munged, no slurm*
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("uname", "id", "mkdir", "chmod", "tr"):
        (bin_dir / tool).symlink_to(shutil.which(tool) or f"/usr/bin/{tool}")
    env = {**os.environ, "PATH": str(bin_dir), "SHARDKIT_SLURM_INSTALL": "0", "SHARDKIT_SLURM_DIR": str(tmp_path / "state")}
    r = run_grouped([shutil.which("bash") or "/bin/bash", str(CLUSTER), "start"], env, 30)
    assert r.returncode == 2, r.stdout
    if os.geteuid() != 0:
        assert f"must run as root (uid {os.geteuid()})" in r.stdout
    else:
        assert ("munged slurmctld slurmd sbatch not installed and SHARDKIT_SLURM_INSTALL=0; "
                "install them with `apt-get install -y slurm-wlm munge`") in r.stdout


def test_the_template_guards_every_array_that_can_be_empty():
    # bash <= 4.3 (RHEL/CentOS 7 login nodes) calls an empty "${a[@]}" unbound under set -u; such
    # arrays must expand as ${a[@]+"${a[@]}"}. `step` always holds --kill-on-bad-exit and --nodes.
    text = TEMPLATE.read_text()
    never_empty = {"step"}
    bare = [m.group(1) for m in re.finditer(r'(?<!\+)"\$\{(\w+)\[@\]\}"', text) if m.group(1) not in never_empty]
    assert not bare, f"unguarded expansions of arrays that can be empty: {bare}"
