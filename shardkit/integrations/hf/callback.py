"""The Trainer callback itself (:class:`PreflightCallback`): on which event it runs, which of
several callbacks is in charge, and what a failure does: every rank agrees first (one small
all_reduce), the lowest failing rank prints the table, then every rank stops (exit 3, as under
`shardkit launch`) or raises from ``trainer.train()``. :func:`inject_preflight_callback` is what
`shardkit launch` does to every Trainer its ranks build.

What it checks comes from its neighbours: the filled config (``config_check``) and the objects
the preflight runs on (``trainer_objects``).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Literal

from transformers import TrainerCallback

from shardkit.autopreflight import enabled
from shardkit.autopreflight.run import LAUNCH_SKIP_HINT, claim, preflight_timeout, run_or_exit, stop_rank
from shardkit.core.errors import ConfigError, UsageError
from shardkit.core.findings import Report
from shardkit.core.render import print_report
from shardkit.integrations.hf.config_check import trainer_config_report
from shardkit.integrations.hf.resume_guard import guard_trainer_loads, restore_unguarded_load
from shardkit.integrations.hf.trainer_objects import calling_trainer, not_ready, preflight_arguments
from shardkit.placement.preflight import preflight
from shardkit.platform.environment.report import one_line

OnFailure = Literal["exit", "raise"]


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
            guard_trainer_loads(trainer)  # a resume in train(): precision named first, CPU Adam state restored
            self._check_config(trainer, final=False)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = calling_trainer()
        if trainer is not None and not self._in_charge(trainer):
            return
        if trainer is not None:
            note = restore_unguarded_load(trainer)
            if note and _rank() in ("0", "?"):
                print(f"shardkit: PreflightCallback: {note}", file=sys.stderr, flush=True)
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
        # In a `shardkit launch` rank the torch hooks stand by too: the first to claim runs it.
        if not claim() and enabled():
            return
        if trainer is not None and self.check_config:
            self._check_config(trainer, final=True)
        kwargs, what = preflight_arguments(trainer, event_kwargs)
        self.ran += 1
        when = "before the first optimizer step (after the Trainer built the engine and optimizer)"
        if self.on_failure == "exit":
            run_or_exit(kwargs, what, when, _skip_hint(), self.timeout, self.json_path)
            return
        report = preflight(**kwargs, timeout=preflight_timeout(self.timeout), json_path=self.json_path)
        if _rank() in ("0", "?"):
            print(f"shardkit: placement preflight passed on {report.rank_count} rank(s) ({what}) {when}", file=sys.stderr, flush=True)

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
            print_report(report, file=sys.stderr)
        if not failed:
            return
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
            count = f"{len(report.errors)} error(s)" if report.errors else f"error(s) on rank(s) {failed}"
            raise ConfigError(f"{report.subject}: {count} {stage}; first: {first}")
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
    guard_trainer_loads(trainer)  # the launch's deepspeed.initialize wrapper guards the engine too
    callback._check_config(trainer, final=False)
    return callback


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
    return enabled()


def _skip_hint() -> str:
    return LAUNCH_SKIP_HINT if enabled() else "remove the PreflightCallback to skip the check"
