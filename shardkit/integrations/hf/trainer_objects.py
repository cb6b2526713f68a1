"""Finding what the preflight checks on a Trainer: the Trainer whose method fired a callback event
(:func:`calling_trainer`, on the call stack), whether it has built its engine and optimizer yet
(:func:`not_ready`), and the preflight's keywords for it (:func:`preflight_arguments`: the DeepSpeed
engine, or the model, optimizer, scaler and scheduler).

Callback events receive ``model`` (``trainer.model``: under DeepSpeed the bare module, not the
engine) and Accelerate's optimizer wrapper, never the Trainer; the engine
(``trainer.model_wrapped``) hangs off the Trainer, whose method is the caller of the event.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from shardkit.placement.deepspeed import zero_stage
from shardkit.placement.fsdp import is_fsdp2

# How far up the call stack the Trainer method that fired the event can be: the event method
# <- CallbackHandler.call_event <- CallbackHandler.on_<event> <- Trainer method (5.23); headroom
# for subclasses and wrappers.
_STACK_DEPTH = 12


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
        return {"engine": engine}, f"HF Trainer, DeepSpeed ZeRO-{zero_stage(engine)} engine + optimizer"
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
