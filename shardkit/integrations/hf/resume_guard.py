"""The Trainer's DeepSpeed resume, made right without a call by hand: the Trainer resumes with
DeepSpeed's plain ``engine.load_checkpoint`` (transformers 5.23 ``deepspeed_load_checkpoint``,
inside ``train()``, after ``accelerator.prepare`` built the engine and before ``on_train_begin``).

- :func:`guard_trainer_loads` (at ``on_init_end``, or when `shardkit launch` adds the callback):
  the engine ``accelerator.prepare`` builds gets ``guard_plain_loads``, so a checkpoint whose files
  are named for another precision than the config is refused, named, before DeepSpeed's
  ``FileNotFoundError``, and the CPU Adam kernel state is restored after the load.
- :func:`restore_unguarded_load` (at ``on_train_begin``): a callback added with
  ``trainer.add_callback`` after the Trainer was built gets no event before the load, so the
  precision check cannot run first; the kernel state is still restored there (no step has run
  since the load, so the replay lands where an uninterrupted run is).
"""

from __future__ import annotations

import functools
from typing import Any

from shardkit.checkpoint.ops.resume_zero3 import guard_plain_loads, restore_after_plain_load

_WRAPPED = "_shardkit_guards_engines"


def guard_trainer_loads(trainer: Any) -> None:
    """Guard the ``load_checkpoint`` of every DeepSpeed engine ``trainer.accelerator.prepare``
    returns (this Trainer's accelerator only; a second call does nothing)."""
    accelerator = getattr(trainer, "accelerator", None)
    prepare = getattr(accelerator, "prepare", None)
    if accelerator is None or prepare is None or getattr(prepare, _WRAPPED, False):
        return

    @functools.wraps(prepare)
    def guarded_prepare(*args: Any, **kwargs: Any) -> Any:
        result = prepare(*args, **kwargs)
        for obj in result if isinstance(result, tuple) else (result,):
            if _is_deepspeed_engine(obj):
                guard_plain_loads(obj)
        return result

    setattr(guarded_prepare, _WRAPPED, True)
    accelerator.prepare = guarded_prepare


def restore_unguarded_load(trainer: Any) -> str | None:
    """After a load the guard did not see (the engine is unguarded and has loaded a checkpoint):
    restore the CPU Adam kernel state now and guard later loads. Returns a note for the user, or
    None when there was nothing to do."""
    engine = getattr(trainer, "model_wrapped", None)
    if not _is_deepspeed_engine(engine) or getattr(engine, "_shardkit_guarded_loads", False):
        return None
    loaded = getattr(engine, "loaded_checkpoint_dp_world_size", None) is not None
    guard_plain_loads(engine)
    if not loaded:
        return None
    replays = restore_after_plain_load(engine)
    done = ", ".join(f"{r.kernel} to step {r.step}" for r in replays) or "no CPU Adam kernel needed it"
    return (
        f"the Trainer loaded a DeepSpeed checkpoint before this callback could guard the load (the callback was "
        f"added after the Trainer was built): CPU Adam kernel state restored now ({done}), but a checkpoint of "
        "another precision was not checked before DeepSpeed read it; pass the callback as "
        "Trainer(callbacks=[PreflightCallback()]) or run under `shardkit launch` for both"
    )


def _is_deepspeed_engine(obj: Any) -> bool:
    try:
        from deepspeed import DeepSpeedEngine
    except ImportError:
        return False
    return isinstance(obj, DeepSpeedEngine)
