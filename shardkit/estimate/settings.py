"""The engine settings that decide memory, read from a DeepSpeed or shardkit FSDP2 config dict.

Each value the config leaves out takes DeepSpeed 0.19.8's default (``runtime/zero/config.py``,
``offload_config.py``), and the report says which values were defaults. ``"auto"`` values (the HF
Trainer's) are filled the way ``transformers.integrations.deepspeed`` fills them when the model's
hidden size is known, and reported as such.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from shardkit.config.fsdp import fsdp_config_from_dict
from shardkit.config.view import deepspeed_view, is_auto
from shardkit.core.errors import ConfigError
from shardkit.estimate.bounds import ELEMENTS, Bound, check_config_number

Precision = Literal["bf16", "fp16", "fp32"]

# DeepSpeed 0.19.8 defaults (runtime/zero/config.py: DeepSpeedZeroConfig; offload_config.py).
DS_DEFAULTS: dict[str, int] = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_model_persistence_threshold": 2**63 - 1,  # sys.maxsize
    "stage3_max_live_parameters": 1_000_000_000,
    "sub_group_size": 1_000_000_000,
}
# offload_param (nvme): buffer_count 5 buffers of buffer_size 1e8 elements; offload_optimizer (nvme):
# buffer_count 4 (one per Adam tensor: param, grad, exp_avg, exp_avg_sq).
NVME_PARAM_BUFFER_COUNT = 5
NVME_PARAM_BUFFER_SIZE = 100_000_000
NVME_OPTIMIZER_BUFFER_COUNT = 4

# Optimizer state tensors per element (fp32): Adam/AdamW exp_avg + exp_avg_sq; Lion and Adagrad one.
OPTIMIZER_STATES: dict[str, int] = {"adam": 2, "adamw": 2, "lion": 1, "adagrad": 1, "sgd": 1}


@dataclass(frozen=True)
class ZeroSettings:
    """A DeepSpeed ZeRO run's memory-relevant settings."""

    stage: int
    """ZeRO stage 0-3."""
    precision: Precision = "bf16"
    """16-bit (bf16/fp16: 2-byte params and grads, fp32 masters) or fp32 (4 bytes, the params are the masters)."""
    offload_optimizer: str = "none"
    """none | cpu | nvme: where fp32 masters, fp32 gradients and optimizer state live."""
    offload_param: str = "none"
    """none | cpu | nvme (stage 3 only): where the 16-bit parameter partitions live between uses."""
    pin_optimizer: bool = True
    """offload_optimizer.pin_memory (default True since DeepSpeed 0.19.5, PR #8207)."""
    pin_param: bool = True
    """offload_param.pin_memory (same default)."""
    ratio: float = 1.0
    """offload_optimizer.ratio: the share of sub-groups whose optimizer runs on the CPU."""
    reduce_bucket_size: int = DS_DEFAULTS["reduce_bucket_size"]
    """Elements of the gradient bucket (ZeRO-3 allocates it on the GPU at initialize, whatever the model)."""
    allgather_bucket_size: int = DS_DEFAULTS["allgather_bucket_size"]
    """ZeRO-1/2's all-gather chunk (read, not counted: it gathers into the flat group in place)."""
    prefetch_bucket_size: int = DS_DEFAULTS["stage3_prefetch_bucket_size"]
    """stage3_prefetch_bucket_size: parameters gathered ahead of the module that needs them."""
    param_persistence_threshold: int = DS_DEFAULTS["stage3_param_persistence_threshold"]
    """stage3_param_persistence_threshold: parameters this small stay whole on every GPU."""
    model_persistence_threshold: int = DS_DEFAULTS["stage3_model_persistence_threshold"]
    """stage3_model_persistence_threshold: cap on the persistent parameters' running total."""
    max_live_parameters: int = DS_DEFAULTS["stage3_max_live_parameters"]
    """stage3_max_live_parameters: cap on the gathered parameters, which bounds the prefetch."""
    sub_group_size: int = DS_DEFAULTS["sub_group_size"]
    """Elements per optimizer sub-group: the unit of the fp32 gradient buffer, NVMe swapping and ``ratio``."""
    contiguous_gradients: bool = True
    """Whether ZeRO copies gradients into the reduce bucket (the bucket is only allocated then)."""
    optimizer: str = "adamw"
    """Lower-case optimizer type (its number of state tensors per element)."""
    defaults_used: tuple[str, ...] = ()
    """Keys the config did not set (DeepSpeed's default was used)."""
    filled_auto: tuple[str, ...] = ()
    """Keys whose "auto" was filled as the HF Trainer fills it."""

    @property
    def lp_bytes(self) -> int:
        """Bytes per element of parameters and gradients as the engine keeps them."""
        return 4 if self.precision == "fp32" else 2

    @property
    def optimizer_states(self) -> int:
        return OPTIMIZER_STATES.get(self.optimizer, 2)

    @property
    def engine(self) -> str:
        return f"zero{self.stage}"


@dataclass(frozen=True)
class FSDPSettings:
    """An FSDP2 (``fully_shard``) run's memory-relevant settings, as shardkit's FSDP2 config states them."""

    cpu_offload: bool = False
    """CPUOffloadPolicy: sharded parameters, their gradients and the optimizer state on the CPU."""
    pin_memory: bool = False
    mixed_precision: str = "bf16"
    """bf16 | fp16 | none: the dtype parameters are all-gathered and computed in (the shards stay in the
    model's dtype)."""
    reshard_after_forward: bool = True
    """False keeps every unit's gathered parameters from forward to backward (SHARD_GRAD_OP)."""
    wrap: tuple[str, ...] = ("LlamaDecoderLayer",)
    optimizer: str = "adamw"
    engine: str = field(default="fsdp2", init=False)

    @property
    def optimizer_states(self) -> int:
        return OPTIMIZER_STATES.get(self.optimizer, 2)


Settings = ZeroSettings | FSDPSettings


def _int_key(zero: dict[str, Any], key: str, hidden: int | None, filled: list[str], defaults: list[str],
             aliases: tuple[str, ...] = ()) -> int:
    """The integer at ``zero_optimization.<key>`` (or an alias), "auto" filled, the default when absent."""
    found = next((k for k in (key, *aliases) if k in zero), None)
    if found is None:
        defaults.append(key)
        return DS_DEFAULTS[key]
    value = zero[found]
    if is_auto(value):
        fill = _hf_auto(key, hidden)
        if fill is None:
            defaults.append(key)
            return DS_DEFAULTS[key]
        filled.append(key)
        return fill
    # a sub-group of 0 elements would be a division by zero in DeepSpeed (and here)
    bound = Bound(1, ELEMENTS.high, "a sub-group holds at least one element") if key == "sub_group_size" else ELEMENTS
    try:
        return check_config_number(value, f"zero_optimization.{found}", bound, "CONFIG")
    except ConfigError as exc:
        raise ConfigError(f"{exc}: it is a count of elements, e.g. {DS_DEFAULTS[key]:.0e}, and the memory it reserves "
                          "cannot be computed from anything else (DeepSpeed refuses it too)") from None


def _hf_auto(key: str, hidden: int | None) -> int | None:
    """What the HF Trainer writes for "auto" (transformers.integrations.deepspeed.trainer_config_finalize)."""
    if hidden is None:
        return None
    return {
        "reduce_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
    }.get(key)


def zero_settings(cfg: dict[str, Any], hidden_size: int | None = None) -> ZeroSettings:
    """The settings of a DeepSpeed config dict; ConfigError names a key whose value cannot be used."""
    view = deepspeed_view(cfg)
    if view.stage is None:
        stage_value = cfg.get("zero_optimization", {})
        stage_value = stage_value.get("stage") if isinstance(stage_value, dict) else stage_value
        raise ConfigError(
            f"zero_optimization.stage={stage_value!r}: not a ZeRO stage DeepSpeed accepts, so the memory cannot "
            "be estimated. Use 0, 1, 2 or 3 (`shardkit check` names every problem of the file)"
        )
    zero = cfg.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    filled: list[str] = []
    defaults: list[str] = []
    precision: Precision = "bf16" if view.bf16 else "fp16" if view.fp16 else "fp32"
    for name in ("bf16", "fp16"):
        if isinstance(cfg.get(name), dict) and is_auto(cfg[name].get("enabled")):
            filled.append(f"{name}.enabled")  # the Trainer fills it from --bf16/--fp16; assumed on
            precision = "bf16" if name == "bf16" else "fp16"
    opt = cfg.get("optimizer")
    opt_type = opt.get("type") if isinstance(opt, dict) else None
    offload_param = view.offload_param.device if view.stage == 3 else "none"  # ignored below stage 3
    offload_optimizer = view.offload_optimizer.device
    if view.stage in (1, 2) and offload_optimizer == "nvme":
        offload_optimizer = "cpu"  # DeepSpeed treats nvme as cpu below stage 3
    if view.stage == 0:
        offload_optimizer = "none"
    ratio = view.offload_optimizer.ratio if view.offload_optimizer.ratio is not None else 1.0
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"zero_optimization.offload_optimizer.ratio={ratio!r}: must be between 0 and 1 "
                          "(the share of the optimizer run on the CPU)")
    contiguous = zero.get("contiguous_gradients", True)
    return ZeroSettings(
        stage=view.stage,
        precision=precision,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        pin_optimizer=view.offload_optimizer.pin_memory is not False,
        pin_param=view.offload_param.pin_memory is not False,
        ratio=ratio,
        reduce_bucket_size=_int_key(zero, "reduce_bucket_size", hidden_size, filled, defaults),
        allgather_bucket_size=_int_key(zero, "allgather_bucket_size", hidden_size, filled, defaults),
        prefetch_bucket_size=_int_key(zero, "stage3_prefetch_bucket_size", hidden_size, filled, defaults,
                                      ("prefetch_bucket_size",)),
        param_persistence_threshold=_int_key(zero, "stage3_param_persistence_threshold", hidden_size, filled,
                                             defaults, ("param_persistence_threshold",)),
        model_persistence_threshold=_int_key(zero, "stage3_model_persistence_threshold", hidden_size, filled,
                                             defaults, ("model_persistence_threshold",)),
        max_live_parameters=_int_key(zero, "stage3_max_live_parameters", hidden_size, filled, defaults,
                                     ("max_live_parameters",)),
        sub_group_size=_int_key(zero, "sub_group_size", hidden_size, filled, defaults),
        contiguous_gradients=contiguous is not False,
        optimizer=opt_type.lower() if isinstance(opt_type, str) else "adamw",
        defaults_used=tuple(defaults),
        filled_auto=tuple(filled),
    )


def fsdp_settings(cfg: dict[str, Any]) -> FSDPSettings:
    """The settings of a shardkit FSDP2 config dict (validated by its own model: ConfigError on a bad key)."""
    parsed = fsdp_config_from_dict(cfg)
    o = parsed.fsdp
    return FSDPSettings(cpu_offload=o.cpu_offload, pin_memory=o.pin_memory, mixed_precision=o.mixed_precision,
                        reshard_after_forward=o.reshard_after_forward, wrap=tuple(o.wrap))


def settings_from_config(cfg: dict[str, Any], hidden_size: int | None = None) -> Settings:
    """ZeroSettings for a DeepSpeed config, FSDPSettings for shardkit's FSDP2 config (a top-level "fsdp")."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"config is a {type(cfg).__name__}, not a mapping: pass a DeepSpeed or FSDP2 JSON/YAML file")
    if "model_type" in cfg:
        raise ConfigError(
            f"CONFIG is a model's config.json (model_type {cfg['model_type']!r}), not a DeepSpeed or FSDP2 config: "
            "pass it as --model, and the engine config as CONFIG (or --engine zero3|zero2|fsdp)"
        )
    if "fsdp" in cfg and "zero_optimization" not in cfg:
        return fsdp_settings(cfg)
    if "distributed_type" in cfg or "fsdp_config" in cfg or "deepspeed_config" in cfg:
        raise ConfigError(
            "an Accelerate config: the estimate reads the DeepSpeed JSON or shardkit FSDP2 JSON it runs. Pass the "
            "file named by deepspeed_config.deepspeed_config_file, or write one with `shardkit config`"
        )
    return zero_settings(cfg, hidden_size)

