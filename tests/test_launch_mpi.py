"""`shardkit launch --launcher deepspeed --hostfile H --launcher openmpi|mpich ...`: DeepSpeed's MPI
runners started for real, with the automatic preflight on every rank.

- OpenMPI, two namespaced nodes: mpirun reaches each host through an ssh stand-in (the one of
  tests/test_launch_pdsh.py, passed as ``--mca plm_rsh_agent``) that starts OpenMPI's orted in the
  host's own UTS + mount namespace with only HOME, PATH and LANG. The ranks then get only what
  mpirun's ``-x`` exports (DeepSpeed's runner exports PYTHON*, MLFLOW*, MV2*, UCX* and the lines of
  .deepspeed_env), so the preflight's settings reach them only through PYTHON_SHARDKIT_LAUNCH. The
  ranks find their RANK through DeepSpeed's MPI discovery (mpi4py).
- MPICH (Hydra) on localhost with two slots: DeepSpeed starts its launcher_helper under mpirun,
  which maps PMI_RANK to RANK and starts the script. That helper ends with status 0 whatever the
  script's status, so the launch's exit 3 comes from the ranks' reports alone.
- DeepSpeed's slurm runner (`--launcher slurm --launcher_args=--mpi=pmix`) on the local one-node
  cluster of tests/test_slurm.py: srun runs the script itself, so a rank has no RANK until
  deepspeed.initialize's MPI discovery; the launch tells the ranks to know themselves by PMIX_RANK.

Each case skips with the reason where its MPI (or mpi4py, or namespaces) is not installed here:
`apt-get install openmpi-bin libopenmpi-dev mpich` and `pip install mpi4py` give all of them.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from shardkit.autopreflight.rank_env import ENV_RANK_FROM, enabled, rank_of
from shardkit.run.launch_reports import outcome_line
from shardkit.run.launcher import build_launch, expected_ranks
from tests._launch_jobs import (
    DS_TRAIN,
    NODES,
    assert_passed_on_both_ranks,
    assert_stopped_on_both_ranks,
    can_make_nodes,
    install_stand_in,
    job_folder,
    nodes_hosts_file,
    run_launch,
)
from tests._ports import free_port
from tests.test_slurm import cluster  # noqa: F401  (the module-scoped local Slurm cluster fixture)

SENTINEL = "SKMPI_LAUNCH_SHELL_ONLY"
"""Set in the launch's shell only: a rank that sees it inherited the launch's whole environment."""
DS_CONFIG = ('{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, '
             '"optimizer": {"type": "Adam", "params": {"lr": 0.001}}, "zero_optimization": {"stage": 3}}\n')
# what a rank prints about its environment after training (appended to the shared training script)
ENV_PROBE = f'\nimport os\nprint(f"rank {{engine.global_rank}} sentinel={{os.environ.get({SENTINEL!r}, \'-\')}}", flush=True)\n'


def _why_no_openmpi() -> str | None:
    if not shutil.which("ompi_info"):
        return "OpenMPI is not installed (apt-get install openmpi-bin libopenmpi-dev)"
    version = subprocess.run([_openmpi_run(), "--version"], capture_output=True, text=True, timeout=30).stdout
    if "Open MPI" not in version and "OpenRTE" not in version:  # OpenRTE: started as mpirun.openmpi
        return f"{_openmpi_run()} is not OpenMPI's ({version.strip()[:80]!r}); DeepSpeed's openmpi runner calls `mpirun`"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install mpi4py): DeepSpeed's MPI discovery needs it under OpenMPI"
    return None


def _openmpi_run() -> str:
    """OpenMPI's mpirun: Debian's `mpirun` alternative points at MPICH's where mpich was installed first."""
    return shutil.which("mpirun.openmpi") or "mpirun"


def _hydra() -> str | None:
    return shutil.which("mpiexec.hydra") or shutil.which("mpirun.mpich")


def _job_folder(tmp_path: Path, hostfile: str) -> dict[str, str]:
    """The launch job folder with ds.json and the environment probe; the environment to launch from."""
    env = job_folder(tmp_path, hostfile, DS_TRAIN + ENV_PROBE)
    (tmp_path / "ds.json").write_text(DS_CONFIG)
    # mpirun refuses root unless told (CI containers run as root)
    return {**env, SENTINEL: "1", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


@pytest.fixture
def openmpi_nodes(tmp_path: Path) -> dict[str, str]:
    """Two namespaced nodes reached by OpenMPI's mpirun through the ssh stand-in."""
    why = _why_no_openmpi() or can_make_nodes()
    if why:
        pytest.skip(why)
    env = _job_folder(tmp_path, "".join(f"{name} slots=1\n" for name in NODES))
    install_stand_in(tmp_path, "ssh")
    (tmp_path / "bin" / "mpirun").write_text(f'#!/bin/sh\nexec {shutil.which(_openmpi_run())} "$@"\n')
    (tmp_path / "bin" / "mpirun").chmod(0o755)
    return {**env, "SKPDSH_HOSTS": str(nodes_hosts_file(tmp_path))}


@pytest.fixture
def mpich_host(tmp_path: Path) -> dict[str, str]:
    """One host with two slots; `mpirun` on PATH is MPICH's Hydra (Debian's alternative may be OpenMPI's)."""
    hydra = _hydra()
    if hydra is None:
        pytest.skip("MPICH is not installed (apt-get install mpich)")
    env = _job_folder(tmp_path, "localhost slots=2\n")
    # a script, not a link: Hydra finds its hydra_pmi_proxy beside the name it was started by
    (tmp_path / "bin" / "mpirun").write_text(f'#!/bin/sh\nexec {hydra} "$@"\n')
    (tmp_path / "bin" / "mpirun").chmod(0o755)
    return env


def _launch(env: dict[str, str], cwd: Path, runner_args: list[str], *script_args: str) -> subprocess.CompletedProcess[str]:
    return run_launch(env, cwd, "--no_ssh_check", *runner_args, "train.py", "--deepspeed_config", "ds.json", *script_args)


def _openmpi_args(tmp_path: Path, port: int) -> list[str]:
    mca = ("--mca btl_tcp_if_include lo --mca oob_tcp_if_include lo --mca plm_rsh_no_tree_spawn 1 "
           f"--mca plm_rsh_agent {tmp_path / 'bin' / 'ssh'}")
    return ["--launcher", "openmpi", "--master_addr", NODES["sknodeA"], "--master_port", str(port), "--launcher_args", mca]


def _mpich_args(port: int) -> list[str]:
    return ["--launcher", "mpich", "--force_multi", "--master_addr", "127.0.0.1", "--master_port", str(port)]


@pytest.mark.slow
def test_openmpi_on_two_nodes_a_clean_job_passes_the_preflight_on_every_rank(openmpi_nodes, tmp_path):
    r = _launch(openmpi_nodes, tmp_path, _openmpi_args(tmp_path, free_port()))
    assert_passed_on_both_ranks(r, ("sknodeA", "sknodeB"))
    assert "cmd = mpirun -n 2 -hostfile hostfile" in r.stdout, r.stdout[-4000:]
    # the ranks did not inherit the launch's environment: the settings came packed, through mpirun's -x
    assert "rank 0 sentinel=-" in r.stdout and "rank 1 sentinel=-" in r.stdout, r.stdout[-4000:]


@pytest.mark.slow
def test_openmpi_on_two_nodes_a_module_replaced_after_initialize_stops_every_rank_named(openmpi_nodes, tmp_path):
    r = _launch(openmpi_nodes, tmp_path, _openmpi_args(tmp_path, free_port()), "--replace-head")
    assert_stopped_on_both_ranks(r)


@pytest.mark.slow
def test_mpich_a_clean_job_passes_the_preflight_on_every_rank(mpich_host, tmp_path):
    r = _launch(mpich_host, tmp_path, _mpich_args(free_port()))
    assert_passed_on_both_ranks(r)
    assert "cmd = mpirun -n 2 -ppn 2" in r.stdout and "launcher_helper.py" in r.stdout, r.stdout[-4000:]


@pytest.mark.slow
def test_mpich_a_module_replaced_after_initialize_exits_3_although_deepspeeds_helper_exits_0(mpich_host, tmp_path):
    r = _launch(mpich_host, tmp_path, _mpich_args(free_port()), "--replace-head")
    assert_stopped_on_both_ranks(r)


@pytest.fixture
def slurm_host(cluster: dict[str, str], tmp_path: Path) -> dict[str, str]:  # noqa: F811
    """The local one-node cluster, this host with two slots in the hostfile, srun able to start PMIx ranks."""
    why = _why_no_openmpi()
    if why:
        pytest.skip(why)
    kinds = subprocess.run(["srun", "--mpi=list"], env=cluster, capture_output=True, text=True, timeout=60)
    if "pmix" not in kinds.stdout + kinds.stderr:
        pytest.skip(f"this Slurm has no PMIx plugin (srun --mpi=list: {(kinds.stdout + kinds.stderr).strip()[:200]!r})")
    env = _job_folder(tmp_path, f"{socket.gethostname()} slots=2\n")
    return {**env, "SLURM_CONF": cluster["SLURM_CONF"]}


def _slurm_args(port: int) -> list[str]:
    # =: DeepSpeed's argparse takes a separate "--mpi=pmix" for an option of its own
    return ["--launcher", "slurm", "--force_multi", "--master_addr", "127.0.0.1", "--master_port", str(port),
            "--launcher_args=--mpi=pmix"]


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.xdist_group("slurm")
def test_deepspeeds_slurm_runner_a_clean_job_passes_the_preflight_on_every_rank(slurm_host, tmp_path):
    r = _launch(slurm_host, tmp_path, _slurm_args(free_port()))
    assert_passed_on_both_ranks(r, (socket.gethostname(), socket.gethostname()))
    assert "cmd = srun -n 2 --mpi=pmix --export=ALL," in r.stdout, r.stdout[-4000:]


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.xdist_group("slurm")
def test_deepspeeds_slurm_runner_a_module_replaced_after_initialize_stops_every_rank_named(slurm_host, tmp_path):
    r = _launch(slurm_host, tmp_path, _slurm_args(free_port()), "--replace-head")
    assert_stopped_on_both_ranks(r)


# ---------------------------------------------------------------- no processes


def test_a_rank_of_deepspeeds_slurm_runner_arms_by_pmix_rank_only_where_the_launch_says_so():
    on = {"SHARDKIT_AUTOPREFLIGHT": "1"}
    # srun --mpi=pmix starts the script itself: no RANK until deepspeed.initialize's MPI discovery
    assert rank_of({**on, ENV_RANK_FROM: "pmi", "PMIX_RANK": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}) == (1, 2)
    assert rank_of({**on, ENV_RANK_FROM: "pmi", "PMI_RANK": "3", "PMI_SIZE": "4"}) == (3, 4)
    # once DeepSpeed set RANK, RANK names the rank (its reports use it)
    assert rank_of({ENV_RANK_FROM: "pmi", "PMIX_RANK": "1", "RANK": "5", "WORLD_SIZE": "8"}) == (5, 8)
    # without the launch's word: MPICH's launcher_helper (PMI_RANK set) starts the rank and must not arm
    assert not enabled({**on, "PMI_RANK": "0", "PMI_SIZE": "2"})
    assert not enabled({**on, "PMIX_RANK": "0", "SLURM_NTASKS": "2"})


def test_the_launch_tells_ranks_of_the_slurm_runner_to_use_pmi_and_names_a_missing_mpi_plugin(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hostfile").write_text("sknodeA slots=2\n")
    args = ["--hostfile", "hostfile", "--force_multi", "--master_addr", "127.0.0.1", "train.py"]
    slurm = expected_ranks(build_launch(["--launcher", "slurm", *args], "deepspeed", environ={}))
    assert slurm.rank_from == "pmi" and slurm.remote and slurm.count == 2
    assert expected_ranks(build_launch(["--launcher", "openmpi", *args], "deepspeed", environ={})).rank_from is None
    line = outcome_line({}, slurm, "127.0.0.1:4242/abc", None, 0)
    assert line.startswith("shardkit launch: warning: the placement preflight never ran on rank(s) [0, 1] of 2 "
                           "(hosts sknodeA): no report came from them: under DeepSpeed's slurm runner"), line
    assert "--launcher_args=--mpi=pmix" in line


def test_deepspeeds_own_usage_error_is_printed_once_not_also_by_the_launchs_rank_count(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hostfile").write_text("sknodeA slots=2\n")
    # argparse takes "--mpi=pmix" after --launcher_args for an option: DeepSpeed refuses it when it runs
    plan = build_launch(["--hostfile", "hostfile", "--launcher", "slurm", "--launcher_args", "--mpi=pmix", "train.py"],
                        "deepspeed", environ={})
    assert expected_ranks(plan).count is None
    assert "usage:" not in capsys.readouterr().err
