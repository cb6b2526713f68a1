"""What `shardkit launch` and its ranks agree on: the environment variables, the exit status of a
rank whose preflight failed, and where the ``sitecustomize`` lives."""

from __future__ import annotations

import os
from pathlib import Path

from shardkit.core.env_settings import read_choice, read_text

ENV_ENABLE = "SHARDKIT_AUTOPREFLIGHT"
"""Set to "1" by `shardkit launch` unless --no-preflight."""
ENV_CONFIG = "SHARDKIT_AUTOPREFLIGHT_CONFIG"
"""Path of the config the launcher found; gives the preflight the expected devices (FSDP2 offload)."""
ENV_TIMEOUT = "SHARDKIT_AUTOPREFLIGHT_TIMEOUT"
"""Seconds the preflight waits for every rank (default 120: ranks reach their first step at different times)."""
ENV_JSON = "SHARDKIT_AUTOPREFLIGHT_JSON"
"""Optional path where rank 0 writes the preflight report as JSON."""
ENV_RANK_FROM = "SHARDKIT_AUTOPREFLIGHT_RANK_FROM"
"""Set to "pmi" by `shardkit launch` when DeepSpeed's slurm runner starts the ranks: srun runs the
script itself, so RANK comes only later (deepspeed.initialize's MPI discovery) and PMIX_RANK / PMI_RANK
is what a rank knows itself by at start-up. Only then: under MPICH's mpirun, PMI_RANK is also set in
DeepSpeed's launcher_helper, which starts the rank and must never arm."""
ENV_ARMED_PID = "SHARDKIT_AUTOPREFLIGHT_ARMED_PID"
"""Set by a rank's ``sitecustomize`` once it arms: that process's id. Its child processes inherit
the rank's whole environment (RANK, the launch's settings, the PYTHONPATH with our
``sitecustomize``): DeepSpeed's op builder, a DataLoader worker, a subprocess the script starts.
Seeing another pid here, such a child knows it is not the rank, so it neither arms nor reports
"armed" to the launch a second time for the same rank."""
EXIT_CODE = 3
"""Exit status of a rank whose placement preflight failed (the launcher then stops the others)."""

DEFAULT_TIMEOUT_S = 120.0


def site_dir() -> Path:
    """The directory to put first on the ranks' PYTHONPATH: ``shardkit/startup``, which holds only
    the ``sitecustomize.py`` that installs the hooks. It is a folder, not an import: the rank's
    interpreter runs it as the top-level module ``sitecustomize``, above every shardkit layer."""
    return Path(__file__).resolve().parents[1] / "startup"


def rank_env(environ: dict[str, str], config_path: str | None = None) -> dict[str, str]:
    """``environ`` plus what the ranks need for the automatic preflight (a new dict)."""
    env = dict(environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    site = str(site_dir())
    env["PYTHONPATH"] = os.pathsep.join([site, *[p for p in parts if p != site]])
    env[ENV_ENABLE] = "1"
    if config_path:
        env[ENV_CONFIG] = str(Path(config_path).resolve())
    return env


RANK_VARS: tuple[tuple[str, str], ...] = (
    ("RANK", "WORLD_SIZE"),
    # DeepSpeed's OpenMPI and MVAPICH runners start the script under mpirun itself: RANK is set only
    # later, by deepspeed.init_distributed's MPI discovery, so the rank knows itself by these at start-up
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),
)
"""(rank, world size) variable pairs that mark a training rank, first found first. Not SLURM_PROCID:
under srun it is also set in `shardkit launch` and torchrun's agent, which must never arm."""


PMI_RANK_VARS: tuple[tuple[str, str], ...] = (("PMIX_RANK", "SLURM_NTASKS"), ("PMI_RANK", "PMI_SIZE"))
"""The pairs a rank of DeepSpeed's slurm runner has at start-up (srun --mpi=pmix, --mpi=pmi2), read
only where the launch set ENV_RANK_FROM."""


def rank_of(environ: "os._Environ[str] | dict[str, str] | None" = None) -> tuple[int, int | None] | None:
    """(rank, world size) of this training rank, from the first variable pair set; None elsewhere."""
    env = os.environ if environ is None else environ
    pairs = RANK_VARS
    if read_choice(ENV_RANK_FROM, "", env, during_run=True) == "pmi":
        pairs += PMI_RANK_VARS
    for rank_var, world_var in pairs:
        rank = env.get(rank_var, "")
        if rank.isdigit():
            world = env.get(world_var, "")
            return int(rank), int(world) if world.isdigit() else None
    return None


def enabled(environ: "os._Environ[str] | dict[str, str] | None" = None) -> bool:
    """True in a training rank started with the automatic preflight (not in the launcher itself,
    nor in a child process of an armed rank)."""
    env = os.environ if environ is None else environ
    # RANK is set by torchrun / the deepspeed launcher for workers only, never for the agent.
    return env.get(ENV_ENABLE) == "1" and rank_of(env) is not None and not child_of_armed_rank(env)


def child_of_armed_rank(environ: "os._Environ[str] | dict[str, str] | None" = None) -> bool:
    """This process inherited :data:`ENV_ARMED_PID` from a rank that armed (another process id)."""
    armed = read_text(ENV_ARMED_PID, os.environ if environ is None else environ) or ""
    return armed.isdigit() and int(armed) != os.getpid()


def mark_armed(environ: "os._Environ[str] | dict[str, str] | None" = None) -> None:
    """Record in the environment this process passes on that it is the rank that armed."""
    (os.environ if environ is None else environ)[ENV_ARMED_PID] = str(os.getpid())
