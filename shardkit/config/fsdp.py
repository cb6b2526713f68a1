"""shardkit's FSDP2 config (a JSON file with a top-level ``"fsdp"`` key): the typed model and its
validation. ``shardkit.engines.fsdp.apply_fsdp`` applies it with ``torch.distributed.fsdp.fully_shard``.

Example file::

    {"fsdp": {"reshard_after_forward": true, "cpu_offload": false, "pin_memory": false,
              "mixed_precision": "bf16", "wrap": ["LlamaDecoderLayer"], "state_dict": "sharded"},
     "train": {"micro_batch": 1, "grad_accum": 1, "lr": 0.0001, "weight_decay": 0.0, "clip": 1.0}}

Nothing here imports torch, so reading and checking a config stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shardkit.config.loading import load_config
from shardkit.config.paths import segment
from shardkit.core.errors import ConfigError

# Options people carry over from FSDP1 (FullyShardedDataParallel / Accelerate's fsdp_config) that
# FSDP2's fully_shard does not have, and what FSDP2 does instead. Used by fsdp_config_from_dict
# (to refuse them with a useful message) and by `shardkit check`.
FSDP1_ONLY_OPTIONS: dict[str, str] = {
    "sharding_strategy": (
        "FSDP2 has no sharding_strategy: FULL_SHARD is reshard_after_forward=true, SHARD_GRAD_OP is "
        "reshard_after_forward=false, HYBRID_SHARD is a 2-D DeviceMesh passed to apply_fsdp(mesh=...)"
    ),
    "auto_wrap_policy": (
        "FSDP2 has no auto-wrap policy: fully_shard is called on each module whose class is listed in "
        "fsdp.wrap, then on the root"
    ),
    "transformer_layer_cls_to_wrap": "FSDP2 wraps the classes listed in fsdp.wrap (a list of class names)",
    "forward_prefetch": (
        "FSDP2 always prefetches the next all-gather implicitly; explicit prefetching is "
        "FSDPModule.set_modules_to_forward_prefetch, not a config option"
    ),
    "backward_prefetch": (
        "FSDP2 always prefetches in backward implicitly; explicit prefetching is "
        "FSDPModule.set_modules_to_backward_prefetch, not a config option"
    ),
    "use_orig_params": "FSDP2 always keeps the original parameters (as DTensor shards); there is no flat parameter",
    "sync_module_states": (
        "FSDP2 does not broadcast rank 0's weights: initialize identically on every rank (same seed) "
        "or load a full state dict with set_model_state_dict(..., broadcast_from_rank0=True)"
    ),
    "limit_all_gathers": (
        "FSDP2 manages all-gather memory without record_stream (deterministic memory); there is no such option"
    ),
    "param_init_fn": (
        "FSDP2 has no init hook: build the model on the meta device, call apply_fsdp, then "
        "model.to_empty(device=...) and run your own initialization"
    ),
    "device_id": "FSDP2 takes the device from the DeviceMesh (apply_fsdp(mesh=...))",
    "cpu_ram_efficient_loading": "FSDP2 loads a full state dict with set_model_state_dict(broadcast_from_rank0=True)",
    "activation_checkpointing": "FSDP2 leaves activation checkpointing to torch.utils.checkpoint / checkpoint_wrapper",
    "state_dict_type": 'use fsdp.state_dict: "sharded" (DCP, resharding on load) or "full" (one file from rank 0)',
    "offload_params": "use fsdp.cpu_offload (FSDP2's CPUOffloadPolicy offloads parameters, gradients and optimizer states)",
    "mixed_precision_policy": 'use fsdp.mixed_precision: "bf16", "fp16" or "none"',
}

MixedPrecision = Literal["bf16", "fp16", "none"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class FSDPOptions(_Strict):
    """How fully_shard is applied."""

    reshard_after_forward: bool = True
    """Free gathered parameters after forward and re-gather in backward (FSDP1's FULL_SHARD); false
    keeps them until backward (SHARD_GRAD_OP): faster, more memory. The root always keeps them,
    as torch does by default, because backward needs it first."""
    cpu_offload: bool = False
    """Offload sharded parameters, gradients and optimizer states to CPU (CPUOffloadPolicy); the
    optimizer step then runs on CPU."""
    pin_memory: bool = False
    """Pin the offloaded memory (only with cpu_offload). Faster copies, but needs an accelerator:
    torch's CPUOffloadPolicy defaults to True and fails on a CPU-only machine, hence False here."""
    mixed_precision: MixedPrecision = "bf16"
    """Compute/all-gather dtype; gradients are reduced in fp32 and the sharded master weights stay
    fp32 whatever this says. "none" computes in the model's own dtype."""
    wrap: list[str] = Field(default_factory=list)
    """Class names (e.g. "LlamaDecoderLayer") each of whose instances becomes its own FSDP unit,
    sharded bottom-up before the root. Empty shards only the root: one all-gather of the whole
    model, so peak memory is not reduced."""
    state_dict: Literal["sharded", "full"] = "sharded"
    """Checkpoint format: "sharded" = torch.distributed.checkpoint, one shard per rank and reshardable
    to another world size; "full" = one consolidated state dict gathered to rank 0."""


class TrainOptions(_Strict):
    """The training loop settings a user expects next to the sharding settings."""

    micro_batch: int = Field(1, ge=1)
    """Sequences per rank per forward/backward."""
    grad_accum: int = Field(1, ge=1)
    """Micro-batches accumulated before each optimizer step."""
    lr: float = Field(1e-4, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    clip: float | None = Field(1.0, ge=0)
    """Max global gradient norm (clip_grad_norm_ over DTensor grads); null or 0 disables clipping."""


class FSDPConfig(_Strict):
    """A whole shardkit FSDP2 config file."""

    fsdp: FSDPOptions = Field(default_factory=FSDPOptions)
    """Sharding settings applied by apply_fsdp."""
    train: TrainOptions = Field(default_factory=TrainOptions)
    """Batch and optimizer settings."""


def validation_problems(exc: ValidationError, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key path, value seen, readable message) for each error in a pydantic ValidationError."""
    out: list[tuple[str, Any, str]] = []
    for err in exc.errors():
        loc = [segment(p) for p in err.get("loc", ()) if p != "__root__"]
        key = ".".join(([prefix] if prefix else []) + loc) or (prefix or "<top level>")
        msg = err.get("msg", "invalid value")
        if err.get("type") == "extra_forbidden":
            msg = "unknown key"
        out.append((key, err.get("input"), msg))
    return out


def fsdp_config_from_dict(d: dict[str, Any]) -> FSDPConfig:
    """Validate a parsed config dict; ConfigError names every bad key, value and the fix."""
    if not isinstance(d, dict):
        raise ConfigError(f"FSDP config must be a mapping, got {type(d).__name__}")
    problems: list[str] = []
    fsdp_block = d.get("fsdp")
    if isinstance(fsdp_block, dict):
        for key in fsdp_block:
            if key in FSDP1_ONLY_OPTIONS:
                problems.append(f"fsdp.{key}={fsdp_block[key]!r}: FSDP1 option; {FSDP1_ONLY_OPTIONS[key]}")
    if not problems:
        try:
            return FSDPConfig.model_validate(d)
        except ValidationError as exc:
            for key, value, msg in validation_problems(exc):
                problems.append(f"{key}={value!r}: {msg}")
    allowed = ", ".join(FSDPOptions.model_fields)
    raise ConfigError(
        "invalid FSDP config: " + "; ".join(problems) + f". Allowed fsdp keys: {allowed}; "
        "generate a valid file with `shardkit config fsdp -o fsdp.json`."
    )


def load_fsdp_config(path: str | Path) -> FSDPConfig:
    """Read and validate an FSDP config file (JSON or YAML)."""
    try:
        return fsdp_config_from_dict(load_config(path))
    except ConfigError as exc:
        msg = str(exc)
        raise ConfigError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from exc
