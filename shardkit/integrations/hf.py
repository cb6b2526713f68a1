"""shardkit's checks inside the Hugging Face ``Trainer``: one line, ``trainer.add_callback(PreflightCallback())``.

What runs, on every rank:

- **config**: the DeepSpeed config the Trainer hands to ``deepspeed.initialize``, read *after* the
  Trainer filled its ``"auto"`` values (``HfTrainerDeepSpeedConfig``: batch sizes, precision,
  clipping and optimizer values when ``TrainingArguments`` is built; bucket sizes and scheduler
  steps in ``deepspeed_init``), judged by the `shardkit check` rules and this machine's
  environment rows (shardkit.platform.environment): errors stop every rank, warnings are printed once.
  Also: FSDP asked for in ``TrainingArguments`` that Accelerate did not turn on.
- **placement**: shardkit's placement preflight (shardkit.placement.preflight, the function
  `shardkit launch` and ``shardkit.preflight`` use) over the Trainer's DeepSpeed engine, or its
  model, optimizer, scaler and scheduler; a failure prints the same table as `shardkit launch`
  and ends every rank with exit 3 before the first optimizer step.

When: transformers 5.23's ``Trainer._inner_training_loop`` calls ``_prepare_for_training``
(``deepspeed_init`` -> ``accelerator.prepare`` -> ``deepspeed.initialize`` / ``fully_shard``,
then the checkpoint load of a resume) *before* ``callback_handler.on_train_begin`` and the first
forward, so ``on_train_begin`` sees the built engine, the optimizer and resumed state. Should a
Trainer call it earlier (no engine or optimizer yet), the preflight waits for ``on_step_begin``;
when they are still missing there (an optimizer built lazily, a custom engine), rank 0 says once
what is missing and the callback does not run it (under `shardkit launch` the torch hooks do).

Where the engine comes from: callback events receive ``model`` (``trainer.model``: under DeepSpeed
the bare module, not the engine) and Accelerate's optimizer wrapper, never the Trainer. The engine
(``trainer.model_wrapped``) and the filled config hang off the Trainer, whose method is the
caller of the event, so the callback finds it on the call stack (:func:`calling_trainer`).

`shardkit launch` adds this callback to every Trainer a rank builds (shardkit.run.autopreflight.hooks
wraps ``Trainer.__init__``), checks the config right there, before ``deepspeed.initialize`` can
refuse it, and the preflight then runs once: through the callback, never again through the torch
hooks.
"""

from __future__ import annotations

import copy
import math
import os
import sys
from types import FrameType
from typing import Any, Literal

from transformers import TrainerCallback

from shardkit.core.findings import Finding, Report, Severity

OnFailure = Literal["exit", "raise"]
_SUBJECT = 'HF Trainer DeepSpeed config ("auto" values filled by the Trainer)'
# How far up the call stack the Trainer method that fired the event can be: the event method
# <- CallbackHandler.call_event <- CallbackHandler.on_<event> <- Trainer method (5.23); headroom
# for subclasses and wrappers.
_STACK_DEPTH = 12


class PreflightCallback(TrainerCallback):
    """Runs shardkit's config, environment and placement checks once the Trainer has built its
    engine and optimizer, before the first optimizer step (see the module docstring)."""

    def __init__(
        self,
        *,
        on_failure: OnFailure = "exit",
        timeout: float | None = None,
        json_path: str | None = None,
        check_config: bool = True,
    ) -> None:
        """``on_failure``: "exit" prints the table and ends every rank with exit 3 (what `shardkit
        launch` does; a rank that raised could be left waiting in a collective by its peers);
        "raise" raises ConfigError/PreflightError from ``trainer.train()`` instead (same on every
        rank). ``timeout``: seconds the preflight waits for every rank (default
        SHARDKIT_AUTOPREFLIGHT_TIMEOUT, else 120). ``json_path``: rank 0 writes the placement
        report there. ``check_config``: also check the Trainer's filled DeepSpeed config."""
        if on_failure not in ("exit", "raise"):
            from shardkit.core.errors import UsageError

            raise UsageError(
                f"PreflightCallback(on_failure={on_failure!r}): not a failure mode; use on_failure='exit' (stop every "
                "rank with exit 3, as `shardkit launch` does) or on_failure='raise' (raise from trainer.train())"
            )
        self.on_failure: OnFailure = on_failure
        self.timeout = timeout
        self.json_path = json_path
        self.check_config = check_config
        self.injected = False
        """True when `shardkit launch` added this callback (a callback the script added wins)."""
        self._pending = False
        self.ran = 0
        """How many times this callback ran the placement preflight (tests read it)."""

    # --- Trainer events ------------------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Fires only for callbacks given to Trainer(callbacks=[...]): check the config before
        # train() lets deepspeed.initialize refuse it with a message that has no fix.
        trainer = calling_trainer()
        if trainer is not None and self._in_charge(trainer):
            self._check_config(trainer, final=False)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = calling_trainer()
        if trainer is not None and not self._in_charge(trainer):
            return
        self._pending = True
        self._maybe_run(trainer, kwargs)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._pending:
            self._maybe_run(calling_trainer(), kwargs, last_chance=True)

    # --- the checks ------------------------------------------------------------------------------

    def _in_charge(self, trainer: Any) -> bool:
        """One PreflightCallback per Trainer runs: the script's own (the first) when it added one,
        else the one `shardkit launch` injected."""
        mine = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, PreflightCallback)]
        chosen = next((cb for cb in mine if not cb.injected), mine[0] if mine else self)
        return chosen is self

    def _maybe_run(self, trainer: Any, event_kwargs: dict[str, Any], *, last_chance: bool = False) -> None:
        missing = not_ready(trainer) if trainer is not None else []
        if missing and not last_chance:
            return  # engine or optimizer not built yet: on_step_begin comes before the first forward
        self._pending = False
        if missing:
            # Still not built at the first step (an optimizer built lazily, a custom engine): checking
            # the bare module would judge ZeRO-partitioned parameters as misplaced, so say so once and
            # leave it (under `shardkit launch` the torch hooks, never claimed, still run it).
            if _rank() in ("0", "?"):
                print(
                    f"shardkit: PreflightCallback: placement preflight not run: at the first step {'; '.join(missing)}"
                    f"{'; the first training forward runs it instead' if _launched() else ''}",
                    file=sys.stderr, flush=True,
                )
            return
        from shardkit.run.autopreflight import enabled
        from shardkit.run.autopreflight.run import claim

        # In a `shardkit launch` rank the torch hooks stand by too: the first to claim runs it.
        if not claim() and enabled():
            return
        if trainer is not None and self.check_config:
            self._check_config(trainer, final=True)
        kwargs, what = preflight_arguments(trainer, event_kwargs)
        self.ran += 1
        when = "before the first optimizer step (after the Trainer built the engine and optimizer)"
        if self.on_failure == "exit":
            from shardkit.run.autopreflight.run import run_or_exit

            run_or_exit(kwargs, what, when, _skip_hint(), self.timeout, self.json_path)
            return
        from shardkit.placement.preflight import preflight
        from shardkit.run.autopreflight.run import preflight_timeout

        report = preflight(**kwargs, timeout=preflight_timeout(self.timeout), json_path=self.json_path)
        if _rank() in ("0", "?"):
            print(f"shardkit: placement preflight passed on {len(report.ranks)} rank(s) ({what}) {when}", file=sys.stderr, flush=True)

    def _check_config(self, trainer: Any, *, final: bool) -> None:
        """Check the Trainer's config (see :meth:`_judge`)."""
        if self.check_config:
            # Agree only under DeepSpeed: its initialize is collective, so every rank builds this
            # Trainer; a DDP script may build one on rank 0 alone (to evaluate), and its rows (FSDP
            # not enabled) are the same on every node anyway.
            agree = bool(getattr(trainer, "is_deepspeed_enabled", False))
            report = trainer_config_report(trainer, final=final)
            self._judge(report, final=final, device=_collective_device(trainer), agree=agree)

    def _judge(self, report: Report, *, final: bool, device: Any = "cpu", agree: bool = True) -> None:
        """Print the findings and stop every rank when any rank found an error.

        The config is the same on every rank, but the environment rows are probed per node (fp16
        support, memlock limits ...): ranks agree first (one small all_reduce when a process group
        is up; ``device`` is where its backend takes tensors), so a node that stops never leaves the
        others going on into deepspeed.initialize, waiting there for it. The lowest failing rank
        prints the table (at ``final`` rank 0 also prints warnings)."""
        failed = failed_ranks(not report.ok, device) if agree else ([_rank_index()] if not report.ok else [])
        rank, me = _rank(), _rank_index()
        printer = failed[0] if failed and agree else 0
        if me == printer and (failed or (final and report.findings)):
            from shardkit.core.render import print_report

            print_report(report, file=sys.stderr)
        if not failed:
            return
        from shardkit.platform.environment import one_line

        if report.errors:
            first = one_line(report.errors[0])
        else:
            first = (f"rank(s) {failed} found error(s) in the checks of their own node (environment rows are probed "
                     f"per node); this rank stops with them. See rank {printer}'s output")
        if final:
            stage = "before the first optimizer step"
        elif agree:  # under DeepSpeed (see _check_config)
            stage = ("when the Trainer was built, before deepspeed.initialize (every Trainer is checked: train(), "
                     "evaluate() and predict() all initialize DeepSpeed with this config)")
        else:
            stage = "when the Trainer was built, before train() (every Trainer is checked)"
        if self.on_failure == "raise":
            from shardkit.core.errors import ConfigError

            count = f"{len(report.errors)} error(s)" if report.errors else f"error(s) on rank(s) {failed}"
            raise ConfigError(f"{report.subject}: {count} {stage}; first: {first}")
        from shardkit.run.autopreflight.run import stop_rank

        _printer_has_printed(me, printer)
        where = "the findings above" if me == printer else f"rank {printer}'s output"
        stop_rank(rank, f"check of the {report.subject} failed {stage}", first, where, _skip_hint())


def inject_preflight_callback(trainer: Any) -> PreflightCallback | None:
    """What `shardkit launch` does to every Trainer its ranks build: add a PreflightCallback
    (unless the script passed one to the constructor) and check the config at once, before
    ``train()`` initializes DeepSpeed. Returns the callback added (None when one was there)."""
    if any(isinstance(cb, PreflightCallback) for cb in trainer.callback_handler.callbacks):
        return None  # the script's own (its on_init_end already checked the config)
    callback = PreflightCallback()
    callback.injected = True
    trainer.add_callback(callback)
    callback._check_config(trainer, final=False)
    return callback


def calling_trainer() -> Any:
    """The ``transformers.Trainer`` whose method fired the current callback event, or None."""
    from transformers import Trainer

    frame: FrameType | None = sys._getframe(1)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


def trainer_ready(trainer: Any) -> bool:
    """The Trainer has built what the preflight checks: its optimizer, and under DeepSpeed the engine."""
    return not not_ready(trainer)


def not_ready(trainer: Any) -> list[str]:
    """What the preflight still lacks on ``trainer``, in words (empty: ready)."""
    missing = []
    if getattr(trainer, "optimizer", None) is None:
        missing.append("trainer.optimizer is None (no optimizer built yet)")
    if getattr(trainer, "is_deepspeed_enabled", False):
        engine = getattr(trainer, "model_wrapped", None)
        if not _is_deepspeed_engine(engine):
            missing.append(f"trainer.model_wrapped is a {type(engine).__name__}, not the DeepSpeedEngine DeepSpeed is enabled for")
    return missing


def _is_deepspeed_engine(obj: Any) -> bool:
    try:
        from deepspeed import DeepSpeedEngine
    except ImportError:
        return False
    return isinstance(obj, DeepSpeedEngine)


def preflight_arguments(trainer: Any, event_kwargs: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """shardkit.preflight's keywords for this Trainer, and words for the summary line."""
    if trainer is None:  # an event fired by something other than a Trainer: what the event carries
        model, optimizer = event_kwargs.get("model"), _unwrap_optimizer(event_kwargs.get("optimizer"))
        return {"model": model, "optimizer": optimizer}, f"{type(model).__name__} + optimizer"
    engine = getattr(trainer, "model_wrapped", None)
    if _is_deepspeed_engine(engine):
        from shardkit.placement.deepspeed import zero_stage

        return {"engine": engine}, f"HF Trainer, DeepSpeed ZeRO-{zero_stage(engine)} engine + optimizer"
    from shardkit.placement.fsdp import is_fsdp2

    # FSDP2: trainer.model is the fully_shard'ed module; DDP: trainer.model is the bare module
    # (the DDP wrapper in model_wrapped holds the same parameters under a "module." prefix).
    model = trainer.model
    kwargs: dict[str, Any] = {"model": model, "optimizer": _unwrap_optimizer(trainer.optimizer)}
    scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
    if scaler is not None:
        kwargs["scaler"] = scaler
    scheduler = getattr(trainer, "lr_scheduler", None)
    if scheduler is not None and hasattr(scheduler, "state_dict"):
        kwargs["lr_scheduler"] = getattr(scheduler, "scheduler", scheduler)  # Accelerate's wrapper
    kind = "FSDP2 model" if is_fsdp2(model) else type(model).__name__
    return kwargs, f"HF Trainer, {kind} + optimizer"


def _unwrap_optimizer(optimizer: Any) -> Any:
    """Accelerate's AcceleratedOptimizer keeps the torch optimizer in ``.optimizer``."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if inner is not None and hasattr(inner, "param_groups") else optimizer


def trainer_config_report(trainer: Any, *, final: bool, facts: Any = None) -> Report:
    """`shardkit check` findings (environment rows included) on the config the Trainer really
    uses, read after it filled the "auto" values, plus FSDP asked for but not enabled."""
    fsdp = _fsdp_not_enabled(trainer)
    if not getattr(trainer, "is_deepspeed_enabled", False):
        report = Report(subject="HF Trainer FSDP settings")
        report.extend(fsdp)
        return report
    world_size = int(getattr(trainer.args, "world_size", 0) or 0) or None
    report = filled_config_report(filled_deepspeed_config(trainer), world_size=world_size, final=final, facts=facts)
    report.extend(fsdp)
    return report


def filled_config_report(cfg: dict[str, Any], *, world_size: int | None, final: bool, facts: Any = None) -> Report:
    """The checks on a DeepSpeed config the Trainer filled (``filled_deepspeed_config``).

    ``final``: the Trainer has also filled what ``deepspeed_init`` fills (bucket sizes, scheduler
    steps), so an "auto" still there is one it never fills and DeepSpeed drops silently. ``facts``:
    shardkit.platform.environment.EnvironmentFacts (default: this machine, with this process's environment)."""
    from shardkit.checks import check_config
    from shardkit.platform.environment import probe_environment, run_has_accelerator

    facts = facts or probe_environment()
    report = check_config(
        cfg, source=_SUBJECT, world_size=world_size, accelerator=run_has_accelerator(facts=facts),
        environment=facts, expect_hf_auto=True,
    )
    if final:
        report.extend(_unfilled_auto(cfg))
    return report


def filled_deepspeed_config(trainer: Any) -> dict[str, Any]:
    """A copy of the DeepSpeed config the Trainer passes to deepspeed.initialize (Accelerate's
    plugin holds the HfTrainerDeepSpeedConfig's dict, filled in place)."""
    plugin = trainer.accelerator.state.deepspeed_plugin
    cfg = copy.deepcopy(dict(plugin.deepspeed_config))
    # Accelerate's DeepSpeedPlugin always overwrites steps_per_print with float("inf") to silence
    # DeepSpeed's own logging (accelerate/utils/dataclasses.py): not the user's value, and not a
    # NaN/Infinity typo the non-finite rule is there to catch.
    if isinstance(cfg.get("steps_per_print"), float) and math.isinf(cfg["steps_per_print"]):
        del cfg["steps_per_print"]
    return cfg


def _unfilled_auto(cfg: dict[str, Any]) -> list[Finding]:
    from shardkit.config.paths import auto_paths

    paths = auto_paths(cfg)
    if not paths:
        return []
    return [
        Finding(
            Severity.ERROR,
            paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} more)",
            paths,
            f'"auto" left in {len(paths)} key(s) after the Trainer filled its values: {", ".join(paths)}. The Trainer '
            "fills only the keys it knows (HfTrainerDeepSpeedConfig.trainer_config_process/finalize); DeepSpeed drops "
            "every other \"auto\" silently and uses its default (DeepSpeedConfigModel.__init__)",
            "set a concrete value for these keys (`shardkit config zero3 --hf-auto` writes \"auto\" only where the Trainer fills it)",
            "hf-auto-unfilled",
        )
    ]


def _fsdp_not_enabled(trainer: Any) -> list[Finding]:
    """FSDP asked for in TrainingArguments, but the Trainer runs without it.

    Accelerate 1.15's AcceleratorState turns an FSDP plugin on only for accelerator process
    groups (MULTI_GPU, MULTI_XPU, MULTI_NPU, ...); on CPU ranks (MULTI_CPU) it keeps the plugin
    off and the Trainer wraps the model in DDP, silently: every rank holds the whole model."""
    args = trainer.args
    wanted = bool(getattr(args, "fsdp", None)) or getattr(args, "fsdp_plugin_args", None) is not None
    if not wanted or getattr(trainer, "is_fsdp_enabled", False):
        return []
    dist_type = getattr(getattr(trainer.accelerator, "state", None), "distributed_type", None)
    seen = getattr(dist_type, "value", dist_type)
    return [
        Finding(
            Severity.ERROR,
            "TrainingArguments.fsdp",
            getattr(args, "fsdp", None),
            f"FSDP was asked for, but Accelerate did not enable it (distributed_type {seen}): the Trainer trains "
            "the unsharded model (DDP on several ranks), so memory and checkpoints are not what the FSDP config "
            "says. Accelerate enables FSDP only on accelerator ranks (GPU/XPU/NPU/HPU ...), never on CPU ranks",
            "run on GPUs (or another accelerator); to test FSDP2 on CPU ranks use shardkit's own FSDP2 path "
            "(`shardkit smoke --engine fsdp2`, shardkit.engines.fsdp.apply_fsdp), which runs on gloo",
            "hf-fsdp-not-enabled",
        )
    ]


def failed_ranks(failed: bool, device: Any = "cpu") -> list[int]:
    """The ranks that report ``failed`` (this one alone without a process group): one all_reduce
    of a world-size vector, called by every rank at the same point."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return [_rank_index()] if failed else []
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=device)
    flags[dist.get_rank()] = int(failed)
    dist.all_reduce(flags)
    return [int(r) for r in torch.nonzero(flags).flatten().tolist()]


def _collective_device(trainer: Any) -> Any:
    """Where the process group's backend takes tensors: the CPU for gloo (and gloo-backed CPU
    groups), else the Trainer's device (nccl needs the rank's GPU)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return "cpu"
    backend = str(dist.get_backend())
    return "cpu" if "gloo" in backend or backend == "mpi" else getattr(getattr(trainer, "args", None), "device", "cpu")


def _printer_has_printed(me: int, printer: int, timeout_s: float = 30.0) -> None:
    """Before a config error ends the ranks: the others wait (on the c10d store, bounded) until
    the printing rank has printed the findings, because the launcher kills the survivors as soon as
    the first rank exits and the printer would otherwise die before its table is out."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    from datetime import timedelta

    key = "shardkit/hf-config-findings-printed"
    try:
        store = dist.distributed_c10d._get_default_store()
        if me == printer:
            store.set(key, "1")
        else:
            store.wait([key], timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - a slow printer only costs the table, never the stop
        pass


def _rank_index() -> int:
    """This process's rank: the process group's, else RANK, else 0 (a single process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    rank = _rank()
    return int(rank) if rank.isdigit() else 0


def _rank() -> str:
    return os.environ.get("RANK", "?")


def _launched() -> bool:
    from shardkit.run.autopreflight import enabled

    return enabled()


def _skip_hint() -> str:
    from shardkit.run.autopreflight import enabled
    from shardkit.run.autopreflight.run import LAUNCH_SKIP_HINT

    return LAUNCH_SKIP_HINT if enabled() else "remove the PreflightCallback to skip the check"
