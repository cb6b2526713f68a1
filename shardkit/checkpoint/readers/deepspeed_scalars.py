"""The scalars of a DeepSpeed checkpoint (ZeRO-1/2/3) in the checkpoint model's words: what every
DeepSpeed reader puts in ``TrainingCheckpoint.scalars`` beside the tensors, read from rank 0's
model-states dict and optimizer dict (parsed without torch by ``read_structure``).

The keys (what a writer such as ``writers.dcp`` and the conversion plans read):

- ``step``: ``{parameter name: step}`` for every trainable parameter (DeepSpeed keeps one per
  sub-group or param group; torch one per parameter).
- ``param_groups``: the optimizer's param groups, hyperparameters as saved, ``params`` the names of
  their trainable parameters in model order.
- ``optimizer_type``: ``ds_config["optimizer"]["type"]`` ('' for a client optimizer the config does
  not name); ``adam_w_mode``: whether DeepSpeed's Adam decays decoupled, from the config (None when
  the config does not say: a client optimizer).
- ``loss_scaler``: ``{cur_scale, dynamic, ...}`` when the run kept a scale (fp16, or a dynamic or
  non-unit one); absent for bf16/fp32's static 1.
- ``lr_scheduler``, ``client_state`` (``{key: value}`` the script passed to ``save_checkpoint``),
  ``counters`` (``global_steps``, ``global_samples``, ``skipped_steps``).
- ``source``: ``{"engine": "deepspeed", "zero_stage", "ds_version", "ds_config"}``.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from shardkit.checkpoint.zero3.layout import client_state_keys
from shardkit.core.errors import CheckpointError
from shardkit.core.files import open_regular
from shardkit.storage.torch_load import TensorRef

#: How a one-element tensor ``step`` is stored (torch keeps it as a float32 tensor since 1.12, some
#: DeepSpeed optimizers as an int64 one).
_SCALAR_FORMATS = {"float32": "<f", "float64": "<d", "int64": "<q", "int32": "<i", "float16": "<e"}


def step_value(value: Any, where: str) -> float:
    """A saved ``step`` as a number: a plain int/float, or a one-element tensor's value read from its bytes."""
    if type(value) in (int, float):
        return float(value)
    if isinstance(value, TensorRef) and value.numel == 1 and value.dtype in _SCALAR_FORMATS:
        if value.path is None or value.file_offset is None:
            raise CheckpointError(f"{where}: step is a tensor whose bytes are not in the file; the file is damaged")
        fmt = _SCALAR_FORMATS[value.dtype]
        with open_regular(value.path) as fh:
            fh.seek(value.file_offset)
            raw = fh.read(struct.calcsize(fmt))
        return float(struct.unpack(fmt, raw)[0])
    raise CheckpointError(f"{where}: step is a {type(value).__name__} ({value!r}), not a number or a one-element "
                          "tensor; not what DeepSpeed's optimizers save")


def agreed_steps(ranks: list[tuple[str, list[dict[str, Any]]]]) -> list[float]:
    """Each param group's ``step``, from ``(file, group states)`` per rank: every rank of one save steps every
    group together, so a rank whose step differs holds another save's state (files of two saves copied into
    one folder, which the layout checks cannot see: same world size, same shapes)."""
    (first, first_states), others = ranks[0], ranks[1:]
    steps = [step_value(state.get("step", 0), f"{first}: param group {g}") for g, state in enumerate(first_states)]
    for path, states in others:
        for g, state in enumerate(states[:len(steps)]):
            seen = step_value(state.get("step", 0), f"{path}: param group {g}")
            if seen != steps[g]:
                raise CheckpointError(
                    f"{path}: param group {g}: Adam step {seen:g}, but {first} records {steps[g]:g}: rank files of two "
                    "saves (different training steps) are mixed in one folder, and reading them would join two "
                    "states into one. Nothing was written; copy the tag folder again from one save")
    return steps


def optimizer_facts(ds_config: dict[str, Any]) -> dict[str, Any]:
    """``optimizer_type`` and ``adam_w_mode`` from the run's DeepSpeed config (runtime/engine.py
    ``_configure_basic_optimizer``: ``Adam`` is AdamW unless ``adam_w_mode: false``)."""
    cfg = ds_config.get("optimizer") or {}
    kind = str(cfg.get("type") or "")
    adam_w: bool | None = None
    if kind.lower() == "adamw":
        adam_w = True
    elif kind.lower() == "adam":
        adam_w = bool((cfg.get("params") or {}).get("adam_w_mode", True))
    return {"optimizer_type": kind, "adam_w_mode": adam_w}


def loss_scaler(optim: dict[str, Any], precision: str) -> dict[str, Any] | None:
    """The loss scaler's state (JSON values only) where it is state worth keeping, else None."""
    scaler = optim.get("loss_scaler")
    dynamic = bool(optim.get("dynamic_loss_scale"))
    cur = getattr(scaler, "cur_scale", 1.0)
    if not dynamic and cur == 1.0 and precision != "fp16":
        return None  # a static scale of 1 (bf16/fp32): there is no state to lose
    kept = {k: v for k, v in vars(scaler).items() if k != "args" and jsonable(v)} if scaler is not None else {}
    kept["cur_scale"] = cur
    kept["dynamic"] = dynamic
    return kept


def run_scalars(model_state: dict[str, Any], ds_config: dict[str, Any], optim: dict[str, Any], *, zero_stage: int,
                ds_version: str | None, precision: str, **per_parameter: Any) -> dict[str, Any]:
    """The scalars of every DeepSpeed reader: the per-run values of rank 0's model-states dict (scheduler,
    client state, counters, source), ``per_parameter`` (``step``, ``param_groups``...) as the reader found
    them, and the loss scaler of rank 0's optimizer dict ``optim``."""
    out: dict[str, Any] = optimizer_facts(ds_config)
    out["counters"] = {k: model_state[k] for k in ("global_steps", "global_samples", "skipped_steps")
                       if isinstance(model_state.get(k), int)}
    if model_state.get("lr_scheduler"):
        out["lr_scheduler"] = model_state["lr_scheduler"]
    out["client_state"] = {k: model_state[k] for k in client_state_keys(model_state)}
    out["source"] = {"engine": "deepspeed", "zero_stage": zero_stage, "ds_version": ds_version, "ds_config": ds_config}
    out.update(per_parameter)
    scaler = loss_scaler(optim, precision)
    if scaler is not None:
        out["loss_scaler"] = scaler
    return out


def training_precision(config: dict[str, Any]) -> str:
    """'bf16', 'fp16' or 'fp32': the precision the DeepSpeed config ``config`` trained in."""
    for key in ("bf16", "fp16"):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled"):
            return key
    return "fp32"


def as_dict(value: Any) -> dict[str, Any]:
    """``value`` where it is a dict, else an empty one (a parsed file's field that should be one)."""
    return value if isinstance(value, dict) else {}


def per_parameter_steps(names_by_group: list[list[str]], steps: list[float]) -> dict[str, float]:
    """``{name: step}`` from one step per group of names (a sub-group, a param group)."""
    return {name: steps[i] for i, names in enumerate(names_by_group) for name in names}


def jsonable(value: Any) -> bool:
    """JSON data (what a manifest can keep)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True
