"""The plan of a `shardkit launch`: the command line taken apart (launcher arguments, script, its
arguments), the config the script will read, how many ranks the launcher starts, and the real
launcher's argv and environment. Nothing here checks a config or starts a process, so tests assert on
the plan without spawning anything."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

from shardkit.autopreflight import rank_env
from shardkit.core.errors import UsageError
from shardkit.run.accelerate_config import AccelerateRun, load_run, parse_accelerate_args
from shardkit.run.rendezvous_diagnosis import Rendezvous, rendezvous_of

Launcher = Literal["deepspeed", "torchrun", "accelerate"]
LAUNCHERS: tuple[Launcher, ...] = ("deepspeed", "torchrun", "accelerate")

# Script arguments that name the config, in the spellings users have: DeepSpeed's own
# add_config_arguments (--deepspeed_config; --deepspeed is a flag there), the HF Trainer
# (--deepspeed PATH), and a generic --config.
CONFIG_FLAGS: tuple[str, ...] = ("--deepspeed_config", "--deepspeed-config", "--deepspeed", "--config")
# These always take a path, so whatever follows is the config, even a directory or a missing file
# (then an error naming it, never a launch "with no config named").
PATH_ONLY_FLAGS: tuple[str, ...] = ("--deepspeed_config", "--deepspeed-config")
CONFIG_SUFFIXES: tuple[str, ...] = (".json", ".yaml", ".yml")


@dataclass
class LaunchPlan:
    """Everything `shardkit launch` will do, computed without side effects."""

    launcher: Launcher
    argv: list[str]
    """The real launcher's command line: its executable, then the user's arguments untouched."""
    env: dict[str, str]
    """The environment the launcher (and so every rank) gets."""
    script: str
    """The training script (or module after -m / --module)."""
    script_args: list[str]
    """Arguments after the script, as given."""
    config_path: str | None
    """The config the script will use, when one was named on its command line."""
    world_size: int | None
    """Ranks the launcher will start, when the arguments say (nproc x nodes)."""
    preflight: bool
    """Whether every rank is asked to run the placement preflight before its first optimizer step
    (whether each did, the ranks report to the launch: :mod:`shardkit.run.launch_reports`)."""
    notes: list[str] = field(default_factory=list)
    """Things worth saying before the launch (a --config that is not an engine config ...)."""
    is_module: bool = False
    """The script is a module run with -m/--module (no file to check)."""
    accelerate: AccelerateRun | None = None
    """--launcher accelerate: the Accelerate config the run reads, with the command line's overrides."""
    script_config_path: str | None = None
    """--launcher accelerate: a config the script names itself (``accelerate launch train.py
    --deepspeed ds.json``, the HF Trainer recipe); checked beside the Accelerate config."""
    rendezvous: Rendezvous | None = None
    """torchrun across nodes (c10d): a rendezvous that times out or cannot be reached is named after
    torchrun's own output (see :mod:`shardkit.run.rendezvous_diagnosis`)."""
    launcher_args: list[str] = field(default_factory=list)
    """The launcher's own arguments (before the script): how many ranks it starts on this node."""


def split_script(args: Sequence[str]) -> tuple[list[str], str, list[str]]:
    """``[launcher args] script.py [script args]`` -> the three parts.

    The script is the first argument ending in ``.py``, or the one after ``-m``/``--module``.
    """
    args = list(args)
    for i, arg in enumerate(args):
        if arg in ("-m", "--module") and i + 1 < len(args):
            return args[: i + 2], args[i + 1], args[i + 2 :]
        if arg.endswith(".py") and not arg.startswith("-"):
            return args[:i], arg, args[i + 1 :]
    raise UsageError(
        f"no training script in {' '.join(args) or '(nothing)'}: expected `shardkit launch [launcher args] "
        "train.py [script args]` (or `-m package.module`)"
    )


def find_config(script_args: Sequence[str]) -> str | None:
    """The config path in the script's arguments (``--deepspeed_config X``, ``--deepspeed X``,
    ``--config X`` and the ``=`` forms); None when there is none.

    ``--deepspeed_config`` always takes a path. ``--deepspeed`` is a plain flag in DeepSpeed's own
    argument parser, so its value is taken only when it looks like a config file or is an existing
    path; ``--config`` often names the application's own settings, so only a config-looking file.
    """
    args = list(script_args)
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag not in CONFIG_FLAGS:
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        if flag in PATH_ONLY_FLAGS and (not value or value.startswith("-")):
            # a path-only flag with its path missing would otherwise launch with no config checked
            seen = f"followed by {value!r}" if value else "with no value"
            raise UsageError(
                f"{flag} {seen}: it takes the config's path, so the config would go unchecked; "
                f"pass `{flag} ds_config.json` (or `{flag}=PATH` for a path that starts with '-')"
            )
        if not value or value.startswith("-"):
            continue
        if flag in PATH_ONLY_FLAGS or value.endswith(CONFIG_SUFFIXES) or Path(value).is_file():
            return value
        if flag == "--deepspeed" and Path(value).exists():
            return value
    return None


def missing_script(plan: LaunchPlan, cwd: Path | None = None) -> str | None:
    """Why the plan's script cannot run (it does not exist, or is not a file), or None.

    Checked before the launcher starts: torchrun would otherwise start its agent and N ranks that
    each fail to open the file. A module (``-m pkg.train``) is left to the ranks' own PYTHONPATH.
    """
    if plan.is_module:
        return None
    path = Path(plan.script)
    full = path if path.is_absolute() else (cwd or Path.cwd()) / path
    if not full.exists():
        return f"training script {plan.script} does not exist (looked for {full}); check the path"
    if not full.is_file():
        return f"training script {plan.script} is not a file ({full}); pass the .py file to run"
    return None


def int_option(args: Sequence[str], names: Sequence[str]) -> int | None:
    """The whole number after the first of ``names`` (``--flag N`` or ``--flag=N``); None when absent."""
    args = list(args)
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in names:
            if not eq:
                value = args[i + 1] if i + 1 < len(args) else ""
            # torchrun's --nnodes takes MIN:MAX for elastic jobs; the minimum is what is known
            value = value.split(":")[0]
            if value.isdigit():
                return int(value)
    return None


def infer_world_size(launcher: Launcher, launcher_args: Sequence[str]) -> int | None:
    """nproc x nodes from the launcher's arguments; None when they leave it to the machine."""
    if launcher == "torchrun":
        per_node = int_option(launcher_args, ("--nproc_per_node", "--nproc-per-node"))
        nodes = int_option(launcher_args, ("--nnodes",)) or 1
    else:
        per_node = int_option(launcher_args, ("--num_gpus", "--num-gpus"))
        nodes = int_option(launcher_args, ("--num_nodes", "--num-nodes")) or 1
    return per_node * nodes if per_node else None


_MODULES = {"deepspeed": "deepspeed.launcher.runner", "torchrun": "torch.distributed.run", "accelerate": "accelerate.commands.launch"}


def launcher_command(launcher: Launcher) -> list[str]:
    """The real launcher's command: the console script next to this Python when there is one
    (so the ranks use this environment), else ``python -m`` its module (for accelerate:
    ``accelerate launch`` / ``python -m accelerate.commands.launch``)."""
    sub = ["launch"] if launcher == "accelerate" else []
    beside = Path(sys.executable).with_name(launcher)
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside), *sub]
    found = shutil.which(launcher)
    if found:
        return [found, *sub]
    return [sys.executable, "-m", _MODULES[launcher]]


def build_launch(
    args: Sequence[str],
    launcher: Launcher = "deepspeed",
    *,
    preflight: bool = True,
    environ: dict[str, str] | None = None,
) -> LaunchPlan:
    """The plan for ``[launcher args] script.py [script args]``; nothing is checked or started."""
    if launcher not in LAUNCHERS:
        raise UsageError(f"--launcher {launcher!r}: choose one of {', '.join(LAUNCHERS)}")
    if launcher == "accelerate":
        return _build_accelerate(args, preflight=preflight, environ=environ)
    launcher_args, script, script_args = split_script(args)
    is_module = launcher_args[-2:] in (["-m", script], ["--module", script])
    config_path = find_config(script_args)
    env = dict(os.environ if environ is None else environ)
    if preflight:
        env = rank_env(env, config_path)
    return LaunchPlan(
        launcher=launcher,
        argv=[*launcher_command(launcher), *args],
        env=env,
        script=script,
        script_args=script_args,
        config_path=config_path,
        world_size=infer_world_size(launcher, launcher_args),
        preflight=preflight,
        is_module=is_module,
        rendezvous=rendezvous_of(launcher_args) if launcher == "torchrun" else None,
        launcher_args=list(launcher_args),
    )


def _build_accelerate(args: Sequence[str], *, preflight: bool, environ: dict[str, str] | None) -> LaunchPlan:
    """The plan for ``accelerate launch [accelerate args] script.py [script args]``. The Accelerate
    config is read here (ConfigError: missing, unreadable, malformed): the world size is in it."""
    env = dict(os.environ if environ is None else environ)
    run = load_run(parse_accelerate_args(args, env))
    kind = run.effective.get("distributed_type")
    notes = [] if kind in ("DEEPSPEED", "FSDP") else [
        f"distributed_type {kind or 'NO'}: no DeepSpeed or FSDP settings to check in the Accelerate config"
    ]
    if preflight:
        # accelerate launch runs torch's elastic agent in its own process (torch.distributed.run.run)
        # with os.environ plus its ACCELERATE_* variables, so the ranks inherit this environment
        env = rank_env(env, run.config_file)
    return LaunchPlan(
        launcher="accelerate",
        argv=[*launcher_command("accelerate"), *args],
        env=env,
        script=run.script,
        script_args=run.script_args,
        config_path=run.config_file,
        world_size=run.world_size,
        preflight=preflight,
        is_module=run.is_module,
        accelerate=run,
        script_config_path=find_config(run.script_args),
        notes=notes,
    )


def names_hf_trainer_config(script_args: Sequence[str], path: str | None) -> bool:
    """The config came as ``--deepspeed PATH``: the HF Trainer's spelling (TrainingArguments via
    HfArgumentParser; DeepSpeed's own ``--deepspeed`` takes no value), so the Trainer fills its
    "auto" values and the ranks' PreflightCallback (shardkit.integrations.hf) checks them filled."""
    args = list(script_args)
    return path is not None and any(
        a == f"--deepspeed={path}" or (a == "--deepspeed" and args[i + 1 : i + 2] == [path]) for i, a in enumerate(args)
    )
