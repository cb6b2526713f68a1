"""`shardkit launch --launcher deepspeed --hostfile ...` on two namespaced nodes, reached through a
pdsh stand-in that gives each host what an ssh login gives it: its own hostname and /etc/hosts
(`unshare -u -m`, addresses 127.0.77.x on loopback, as tests/test_slurm_two_node.py makes nodes) and
an environment of HOME, PATH and LANG only (`env -i`), plus what DeepSpeed's runner writes on the
remote command line (its `export NAME=VALUE;` of the PYTHON*, MLFLOW*, MV2*, UCX* variables and the
lines of .deepspeed_env). The automatic preflight reaches every rank of both nodes and each reports
to the launch: a clean ZeRO-3 job passes on 2 of 2 ranks, a module replaced after
deepspeed.initialize stops both nodes' ranks with exit 3, named, and a runner that drops the packed
variable leaves a launch that names the ranks where the preflight never ran and why. Also the packed
variable through DeepSpeed's other multi-node runners' own export code (no spawning), and the
`--no_ssh --node_rank` form (one `shardkit launch` per node)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shardkit.autopreflight.launch_link import PACKED_ENV, REPORT_ENV, arrive, pack, unpack
from shardkit.run.launcher import build_launch, expected_ranks
from tests._launch_jobs import (
    JOB_TIMEOUT_S,
    NODES,
    assert_passed_on_both_ranks,
    assert_stopped_on_both_ranks,
    can_make_nodes,
    install_stand_in,
    job_folder,
    last_launch_line,
    nodes_hosts_file,
    run_launch,
)
from tests._ports import free_port


@pytest.fixture
def nodes(tmp_path: Path) -> dict[str, str]:
    """A job folder with a hostfile of both nodes, their /etc/hosts and the pdsh/ssh stand-ins on PATH;
    the environment to launch from."""
    why = can_make_nodes()
    if why:
        pytest.skip(why)
    env = job_folder(tmp_path, "".join(f"{name} slots=1\n" for name in NODES))
    install_stand_in(tmp_path, "pdsh", "ssh")
    return {**env, "SKPDSH_HOSTS": str(nodes_hosts_file(tmp_path))}


def _launch(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_launch(env, cwd, "--master_addr", NODES["sknodeA"], "--master_port", str(free_port()), *args)


@pytest.mark.slow
def test_a_clean_zero3_job_passes_the_preflight_on_every_rank_of_both_nodes(nodes, tmp_path):
    r = _launch(nodes, tmp_path, "train.py")
    assert "placement preflight requested on every rank; starting: " in r.stdout
    assert_passed_on_both_ranks(r, ("sknodeA", "sknodeB"))


@pytest.mark.slow
def test_a_module_replaced_after_initialize_stops_every_rank_of_both_nodes_named(nodes, tmp_path):
    r = _launch(nodes, tmp_path, "train.py", "--replace-head")
    assert_stopped_on_both_ranks(r, "out_head")


@pytest.mark.slow
def test_a_runner_that_drops_the_packed_variable_is_named_with_the_ranks_that_never_ran_it(nodes, tmp_path):
    r = _launch({**nodes, "SKPDSH_DROP": PACKED_ENV}, tmp_path, "train.py")
    assert r.returncode == 0, r.stdout[-4000:]  # the job itself ran: the status is the launcher's
    assert "rank 0 trained on sknodeA" in r.stdout and "rank 1 trained on sknodeB" in r.stdout
    # each rank says which variable did not arrive; the launch names the ranks, their hosts and why
    for rank, host in ((0, "sknodeA"), (1, "sknodeB")):
        assert f"shardkit autopreflight: rank {rank} on {host}: {PACKED_ENV} did not arrive" in r.stdout
    last = last_launch_line(r.stdout)
    assert last.startswith("shardkit launch: warning: the placement preflight never ran on rank(s) [0, 1] of 2 "
                           f"(hosts sknodeA, sknodeB): no report came from them: {PACKED_ENV} did not arrive there"), last
    assert "preflight passed" not in r.stdout


@pytest.mark.slow
def test_no_ssh_one_launch_per_node_inherits_the_environment(nodes, tmp_path):
    """`--no_ssh --node_rank N`: the user starts one `shardkit launch` on each node (here: in each
    node's namespaces, from the same shell environment); each names its own node's rank."""
    procs, port = [], str(free_port())
    for node_rank, name in enumerate(NODES):
        argv = [sys.executable, "-m", "shardkit", "launch", "--launcher", "deepspeed", "--hostfile", "hostfile",
                "--no_ssh", "--node_rank", str(node_rank), "--master_addr", NODES["sknodeA"], "--master_port", port,
                "train.py"]
        wrapped = ["unshare", "-u", "-m", "sh", "-c", 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"',
                   "sh", name, nodes["SKPDSH_HOSTS"], *argv]
        procs.append(subprocess.Popen(wrapped, cwd=tmp_path, env=nodes, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=JOB_TIMEOUT_S)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            pytest.fail("the two --no_ssh launches did not finish within the timeout")
    for proc, out, (rank, name) in zip(procs, outs, enumerate(NODES)):
        assert proc.returncode == 0, out[-4000:]
        assert f"rank {rank} trained on {name}" in out
        assert last_launch_line(out) == f"shardkit launch: placement preflight passed on 1 of 1 rank(s) on this node ({name}) (hosts: {name})"


# ---------------------------------------------------------------- no processes


def test_the_packed_settings_round_trip_and_never_override_a_value_already_set():
    value = pack({"SHARDKIT_AUTOPREFLIGHT": "1", "SHARDKIT_AUTOPREFLIGHT_CONFIG": "/a b/ds \"x\".json", "HOME": "/h"})
    assert set(value) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=")
    assert unpack(value) == {"SHARDKIT_AUTOPREFLIGHT": "1", "SHARDKIT_AUTOPREFLIGHT_CONFIG": '/a b/ds "x".json'}
    env = {PACKED_ENV: value, "SHARDKIT_AUTOPREFLIGHT_CONFIG": "/mine.json"}
    assert arrive(env) == ["SHARDKIT_AUTOPREFLIGHT"]
    assert env["SHARDKIT_AUTOPREFLIGHT_CONFIG"] == "/mine.json" and env["SHARDKIT_AUTOPREFLIGHT"] == "1"
    with pytest.raises(ValueError, match=f"{PACKED_ENV} does not hold SHARDKIT_\\* settings"):
        unpack(pack({}).replace("e30=", "WyJ4Il0="))  # ["x"]


def test_ranks_started_by_mpirun_arm_before_deepspeed_sets_rank_and_the_agents_of_srun_never_do():
    from shardkit.autopreflight.launch_link import rank_identity
    from shardkit.autopreflight.rank_env import enabled

    on = {"SHARDKIT_AUTOPREFLIGHT": "1"}
    # DeepSpeed's OpenMPI / MVAPICH runners: the script runs under mpirun, RANK comes later
    assert enabled({**on, "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"})
    assert rank_identity({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2"})["rank"] == 1
    assert rank_identity({"RANK": "2", "WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "0"})["world"] == 8
    # `shardkit launch` and torchrun's agent under srun: SLURM_PROCID names the node's task, not a rank
    assert not enabled({**on, "SLURM_PROCID": "1", "SLURM_NTASKS": "2"})


def _runner_args(tmp_path: Path, launcher: str):
    from deepspeed.launcher import runner

    (tmp_path / "hostfile").write_text("sknodeA slots=1\nsknodeB slots=1\n")
    args = runner.parse_args(["--hostfile", str(tmp_path / "hostfile"), "--launcher", launcher, "--master_addr",
                              "127.0.77.1", "train.py"])
    pool = runner.fetch_hostfile(args.hostfile)
    return runner, args, pool, runner.parse_inclusion_exclusion(pool, "", "")


@pytest.mark.parametrize("launcher, cls", [("pdsh", "PDSHRunner"), ("openmpi", "OpenMPIRunner"), ("mpich", "MPICHRunner"),
                                           ("impi", "IMPIRunner"), ("slurm", "SlurmRunner")])
def test_every_deepspeed_multinode_runner_carries_the_packed_variable(tmp_path, monkeypatch, launcher, cls):
    """DeepSpeed's own export filter (runner.main's loop over EXPORT_ENVS) and each runner's own
    command: the packed value is on the command line that reaches the other nodes."""
    monkeypatch.chdir(tmp_path)
    runner, args, pool, active = _runner_args(tmp_path, launcher)
    backend = getattr(runner, cls)
    built = backend(args, "e30=") if cls == "PDSHRunner" else backend(args, "e30=", pool)
    value = pack({"SHARDKIT_AUTOPREFLIGHT": "1", REPORT_ENV: "127.0.0.1:4242/abc"})
    env = {PACKED_ENV: value, "SHARDKIT_AUTOPREFLIGHT": "1", "PYTHONPATH": "/site"}
    for var in env:  # the filter of deepspeed.launcher.runner.main, as it is written there
        if any(var.startswith(name) for name in runner.EXPORT_ENVS):
            built.add_export(var, env[var])
    assert PACKED_ENV in built.exports and "SHARDKIT_AUTOPREFLIGHT" not in built.exports
    cmd = built.get_cmd(dict(env), active)
    cmd = cmd[0] if isinstance(cmd, tuple) else cmd
    assert any(value in part for part in cmd), cmd


def test_a_deepspeed_whose_runner_would_not_export_the_packed_variable_is_named_at_the_launch(tmp_path, monkeypatch):
    from deepspeed.launcher import runner

    monkeypatch.chdir(tmp_path)
    (tmp_path / "hostfile").write_text("sknodeA slots=2\nsknodeB slots=2\n")
    args = ["--hostfile", "hostfile", "--master_addr", "127.0.77.1", "train.py", "--deepspeed_config", "ds.json"]
    expected = expected_ranks(build_launch(args, "deepspeed", environ={}))
    assert expected.count == 4 and expected.hosts == {0: "sknodeA", 1: "sknodeA", 2: "sknodeB", 3: "sknodeB"}
    assert expected.remote and expected.unreachable is None and expected.route_host == "127.0.77.1"
    monkeypatch.setattr(runner, "EXPORT_ENVS", ["MLFLOW", "MV2", "UCX"])
    expected = expected_ranks(build_launch(args, "deepspeed", environ={}))
    assert expected.unreachable is not None and expected.unreachable.startswith(
        f"{PACKED_ENV} is not passed by this DeepSpeed's runner, which exports only variables starting with MLFLOW, MV2, UCX")
    # --include / --num_gpus are counted as DeepSpeed counts them; --no_ssh starts this node's ranks only
    some = expected_ranks(build_launch(["--hostfile", "hostfile", "--num_gpus", "1", "train.py"], "deepspeed", environ={}))
    assert some.hosts == {0: "sknodeA", 1: "sknodeB"}
    one = expected_ranks(build_launch(["--hostfile", "hostfile", "--no_ssh", "--node_rank", "1", "train.py"], "deepspeed", environ={}))
    assert one.hosts == {2: "sknodeB", 3: "sknodeB"} and one.per_node and not one.remote and one.world == 4
    module = expected_ranks(build_launch(["--hostfile", "hostfile", "--include", "sknodeA:1@sknodeB", "--module", "pkg.train"],
                                         "deepspeed", environ={}))
    assert module.hosts == {0: "sknodeA", 1: "sknodeB", 2: "sknodeB"}  # slot 1 of A, both of B


def test_a_deepspeed_env_file_replacing_pythonpath_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hostfile").write_text("sknodeA slots=1\nsknodeB slots=1\n")
    (tmp_path / ".deepspeed_env").write_text("PYTHONPATH=/opt/mine\n")
    expected = expected_ranks(build_launch(["--hostfile", "hostfile", "train.py"], "deepspeed", environ={}))
    assert expected.unreachable is not None and ".deepspeed_env sets PYTHONPATH=/opt/mine, which replaces the launch's" in expected.unreachable
