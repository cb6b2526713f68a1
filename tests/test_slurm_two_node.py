"""A real two-node Slurm cluster on this machine: launch/slurm_local_cluster.sh with
SHARDKIT_SLURM_NODES=2 starts one slurmd per node, each in its own UTS + mount namespace (own
hostname, own /etc/hosts, own loopback address), and launch/slurm_multinode.sbatch goes through
`sbatch` with 2 nodes x 2 CPU ranks: ZeRO-3 trains with the automatic preflight on all 4 ranks and
saves a checkpoint that both nodes then reshard, and convert to FSDP2 and back, together (srun,
each node writing its share), a replaced module fails the job with exit 3, and the cross-node failures are named within their
timeouts: a node that never joins, a MASTER_ADDR one node cannot reach, different shardkit versions
on the two nodes (and, without a cluster, two nodes whose ranks claim the same (host, device)).
Skipped, with the reason, where the machine cannot host the cluster. All traffic stays on loopback."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Iterator

import pytest

from shardkit.placement.summary import RankSummary
from shardkit.placement.verdict import judge_summaries
from shardkit.run.launcher import build_launch
from shardkit.run.rendezvous_diagnosis import diagnose, rendezvous_of
from tests._slurm_jobs import CLUSTER, REPO, Job, free_port, run_grouped, submit
from tests.test_launch import GOOD_AND_BAD

# One worker runs both Slurm modules, one after the other (loadgroup, tests/conftest.py): two
# clusters at once would share this machine's two cores, and the two-node ones their node names
# and addresses.
pytestmark = pytest.mark.xdist_group("slurm")

NODES = ("sknode1", "sknode2")
NODE_NET = "127.0.77"
START_TIMEOUT_S = 240  # a fresh machine installs slurm-wlm + munge first
# A 2 x 2 rank ZeRO-3 job took 15 s on this 2-core machine idle, ~140 s beside other tests; the small jobs less.
ZERO3_JOB_TIMEOUT_S = 480
JOB_TIMEOUT_S = 300
# The failure cases shorten torchrun's rendezvous timeouts (600 s / 60 s by default) so they end fast.
JOIN_TIMEOUT_S = 30
READ_TIMEOUT_S = 15


def _pids(state: Path) -> dict[str, int]:
    """The cluster's daemons alive now, from their pid files."""
    alive: dict[str, int] = {}
    for pid_file in sorted((state / "run").glob("*.pid")):
        try:
            pid = int(pid_file.read_text().strip())
            os.kill(pid, 0)
        except (OSError, ValueError):
            continue
        alive[pid_file.stem] = pid
    return alive


def _in_namespaces(namespaces: set[str]) -> list[int]:
    """Processes still inside any of the given UTS namespaces (``uts:[inode]``)."""
    left = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "ns" / "uts") in namespaces:
                    left.append(int(entry.name))
            except OSError:
                continue
    return left


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, str]]:
    """A running two-node cluster and the environment to talk to it; every daemon stopped, and
    every process of the nodes' namespaces checked gone, at the end of the module."""
    # /tmp, short: the munge socket lives in the state folder, and munged wants every folder above
    # it searchable by all (pytest's tmp folders are 0700)
    state = Path(tempfile.mkdtemp(prefix="sk-slurm2-", dir="/tmp" if os.path.isdir("/tmp") else None))
    # the two slurmds listen on p and p + 1
    slurmd_port = free_port(2)
    ctld_port = free_port()
    env = {
        **os.environ,
        "SHARDKIT_SLURM_DIR": str(state),
        "SHARDKIT_SLURM_NODES": "2",
        "SHARDKIT_SLURM_NODE_NET": NODE_NET,
        "SHARDKIT_SLURM_CTLD_PORT": str(ctld_port),
        "SHARDKIT_SLURM_SLURMD_PORT": str(slurmd_port),
        "SHARDKIT_SLURM_START_TIMEOUT": "60",
        "SLURM_CONF": str(state / "slurm.conf"),
    }
    namespaces: set[str] = set()
    pins: list[int] = []
    try:
        try:
            r = run_grouped(["bash", str(CLUSTER), "start"], env, START_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            pytest.skip(f"the 2-node Slurm cluster did not come up within {START_TIMEOUT_S}s: {str(exc.output)[-800:]}")
        if r.returncode in (2, 3):  # 2: cannot host (root, apt-get, namespaces); 3: daemons did not come up
            pytest.skip(f"no local 2-node Slurm cluster here (slurm_local_cluster.sh exit {r.returncode}): {r.stdout[-1500:]}")
        assert r.returncode == 0, r.stdout
        assert "cluster up in" in r.stdout and "2 nodes, each in its own UTS + mount namespace" in r.stdout, r.stdout
        daemons = _pids(state)
        # An open descriptor keeps each node's namespace (and so its inode number) alive until the
        # end: a namespace that ended can have its number given to a new one (another cluster's
        # node), whose processes the orphan check below would then take for this cluster's.
        pins = [os.open(f"/proc/{daemons[f'slurmd-{n}']}/ns/uts", os.O_RDONLY) for n in NODES]
        namespaces = {os.readlink(f"/proc/{daemons[f'slurmd-{n}']}/ns/uts") for n in NODES}
        assert len(namespaces) == 2 and os.readlink("/proc/self/ns/uts") not in namespaces
        yield env
    finally:
        stop = run_grouped(["bash", str(CLUSTER), "stop"], env, 120)
        survivors = _pids(state)
        for pid in survivors.values():
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 15  # a killed job step may take a moment to be reaped
        while _in_namespaces(namespaces) and time.monotonic() < deadline:
            time.sleep(0.5)
        orphans = _in_namespaces(namespaces)
        for pid in orphans:
            os.kill(pid, signal.SIGKILL)
        for fd in pins:
            os.close(fd)
        shutil.rmtree(state, ignore_errors=True)
        assert not survivors, f"`slurm_local_cluster.sh stop` left {survivors} running (killed now): {stop.stdout}"
        assert not orphans, f"processes left in the nodes' namespaces after stop (killed now): {orphans}"


@pytest.mark.slurm
@pytest.mark.slow
def test_each_node_has_its_own_hostname_and_hosts_file(cluster: dict[str, str]):
    r = run_grouped(["sinfo", "-h", "-N", "-o", "%N %t"], cluster, 30)
    assert r.stdout.split() == ["sknode1", "idle", "sknode2", "idle"], r.stdout
    seen = run_grouped(["bash", str(CLUSTER), "exec", "sknode2", "sh", "-c", "hostname; getent hosts sknode1"], cluster, 30)
    assert seen.stdout.split() == ["sknode2", f"{NODE_NET}.1", "sknode1"], seen.stdout
    # a job step on each node sees that node's hostname (slurmstepd inherits its slurmd's namespaces)
    step = run_grouped(["srun", "--nodes=2", "--ntasks-per-node=1", "--time=2", "hostname"], cluster, 60)
    assert sorted(step.stdout.split()) == list(NODES), step.stdout


def _submit(env: dict[str, str], folder: Path, script: Path, ds_config: str, *script_args: str,
            extra_env: dict[str, str] | None = None, timeout_s: float = JOB_TIMEOUT_S) -> Job:
    """The template on 2 nodes x 2 CPU ranks."""
    return submit(env, folder, script, ds_config, *script_args, nodes=2, timeout_s=timeout_s, extra_env=extra_env)


@pytest.fixture(scope="module")
def zero3_job(cluster: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The template's default: train_tiny.py with DeepSpeed ZeRO-3 (the shipped preset), 2 nodes x 2 CPU ranks."""
    folder = tmp_path_factory.mktemp("zero3-2node")
    # the 4 ranks save their ZeRO-3 checkpoint into the folder both nodes share (the reshard test reads it)
    return _submit(cluster, folder, REPO / "launch" / "train_tiny.py", str(REPO / "ds_configs" / "zero3.json"),
                   "--steps", "3", "--save", str(folder / "ckpt"), timeout_s=ZERO3_JOB_TIMEOUT_S)


@pytest.mark.slurm
@pytest.mark.slow
def test_zero3_trains_on_two_nodes_with_the_preflight_on_all_four_ranks(zero3_job: Job):
    out = zero3_job.output
    assert (zero3_job.state, zero3_job.exit_code) == ("COMPLETED", "0:0"), out[-4000:]
    assert "step 2 loss" in out and "training finished" in out
    passed = "shardkit autopreflight: placement preflight passed on 4 rank(s)"
    assert passed in out and "(DeepSpeed engine)" in out, out[-4000:]
    assert out.index(passed) < out.index("step 0 loss")
    report = zero3_job.preflight
    assert report is not None, "rank 0 wrote no SHARDKIT_AUTOPREFLIGHT_JSON report"
    assert report["ok"] and report["world_size"] == 4 and not report["missing_ranks"]
    summaries = sorted(report["summaries"], key=lambda s: s["rank"])
    assert [s["rank"] for s in summaries] == [0, 1, 2, 3]
    assert all(s["n_tensors"] and s["engine"] == "deepspeed-zero3" for s in summaries)
    # two ranks on each node, each node's ranks under its own hostname and torchrun node rank
    by_host: dict[str, list[int]] = {}
    for s in summaries:
        by_host.setdefault(s["host"], []).append(s["node_rank"])
    assert sorted(by_host) == list(NODES) and sorted(map(sorted, by_host.values())) == [[0, 0], [1, 1]], by_host


@pytest.mark.slurm
@pytest.mark.slow
def test_one_launcher_per_node_meeting_at_the_first_node(zero3_job: Job):
    port = zero3_job.master_port
    starts = [line for line in zero3_job.output.splitlines() if line.startswith("shardkit launch: ") and "starting: " in line]
    assert len(starts) == 2, starts  # one `shardkit launch` (one torchrun agent) per node
    for line in starts:
        assert "zero3.json checked" in line
        assert (f"--nnodes 2 --nproc_per_node 2 --rdzv_id {zero3_job.job_id} --rdzv_backend c10d "
                f"--rdzv_endpoint sknode1:{port} ") in line
    assert f"2 node(s) (sknode[1-2]) x 2 rank(s), rendezvous sknode1:{port}" in zero3_job.output


@pytest.mark.slurm
@pytest.mark.slow
def test_a_module_replaced_after_init_fails_the_two_node_job_with_exit_3(cluster: dict[str, str], tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(GOOD_AND_BAD)
    job = _submit(cluster, tmp_path / "job", script, "", "--replace-head")
    # the ranks' exit 3 reaches Slurm from whichever node ends first; the other node, stopped by
    # srun, still ends with 3 (its ranks failed too), never 143 (SIGTERM) or 137 (SIGKILL)
    assert (job.state, job.exit_code) == ("FAILED", "3:0"), job.output[-4000:]
    _assert_each_node_names_its_failed_ranks(job.output)
    assert "out_head.weight" in job.output and "trained" not in job.output


def _assert_each_node_names_its_failed_ranks(output: str) -> None:
    """Each node's `shardkit launch` names its own two ranks, together all four (or only the one that
    ended first, when srun stopped the other before its ranks got as far)."""
    lines = re.findall(r"shardkit launch: placement preflight failed on rank\(s\) \[(\d), (\d)\] of 4 on this node "
                       r"\((sknode\d); every node names its own ranks\) before the first optimizer step", output)
    assert lines, output[-4000:]
    named = {(int(a), int(b), node) for a, b, node in lines}
    assert len({node for *_, node in named}) == len(named), named  # one line per node
    assert all({a, b} in ({0, 1}, {2, 3}) for a, b, _ in named), named


@pytest.mark.slurm
@pytest.mark.slow
def test_different_shardkit_versions_on_the_two_nodes_fail_naming_the_node(cluster: dict[str, str], tmp_path: Path):
    # shardkit has no version override, so sknode2's ranks get a sitecustomize (on the job's
    # PYTHONPATH, chained to by shardkit's own) that reports another shardkit release there only
    site = tmp_path / "skew"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent("""
        import socket
        if socket.gethostname() == "sknode2":
            import shardkit._version
            shardkit._version.__version__ = "0.0.0+skew"
            import shardkit.platform.versions
            shardkit.platform.versions.SHARDKIT_VERSION = "0.0.0+skew"
    """))
    script = tmp_path / "train.py"
    script.write_text(GOOD_AND_BAD)
    pythonpath = os.pathsep.join(p for p in [str(site), os.environ.get("PYTHONPATH", "")] if p)
    job = _submit(cluster, tmp_path / "job", script, "", extra_env={"PYTHONPATH": pythonpath})
    assert (job.state, job.exit_code) == ("FAILED", "3:0"), job.output[-4000:]
    _assert_each_node_names_its_failed_ranks(job.output)
    assert "versions.shardkit" in job.output
    flat = " ".join(job.output.split())  # the table may wrap the message
    assert re.search(r"ranks run different shardkit versions \(0\.0\.0\+skew on ranks \[\d, \d\] \(host sknode2\); "
                     r"0\.1\.0 on ranks \[\d, \d\] \(host sknode1\)\)", flat), job.output[-4000:]
    assert "pip install 'shardkit==" in flat


@pytest.mark.slurm
@pytest.mark.slow
def test_a_node_that_never_joins_fails_the_job_naming_the_rendezvous_and_the_missing_node(cluster: dict[str, str], tmp_path: Path):
    # sknode2 stalls before its launcher starts (a hung file system, a slow import): its `shardkit`
    # is a wrapper that sleeps there; sknode1 runs the real one and waits at the rendezvous
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    real = shutil.which("shardkit", path=str(Path(sys.executable).parent)) or shutil.which("shardkit")
    assert real, "no shardkit console script beside this Python"
    wrapper = bin_dir / "shardkit"
    wrapper.write_text(f'#!/bin/sh\nif [ "$(hostname)" = sknode2 ]; then exec sleep 600; fi\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    script = tmp_path / "train.py"
    script.write_text(GOOD_AND_BAD)
    started = time.monotonic()
    job = _submit(cluster, tmp_path / "job", script, "", extra_env={
        "RDZV_CONF": f"join_timeout={JOIN_TIMEOUT_S}",
        "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), cluster.get("PATH", "")]),
    })
    took = time.monotonic() - started
    out = job.output
    assert job.state == "FAILED" and job.exit_code != "0:0", out[-4000:]
    port = job.master_port
    assert (f"shardkit launch: the rendezvous at sknode1:{port} (rdzv_id {job.job_id}) timed out after {JOIN_TIMEOUT_S}s "
            f"(join_timeout) on this node (sknode1) waiting for 2 node(s) x 2 rank(s): this node joined but the other "
            "node (2 rank(s)) never did, so no rank started.") in out, out[-4000:]
    assert "RDZV_CONF=join_timeout=SECONDS" in out and "trained" not in out
    assert took < JOIN_TIMEOUT_S + 150, f"the job took {took:.0f}s to fail"


@pytest.mark.slurm
@pytest.mark.slow
def test_a_master_addr_one_node_cannot_reach_is_named_on_that_node(cluster: dict[str, str], tmp_path: Path):
    # sknode2 cannot resolve the first node's name (its /etc/hosts, a bind mount of this file, is
    # edited in place and restored after). The nodes share this machine's network namespace, where
    # every 127.x address reaches the store listening on all addresses: an unresolvable name is
    # how one node fails to reach MASTER_ADDR here without a firewall rule.
    hosts = Path(cluster["SHARDKIT_SLURM_DIR"]) / "hosts" / "sknode2"
    original = hosts.read_text()
    assert f"{NODE_NET}.1 sknode1\n" in original
    with open(hosts, "r+") as f:  # in place: a rename would leave the node's bind mount on the old file
        f.write(original.replace(f"{NODE_NET}.1 sknode1\n", ""))
        f.truncate()
    try:
        script = tmp_path / "train.py"
        script.write_text(GOOD_AND_BAD)
        job = _submit(cluster, tmp_path / "job", script, "", extra_env={
            "RDZV_CONF": f"join_timeout=120,read_timeout={READ_TIMEOUT_S}"})
    finally:
        with open(hosts, "r+") as f:
            f.write(original)
            f.truncate()
    out = job.output
    assert job.state == "FAILED" and job.exit_code != "0:0", out[-4000:]
    port = job.master_port
    assert (f"shardkit launch: this node (sknode2) could not reach the rendezvous store at sknode1:{port} "
            f"(rdzv_id {job.job_id}) within {READ_TIMEOUT_S}s (read_timeout): sknode1 does not resolve here ") in out, out[-4000:]
    assert f"the store said: torch.distributed.DistNetworkError: The client socket has timed out after {READ_TIMEOUT_S * 1000}ms" in out
    assert "`getent hosts sknode1` on each" in out and "trained" not in out


# ---------------------------------------------------------------- no cluster needed


def _summary(rank: int, host: str, node: int, device: str = "cuda:0", shardkit: str = "0.1.0") -> RankSummary:
    return RankSummary(rank=rank, world_size=4, host=host, compute_device=device, engine="deepspeed-zero3",
                       versions={"torch": "2.13.0", "deepspeed": "0.19.8", "shardkit": shardkit},
                       config_digest="abc", n_tensors=3, node_rank=node)


def test_two_nodes_whose_ranks_claim_the_same_host_and_device_are_named_as_such():
    # two machines that both call themselves "node" (containers started with one --hostname)
    summaries = [_summary(0, "node", 0), _summary(1, "node", 0, "cuda:1"), _summary(2, "node", 1), _summary(3, "node", 1, "cuda:1")]
    report = judge_summaries(summaries, {})
    messages = {f.key: f for f in report.findings if f.rule == "placement.shared_accelerator"}
    assert set(messages) == {"host node: cuda:0", "host node: cuda:1"}
    f = messages["host node: cuda:0"]
    assert ("ranks [0, 2] claim the same (host, device) = (node, cuda:0) but were started by 2 different nodes "
            "(node 0: ranks [0]; node 1: ranks [2]): either those nodes report one hostname") in f.message
    assert "Give every node a unique hostname" in f.fix and "srun --ntasks-per-node=1" in f.fix
    # distinct hostnames per node: nothing to say; one node's ranks on one device: the one-host message
    assert judge_summaries([_summary(0, "a", 0), _summary(1, "b", 1)], {}).ok
    (same,) = judge_summaries([_summary(0, "a", 0), _summary(1, "a", 0)], {}).findings
    assert "ranks [0, 1] all compute on cuda:0 on a: they share one accelerator" in same.message


def test_version_skew_across_nodes_names_each_version_s_hosts():
    summaries = [_summary(0, "n1", 0, "cpu"), _summary(1, "n1", 0, "cpu"),
                 _summary(2, "n2", 1, "cpu", "0.0.9"), _summary(3, "n2", 1, "cpu", "0.0.9")]
    (f,) = judge_summaries(summaries, {}).findings
    assert f.key == "versions.shardkit"
    assert "(0.0.9 on ranks [2, 3] (host n2); 0.1.0 on ranks [0, 1] (host n1))" in f.message
    assert "pip install 'shardkit==" in f.fix


def test_only_multi_node_c10d_torchrun_is_diagnosed():
    plan = build_launch(["--nnodes", "2", "--nproc_per_node", "2", "--rdzv_id", "7", "--rdzv_backend", "c10d",
                         "--rdzv_endpoint", "n1:29500", "--rdzv_conf", "join_timeout=45,read_timeout=9", "t.py"],
                        "torchrun", preflight=False)
    assert plan.rendezvous is not None
    assert (plan.rendezvous.host, plan.rendezvous.min_nodes, plan.rendezvous.nproc_per_node) == ("n1", 2, 2)
    assert (plan.rendezvous.join_timeout_s, plan.rendezvous.read_timeout_s) == (45, 9)
    assert rendezvous_of(["--standalone", "--nproc_per_node", "2"]) is None
    assert rendezvous_of(["--nnodes", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", "n1:1"]) is None
    assert rendezvous_of(["--nnodes", "2", "--rdzv_backend", "static", "--rdzv_endpoint", "n1:1"]) is None
    assert build_launch(["--nnodes", "2", "t.py"], "deepspeed", preflight=False).rendezvous is None


def test_a_rendezvous_failure_in_torchrun_output_is_named_and_other_failures_are_not():
    rdzv = rendezvous_of(["--nnodes", "3", "--nproc_per_node", "4", "--rdzv_backend", "c10d", "--rdzv_endpoint", "m:5"])
    assert rdzv is not None

    def resolve(host: str) -> list[str]:
        raise socket.gaierror(-2, "Name or service not known")

    timeout = diagnose(rdzv, "Traceback ...\ntorch.distributed.elastic.rendezvous.api.RendezvousTimeoutError\n",
                       hostname="h1", resolve=resolve)
    assert timeout is not None and ("timed out after 600s (join_timeout) on this node (h1) waiting for 3 node(s) x 4 "
                                    "rank(s): this node joined but up to 2 other nodes (8 rank(s)) never did") in timeout
    assert "m does not resolve here ([Errno -2] Name or service not known)" in timeout
    failed = ("torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store "
              "has failed. See inner exception for details.\n")
    tail = ("torch.distributed.DistNetworkError: The client socket has timed out after 60000ms while trying to connect "
            "to (m, 5).\n\nThe above exception was the direct cause of the following exception:\n\nTraceback ...\n"
            '  File ".../c10d_rendezvous_backend.py", line 180, in _create_tcp_store\n' + failed)
    unreachable = diagnose(rdzv, tail, hostname="h2", resolve=lambda h: ["10.1.2.3"])
    assert unreachable is not None and unreachable.startswith(
        "shardkit launch: this node (h2) could not reach the rendezvous store at m:5 within 60s (read_timeout): "
        "m resolves to 10.1.2.3 here; the store said: torch.distributed.DistNetworkError: The client socket has timed out")
    # reached, then gone: the store's host (the first node) failed first; that node's output says why
    gone = diagnose(rdzv, ("torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely "
                           "closed.\nTraceback ...\n  File \".../c10d_rendezvous_backend.py\", line 114, in _call_store\n"
                           + failed), hostname="h2")
    assert gone == ("shardkit launch: the rendezvous store at m:5 went away while this node (h2) was still using it "
                    "(torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed): the "
                    "node hosting it (m, the job's first node) ended first, and that node's output names the first "
                    "failure; this node's error follows from it.")
    assert diagnose(rdzv, "ChildFailedError: rank 1 exited with 1\n", hostname="h1") is None
    # torchrun's warning at a normal shutdown names the error type but is no failure of the rendezvous
    assert diagnose(rdzv, "W... The node 'n_1' has failed to shutdown the rendezvous '3' due to an error of type "
                          "RendezvousConnectionError.\n", hostname="h1") is None


@pytest.mark.parametrize(("name", "value", "says"), [
    ("SHARDKIT_SLURM_NODE_NET", "10.0.0", "SHARDKIT_SLURM_NODE_NET='10.0.0' is not a loopback /24 other than 127.0.0"),
    ("SHARDKIT_SLURM_NODE_NET", "127.0.0", "SHARDKIT_SLURM_NODE_NET='127.0.0' is not a loopback /24 other than 127.0.0"),
    ("SHARDKIT_SLURM_NODES", "two", "SHARDKIT_SLURM_NODES='two' is not a node count"),
    ("SHARDKIT_SLURM_NODE_PREFIX", "Node_", "SHARDKIT_SLURM_NODE_PREFIX='Node_' is not a usable host name prefix"),
])
def test_the_cluster_script_refuses_settings_that_would_leave_loopback_or_break_names(tmp_path: Path, name: str, value: str, says: str):
    env = {**os.environ, "SHARDKIT_SLURM_DIR": str(tmp_path), "SHARDKIT_SLURM_NODES": "2", name: value}
    r = run_grouped(["bash", str(CLUSTER), "start"], env, 30)
    assert r.returncode == 1, r.stdout
    assert says in r.stdout
    assert not list(tmp_path.iterdir())  # refused before anything was written or started


def test_exec_names_the_nodes_when_the_node_is_not_running(tmp_path: Path):
    env = {**os.environ, "SHARDKIT_SLURM_DIR": str(tmp_path), "SHARDKIT_SLURM_NODES": "2"}
    r = run_grouped(["bash", str(CLUSTER), "exec", "sknode3", "hostname"], env, 30)
    assert r.returncode == 1
    assert f"no running slurmd for node 'sknode3' in {tmp_path}" in r.stdout and "the nodes are: sknode1 sknode2" in r.stdout


@pytest.mark.slurm
@pytest.mark.slow
def test_the_two_node_checkpoint_resharded_by_both_nodes_each_writing_its_share(
        zero3_job: Job, cluster: dict[str, str], tmp_path: Path):
    # the checkpoint the 4 ranks of the two nodes saved, resharded for 3 ranks by one `shardkit
    # reshard` per node (srun: each writes its share into the shared output folder, rank 0 seals)
    src = _saved_checkpoint(zero3_job)
    assert (src / "latest").read_text().strip() == "global_step3", list(src.iterdir())
    assert len(list((src / "global_step3").glob("*optim_states.pt"))) == 4  # one per rank, both nodes'
    out = tmp_path / "ckpt_ws3"
    r = _srun_shardkit(cluster, "reshard", str(src), "--world-size", "3", "-o", str(out))
    assert r.returncode == 0, r.stdout[-4000:]
    assert re.search(r"wrote .*ckpt_ws3/global_step3 by 2 processes \(srun\): \d+ files", r.stdout), r.stdout[-3000:]
    assert re.search(r"rank 1 of 2 \(srun\): wrote its share, [1-9]\d* files", r.stdout), r.stdout[-3000:]
    verify = run_grouped([sys.executable, "-m", "shardkit", "verify", str(out), "--world-size", "3"], cluster, 120)
    assert verify.returncode == 0, verify.stdout[-3000:]
    beside = [p.name for p in src.iterdir() if p.is_file() and p.name != "latest"]  # zero_to_fp32.py: copied too
    assert sorted(p.name for p in out.iterdir()) == sorted(["global_step3", "latest", *beside]), list(out.iterdir())


def _saved_checkpoint(job: Job) -> Path:
    """The checkpoint the module's two-node ZeRO-3 job saved (the job must have completed)."""
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job.output[-3000:]
    return job.folder / "ckpt"


def _srun_shardkit(cluster: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`shardkit ARGS` once on each node (srun), this interpreter's console script first on PATH."""
    env = {**cluster, "PATH": os.pathsep.join([str(Path(sys.executable).parent), cluster.get("PATH", "")])}
    return run_grouped(["srun", "--nodes=2", "--ntasks-per-node=1", "--time=5", "--kill-on-bad-exit=1", "shardkit",
                        *args], env, 300)


@pytest.mark.slurm
@pytest.mark.slow
def test_the_two_node_checkpoint_converted_to_fsdp2_and_back_by_both_nodes(
        zero3_job: Job, cluster: dict[str, str], tmp_path: Path):
    # ZeRO-3 (4 ranks, both nodes) -> FSDP2 -> ZeRO-3 at 4 ranks, each conversion one `shardkit
    # convert` per node (srun), each writing its share into the shared folder: the masters and both
    # moments of every rank come back bit for bit
    import torch

    from shardkit.storage.torch_load import safe_torch_load

    src = _saved_checkpoint(zero3_job)
    dcp, back = tmp_path / "dcp", tmp_path / "back"
    r = _srun_shardkit(cluster, "convert", str(src), "--to", "fsdp2", "-o", str(dcp))
    assert r.returncode == 0, r.stdout[-4000:]
    assert re.search(r"wrote .*dcp/global_step3 by 2 processes \(srun\): zero3 -> fsdp2", r.stdout), r.stdout[-3000:]
    r = _srun_shardkit(cluster, "convert", str(dcp), "--to", "zero3", "--world-size", "4", "--ds-config",
                       str(REPO / "ds_configs" / "zero3.json"), "-o", str(back))
    assert r.returncode == 0, r.stdout[-4000:]
    assert re.search(r"wrote .*back/global_step3 by 2 processes \(srun\): fsdp2 -> zero3", r.stdout), r.stdout[-3000:]
    # 4 new ranks over 2 processes: ranks 1 and 3 (two files each) on the second
    assert re.search(r"rank 1 of 2 \(srun\): wrote its share, 4 files", r.stdout), r.stdout[-3000:]
    verify = run_grouped([sys.executable, "-m", "shardkit", "verify", str(back), "--world-size", "4"], cluster, 120)
    assert verify.returncode == 0, verify.stdout[-3000:]
    for rank in range(4):
        name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        a = safe_torch_load(src / "global_step3" / name)["optimizer_state_dict"]
        b = safe_torch_load(back / "global_step3" / name)["optimizer_state_dict"]
        assert len(a["fp32_flat_groups"]) == len(b["fp32_flat_groups"])
        for x, y in zip(a["fp32_flat_groups"], b["fp32_flat_groups"]):
            assert x.dtype == y.dtype == torch.float32 and torch.equal(x.view(torch.int32), y.view(torch.int32)), rank
        for j, st in a["optimizer_state_dict"]["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(st[key].view(torch.int32), b["optimizer_state_dict"]["state"][j][key].view(torch.int32)), \
                    (rank, j, key)

def test_two_nodes_without_unshare_exit_2_saying_what_is_missing(tmp_path: Path):
    # a PATH with Slurm and the tools the script uses before the namespace check, but no unshare
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("uname", "id", "mkdir", "chmod", "tr", "rm", "munged", "slurmctld", "slurmd", "sbatch"):
        found = shutil.which(tool)
        if found is None:
            pytest.skip(f"{tool} is not installed here")
        (bin_dir / tool).symlink_to(found)
    env = {**os.environ, "PATH": str(bin_dir), "SHARDKIT_SLURM_INSTALL": "0", "SHARDKIT_SLURM_NODES": "2",
           "SHARDKIT_SLURM_DIR": str(tmp_path / "state")}
    r = run_grouped([shutil.which("bash") or "/bin/bash", str(CLUSTER), "start"], env, 30)
    assert r.returncode == 2, r.stdout
    if os.geteuid() != 0:
        assert f"must run as root (uid {os.geteuid()})" in r.stdout
    else:
        assert ("SHARDKIT_SLURM_NODES=2 needs `unshare` (util-linux) to give each node its own hostname and /etc/hosts; "
                "install util-linux, or use SHARDKIT_SLURM_NODES=1") in r.stdout
        assert not list((tmp_path / "state" / "run").glob("*.pid"))  # nothing was started
