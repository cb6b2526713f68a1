"""Which ranks a `shardkit launch` starts, where they run, and whether the launch's settings can
reach them: what the launch's closing line compares the ranks' reports against.

- deepspeed with a hostfile: DeepSpeed's own code reads it (``fetch_hostfile``,
  ``parse_inclusion_exclusion``, ``apply_num_nodes_and_gpus``), so --include/--exclude/--num_nodes/
  --num_gpus count as the runner counts them, and each rank's host is known (its launch.py numbers
  ranks node by node in the hostfile's order). Over its multi-node runner the ranks are on other
  nodes and get only what the runner exports: the packed variable's name is checked against the
  runner's ``EXPORT_ENVS`` of the DeepSpeed installed here, so a DeepSpeed that changes them is
  named at the launch, not discovered as a silent missing preflight. With ``--no_ssh --node_rank``
  this launch starts that node's ranks only, with this environment.
- deepspeed without a hostfile: --num_gpus x --num_nodes, else unknown (the ranks' WORLD_SIZE says).
- torchrun: --nproc_per_node x --nnodes; across nodes every node runs its own launch, which counts
  its own ranks.
- accelerate: num_processes, per machine when num_machines > 1.
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from shardkit.autopreflight import site_dir
from shardkit.autopreflight.launch_link import PACKED_ENV
from shardkit.core.files import read_regular_text
from shardkit.run.launch_plan import LaunchPlan, infer_world_size, int_option

DLTS_HOSTFILE = "/job/hostfile"
"""DeepSpeed's default --hostfile (deepspeed.launcher.runner.DLTS_HOSTFILE)."""


@dataclass
class ExpectedRanks:
    """The ranks this launch starts, as far as its command line says."""

    count: int | None
    """How many ranks this launch starts (None: the command line leaves it to the machine)."""
    world: int | None = None
    """Ranks of the whole job, where it is more than this launch starts (--no_ssh: every node's)."""
    hosts: dict[int, str] = field(default_factory=dict)
    """Rank -> host, where the launcher's plan says (DeepSpeed's hostfile); empty elsewhere."""
    per_node: bool = False
    """This launch starts one node's ranks of a bigger job (torchrun across nodes, --no_ssh)."""
    remote: bool = False
    """Ranks run on other nodes, started by DeepSpeed's multi-node runner (pdsh, MPI, srun)."""
    route_host: str | None = None
    """The host the ranks' traffic goes towards (--master_addr, else the first host)."""
    unreachable: str | None = None
    """Why the launch's settings cannot reach the remote ranks, found before the launch (a runner
    whose exports would drop the packed variable, a .deepspeed_env that replaces PYTHONPATH)."""
    rank_from: str | None = None
    """How the ranks know their number at start-up where the launcher sets no RANK ("pmi": DeepSpeed's
    slurm runner, whose srun runs the script itself); travels to them as SHARDKIT_AUTOPREFLIGHT_RANK_FROM."""


def expected_ranks(plan: LaunchPlan) -> ExpectedRanks:
    """The ranks ``plan`` starts (see the module docstring for each launcher)."""
    if plan.launcher == "deepspeed":
        return _deepspeed(plan)
    if plan.launcher == "torchrun":
        nodes = int_option(plan.launcher_args, ("--nnodes",)) or 1
        if nodes > 1:
            return ExpectedRanks(int_option(plan.launcher_args, ("--nproc_per_node", "--nproc-per-node")), per_node=True)
        return ExpectedRanks(plan.world_size)
    run = plan.accelerate
    machines = run.effective.get("num_machines") if run is not None else None
    if isinstance(machines, int) and machines > 1 and plan.world_size:
        return ExpectedRanks(plan.world_size // machines, per_node=True)
    return ExpectedRanks(plan.world_size)


def _opt(args: Sequence[str], names: Sequence[str]) -> str | None:
    args = list(args)
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in names:
            return value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return None


def _deepspeed(plan: LaunchPlan) -> ExpectedRanks:
    hostfile = _opt(plan.launcher_args, ("--hostfile", "-H")) or DLTS_HOSTFILE
    if not Path(hostfile).is_file():
        return ExpectedRanks(infer_world_size("deepspeed", plan.launcher_args))
    try:
        # lazy: keeps deepspeed (and torch) out of every launch without a hostfile
        from deepspeed.launcher import runner
    except ImportError:
        return ExpectedRanks(infer_world_size("deepspeed", plan.launcher_args))
    try:
        # with -m/--module the launcher arguments already end with the module's name
        script = [] if plan.is_module else [plan.script]
        # DeepSpeed prints its own usage error when it runs: the same one printed here first is noise
        with contextlib.redirect_stderr(io.StringIO()):
            args = runner.parse_args([*plan.launcher_args, *script, *plan.script_args])
        pool = runner.fetch_hostfile(args.hostfile)
        active = runner.parse_inclusion_exclusion(pool, args.include, args.exclude)
        active = runner.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    except (ValueError, SystemExit, KeyError, IndexError):
        return ExpectedRanks(None)  # DeepSpeed itself refuses these arguments, and says why when it runs
    hosts = _rank_hosts(active)
    if args.no_ssh:
        names = list(active)
        node = names[args.node_rank] if 0 <= args.node_rank < len(names) else None
        mine = {r: h for r, h in hosts.items() if h == node}
        return ExpectedRanks(len(mine), world=len(hosts), hosts=mine, per_node=len(names) > 1)
    multi_node = bool(args.force_multi or len(active) > 1)
    if not multi_node:
        return ExpectedRanks(len(hosts), hosts=hosts)
    route = args.master_addr or next(iter(active), None)
    return ExpectedRanks(len(hosts), hosts=hosts, remote=True, route_host=route,
                         unreachable=_why_settings_stay_here(runner, plan.env),
                         rank_from="pmi" if str(args.launcher).lower() == "slurm" else None)


def _rank_hosts(active: dict[str, Any]) -> dict[int, str]:
    """Rank -> host as DeepSpeed's launch.py numbers them: node by node, in the hostfile's order."""
    hosts: dict[int, str] = {}
    for host, slots in active.items():
        for _ in slots:
            hosts[len(hosts)] = host
    return hosts


def _why_settings_stay_here(runner: Any, env: dict[str, str]) -> str | None:
    """Why DeepSpeed's multi-node runner would not carry the launch's settings to the other nodes,
    read from the installed DeepSpeed (its EXPORT_ENVS, the accelerator's own, EXCLUDE_ENVS and
    the .deepspeed_env files it reads); None when it carries them."""
    prefixes = list(runner.EXPORT_ENVS)
    try:
        from deepspeed.accelerator import get_accelerator

        prefixes += list(get_accelerator().export_envs())
    except Exception:  # the accelerator's extras only add prefixes
        pass
    if not any(PACKED_ENV.startswith(p) for p in prefixes):
        return (f"{PACKED_ENV} is not passed by this DeepSpeed's runner, which exports only variables starting with "
                f"{', '.join(prefixes)} (deepspeed.launcher.runner.EXPORT_ENVS): shardkit does not support this "
                "DeepSpeed release's multi-node launch yet; add the line "
                f"'{PACKED_ENV}=<value>' to .deepspeed_env, or launch one `shardkit launch --no_ssh --node_rank N` per node")
    excluded = [v for key, names in getattr(runner, "EXCLUDE_ENVS", {}).items() if key in env for v in names]
    if PACKED_ENV in excluded or "PYTHONPATH" in excluded:
        return f"DeepSpeed's runner drops {PACKED_ENV} or PYTHONPATH here (EXCLUDE_ENVS)"
    for folder in getattr(runner, "DEEPSPEED_ENVIRONMENT_PATHS", []):
        env_file = Path(folder) / getattr(runner, "DEEPSPEED_ENVIRONMENT_NAME", ".deepspeed_env")
        try:
            lines = read_regular_text(env_file).splitlines() if env_file.is_file() else []
        except OSError:
            continue
        for line in lines:
            key, _, value = line.partition("=")
            if key.strip() == "PYTHONPATH" and str(site_dir()) not in value.split(os.pathsep):
                return (f"{env_file} sets PYTHONPATH={value.strip()}, which replaces the launch's on the other nodes, "
                        f"so shardkit's sitecustomize ({site_dir()}) does not load there; add {site_dir()} first in it")
            if key.strip() == PACKED_ENV:
                return f"{env_file} sets {PACKED_ENV}, which replaces this launch's settings on the other nodes; remove it"
    return None
