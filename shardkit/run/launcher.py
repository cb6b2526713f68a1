"""`shardkit launch`: check the config a training script will use, then start the real launcher.

``build_launch`` turns the command line into a :class:`LaunchPlan` (the argv of the real
``deepspeed``, ``torchrun`` or ``accelerate launch`` launcher, with every argument passed through
untouched, and the environment the ranks get); ``check_launch_config`` runs the static checks and
the version table on the config the script will read (for accelerate: the Accelerate config with
its command-line overrides, see :mod:`shardkit.run.accelerate_config`); ``run_launch`` starts the argv (a list, never a shell string)
and returns its exit status. Tests assert on the plan without spawning anything.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, Sequence

from shardkit.autopreflight import ENV_FAILED_DIR, EXIT_CODE, rank_env
from shardkit.checks import check_config, check_file
from shardkit.config.loading import is_fsdp_config, load_config
from shardkit.config.paths import auto_paths
from shardkit.core.errors import UsageError
from shardkit.core.findings import Finding, Report, Severity
from shardkit.platform.environment.facts import EnvironmentFacts, probe_environment, run_has_accelerator
from shardkit.run.accelerate_config import AccelerateRun, launch_findings, load_run, parse_accelerate_args
from shardkit.run.launch_env import launch_env_findings, per_node_ranks
from shardkit.run.launch_stop import LaunchStop, reap_leftovers, set_subreaper, stop_message
from shardkit.run.rendezvous_diagnosis import Rendezvous, StderrTail, diagnose, rendezvous_of
from shardkit.run.spawn.silence import LockWatch, silence_s

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
# A --config file is only checked when it is a DeepSpeed or shardkit FSDP2 config: `--config`
# often names the application's own settings.
_ENGINE_KEYS = {
    "zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "fp16", "bf16", "optimizer", "scheduler", "fsdp",
}


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
    """Whether every rank runs the placement preflight before its first optimizer step."""
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


def _int_opt(args: Sequence[str], names: Sequence[str]) -> int | None:
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
        per_node = _int_opt(launcher_args, ("--nproc_per_node", "--nproc-per-node"))
        nodes = _int_opt(launcher_args, ("--nnodes",)) or 1
    else:
        per_node = _int_opt(launcher_args, ("--num_gpus", "--num-gpus"))
        nodes = _int_opt(launcher_args, ("--num_nodes", "--num-nodes")) or 1
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


def check_launch_config(plan: LaunchPlan, facts: EnvironmentFacts | None = None) -> Report:
    """Static checks and the known-bad version table on the plan's config (an empty report when
    the script names none). Errors mean the launch must not start.

    ``facts``: the machine the ranks run on (default: this one, read with the plan's environment,
    so a DS_ACCELERATOR the ranks get counts). The ranks start here, so whether they have an
    accelerator is what DeepSpeed would pick here, the same answer `require_runnable_here` uses:
    an environment row (fp16 on a CPU-only machine) is then an error, not a "state --accelerator"
    warning.
    """
    facts = facts or probe_environment(plan.env)
    report = _check_config_of(plan, facts)
    # the launching shell's RANK/WORLD_SIZE/CUDA_VISIBLE_DEVICES against the launch (launch_env)
    report.extend(launch_env_findings(
        plan.env, launcher=plan.launcher, world_size=plan.world_size,
        per_node=per_node_ranks(plan.launcher, plan.launcher_args) if plan.accelerate is None else None,
        gpus=facts.cuda.device_count if facts.has_cuda else 0, config_failed=not report.ok,
    ))
    return report


def _check_config_of(plan: LaunchPlan, facts: EnvironmentFacts) -> Report:
    if plan.accelerate is not None:
        return _check_accelerate(plan, plan.accelerate, facts)
    if plan.config_path is None:
        return Report(subject="launch: no config named on the script's command line")
    checked = _check_script_config(plan, plan.config_path, facts)
    if checked is None:
        return Report(subject=plan.config_path)
    report, cfg = checked
    if plan.launcher == "deepspeed" and is_fsdp_config(cfg):
        report.add(
            Finding(
                Severity.WARNING, "--launcher", plan.launcher,
                f"{plan.config_path} is a shardkit FSDP2 config, launched with the deepspeed launcher",
                "use `shardkit launch --launcher torchrun ...` for FSDP2 scripts", rule="launch.launcher-kind",
            )
        )
    return report


def _check_script_config(plan: LaunchPlan, path: str, facts: EnvironmentFacts) -> tuple[Report, object] | None:
    """The config the script names on its own command line, checked with the `shardkit check`
    rules (None, with a note, when it is not an engine config); "auto" is accepted when the script
    got it as ``--deepspeed PATH`` (the HF Trainer fills it), and a note says so."""
    cfg = load_config(path)  # ConfigError: missing, empty, malformed
    if isinstance(cfg, dict) and not (_ENGINE_KEYS & set(cfg)):
        plan.notes.append(f"{path} is not a DeepSpeed or shardkit FSDP2 config; not checked")
        return None
    hf_auto = names_hf_trainer_config(plan.script_args, path)
    autos = auto_paths(cfg) if hf_auto and isinstance(cfg, dict) else []
    if autos:
        shown = ", ".join(autos[:3]) + (f" (+{len(autos) - 3} more)" if len(autos) > 3 else "")
        plan.notes.append(
            f'{path}: "auto" accepted in {shown} because `--deepspeed PATH` is the HF Trainer\'s flag (the Trainer '
            "fills them; its PreflightCallback checks them filled). A script that is not a Trainer and passes this file "
            'to deepspeed.initialize must fill them itself: DeepSpeed drops "auto" silently and uses its defaults'
        )
    report = check_file(
        path, world_size=plan.world_size, environment=facts, accelerator=run_has_accelerator(facts=facts),
        expect_hf_auto=hf_auto,
    )
    return report, cfg


def _check_accelerate(plan: LaunchPlan, run: AccelerateRun, facts: EnvironmentFacts | None) -> Report:
    """The Accelerate config the ranks get (file + command-line overrides): the Accelerate rules
    (its DeepSpeed section or file with the DeepSpeed rules), plus what accelerate would refuse or drop."""
    facts = facts or probe_environment(plan.env)
    accelerator = run_has_accelerator(facts=facts)
    source = run.config_file or "accelerate launch (no config file: accelerate's defaults and the command line)"
    report = Report(subject=source)
    if run.effective.get("distributed_type") in ("DEEPSPEED", "FSDP"):
        checked = run.effective
        section = checked.get("deepspeed_config")
        if isinstance(section, dict) and "deepspeed_config_file" in section and "mixed_precision" in checked:
            # launch_findings judges mixed_precision beside a config file as accelerate does: refused
            # only when it came from the YAML, not from a --mixed_precision on the command line
            checked = {k: v for k, v in checked.items() if k != "mixed_precision"}
        report = check_config(
            checked, source=source, world_size=plan.world_size, environment=facts, accelerator=accelerator,
            duplicate_keys=run.loaded.duplicate_keys if run.loaded else (),
            config_dir=Path(run.config_file).parent if run.config_file else None,
        )
    report.extend(launch_findings(run, accelerator=accelerator))
    script_cfg = plan.script_config_path
    if script_cfg is not None and not _same_file(script_cfg, _section_file(run)):
        # `accelerate launch train.py --deepspeed ds.json`: the Trainer hands this file to
        # deepspeed.initialize, whatever the YAML says; its findings carry the file's name
        checked = _check_script_config(plan, script_cfg, facts)
        if checked is not None:
            report.extend(replace(f, key=f"{script_cfg}:{f.key}") for f in checked[0].findings)
    return report


def _section_file(run: AccelerateRun) -> str | None:
    """The DeepSpeed JSON the Accelerate config names (deepspeed_config.deepspeed_config_file)."""
    section = run.effective.get("deepspeed_config")
    value = section.get("deepspeed_config_file") if isinstance(section, dict) else None
    return value if isinstance(value, str) else None


def _same_file(a: str, b: str | None) -> bool:
    return b is not None and Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def run_launch(plan: LaunchPlan) -> int:
    """Start the plan's argv and return its exit status; SIGINT/SIGTERM are passed on to it so the
    launcher can stop its ranks cleanly (as it would under Slurm or Ctrl-C).

    When ranks failed their automatic preflight, the launch ends with one line naming them and
    returns 3, after everything the launcher printed (torchrun turns a rank's exit 3 into 1 and
    prints a ChildFailedError traceback last).
    """
    import tempfile

    failed_dir = tempfile.mkdtemp(prefix="shardkit-launch-") if plan.preflight else None
    env = {**plan.env, ENV_FAILED_DIR: failed_dir} if failed_dir else plan.env
    try:
        code = _run_argv(plan, env)
        failures = preflight_failures(failed_dir) if failed_dir else {}
    finally:
        if failed_dir:
            shutil.rmtree(failed_dir, ignore_errors=True)
    if failures:
        # across nodes each node's launch sees only its own ranks' markers: say whose they are
        node = socket.gethostname() if plan.rendezvous is not None else None
        print(preflight_summary(failures, plan.world_size, node), file=sys.stderr, flush=True)
        return EXIT_CODE
    return code


def preflight_failures(folder: str | Path) -> dict[int, str]:
    """Rank -> first line of its preflight failure, from the markers the ranks left in ``folder``."""
    found: dict[int, str] = {}
    for marker in Path(folder).glob("rank*"):
        rank = marker.name[len("rank"):]
        if rank.isdigit():
            found[int(rank)] = marker.read_text(errors="replace").strip()
    return dict(sorted(found.items()))


def preflight_summary(failures: dict[int, str], world_size: int | None, node: str | None = None) -> str:
    """The launch's last line after ranks failed their preflight (``node``: this node's name, in a
    run over several nodes, where each node's launch names its own ranks)."""
    of = f" of {world_size}" if world_size else ""
    if node:
        of += f" on this node ({node}; every node names its own ranks)"
    first = next(iter(failures.values()), "") or "placement preflight failed"
    return (
        f"shardkit launch: placement preflight failed on rank(s) {sorted(failures)}{of} before the first optimizer "
        f"step: {first}; exit 3. The table is above (rank 0's output); fix the placement, or relaunch with "
        "`shardkit launch --no-preflight` to skip the check."
    )


def _run_argv(plan: LaunchPlan, env: dict[str, str]) -> int:
    # ranks whose launcher dies are re-parented here, so none outlives the launch (launch_stop)
    subreaper = set_subreaper(True)
    try:
        return _run_and_reap(plan, env, subreaper)
    finally:
        if subreaper:
            set_subreaper(False)


def _run_and_reap(plan: LaunchPlan, env: dict[str, str], subreaper: bool) -> int:
    stop = LaunchStop.starting_now()
    try:
        # across nodes, torchrun's stderr is copied through so a rendezvous failure can be named
        stderr = subprocess.PIPE if plan.rendezvous is not None else None
        proc = subprocess.Popen(plan.argv, env=env, stderr=stderr)
    except FileNotFoundError as exc:
        raise UsageError(f"cannot start {plan.argv[0]!r}: {exc}. Is {plan.launcher} installed in this environment?") from exc
    tail = StderrTail(proc.stderr) if proc.stderr is not None else None
    # a build lock whose builder dies during the run leaves every other rank waiting in silence
    lock_watch = LockWatch(env, silence_s(env)).start()
    failed_dir = env.get(ENV_FAILED_DIR)
    waiting = True

    def forward(signum: int, _frame: object) -> None:
        proc.send_signal(signum)
        if waiting:
            stop.note(signum, proc.pid)
        # Stopped by the scheduler (srun --kill-on-bad-exit) because another node's launch failed:
        # when this node's ranks already failed their preflight, the outcome is known, so end now
        # with exit 3 rather than be killed (SIGKILL after KillWait) while torchrun winds down.
        if waiting and signum == signal.SIGTERM and failed_dir and preflight_failures(failed_dir):
            raise _PreflightAlreadyFailed

    on_main = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} if on_main else {}
    try:
        try:
            code = proc.wait()
        except _PreflightAlreadyFailed:
            return EXIT_CODE
        waiting = False  # a signal from here on is passed on (to nothing) and the exit status kept
        if tail is not None and plan.rendezvous is not None:
            text = tail.text()  # also lets the last of torchrun's output through before our line
            message = diagnose(plan.rendezvous, text) if code != 0 else None
            if message:
                print(message, file=sys.stderr, flush=True)
        leftovers = reap_leftovers(stop, subreaper)
        if stop.signum is not None or leftovers:
            print(stop_message(plan.launcher, stop, leftovers), file=sys.stderr, flush=True)
        if stop.exit_code is not None and code != 0:
            return stop.exit_code  # 130 / 143: what stopped the run, not the launcher's own 1
        return 128 - code if code < 0 else code  # the launcher killed by a signal: as a shell reports it
    finally:
        lock_watch.stop()
        decided = plan.rendezvous is not None and failed_dir is not None and bool(preflight_failures(failed_dir))
        for s, handler in previous.items():
            # Across nodes the scheduler stops every node's step once one node's launch has ended
            # (srun --kill-on-bad-exit). When this node's ranks failed their preflight its outcome
            # is decided and it is only exiting: a SIGTERM now must not turn its exit 3 into 143
            # (the job's ExitCode is the highest of its tasks').
            signal.signal(s, signal.SIG_IGN if decided and s == signal.SIGTERM else handler)


class _PreflightAlreadyFailed(Exception):
    """Raised out of the launch's wait by a SIGTERM that came after this node's ranks failed their preflight."""
