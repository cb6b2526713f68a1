"""Generating configs that are known to work: DeepSpeed ZeRO-2/3 JSON, shardkit's FSDP2 JSON and
the equivalent Accelerate FSDP2 section. Pure functions returning dicts; `shardkit config` writes
them after `shardkit check` has passed them.

Without ``hf_auto`` every value is concrete, so the file means the same under every DeepSpeed
release (no "auto" for DeepSpeed to drop, pin_memory never left to a default that changed in 0.19.5).
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

from shardkit.config.fsdp import FSDPConfig, FSDPOptions, TrainOptions, fsdp_config_from_dict, validation_problems
from shardkit.core.errors import UsageError

OffloadDevice = Literal["none", "cpu", "nvme"]
Precision = Literal["bf16", "fp16", "fp32"]

# DeepSpeed "optimizer.type" for each --optimizer choice; all four have a CPU implementation
# (DeepSpeedCPUAdam / CPUAdagrad / CPULion), so every choice also works with offload_optimizer.
OPTIMIZERS: dict[str, str] = {"adamw": "AdamW", "adam": "Adam", "lion": "Lion", "adagrad": "Adagrad"}

AUTO = "auto"


def _optimizer_block(name: str, lr: float, weight_decay: float, hf_auto: bool) -> dict[str, Any]:
    if name not in OPTIMIZERS:
        raise UsageError(f"--optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
    params: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay}
    if name in ("adam", "adamw"):
        params.update(betas=[0.9, 0.999], eps=1e-8)
    elif name == "lion":
        params.update(betas=[0.9, 0.99])
    elif name == "adagrad":
        params.update(eps=1e-10)
    if hf_auto:
        # The HF Trainer fills these from TrainingArguments (learning_rate, adam_beta*, ...).
        params = {k: AUTO for k in params}
    return {"type": OPTIMIZERS[name], "params": params}


def _precision_blocks(precision: str, hf_auto: bool) -> dict[str, Any]:
    if precision == "bf16":
        return {"bf16": {"enabled": AUTO if hf_auto else True}}
    if precision == "fp16":
        return {
            "fp16": {
                "enabled": AUTO if hf_auto else True,
                # dynamic loss scaling starting at 2**16, halved on overflow, doubled after 1000 clean steps
                "loss_scale": 0,
                "initial_scale_power": 16,
                "loss_scale_window": 1000,
                "hysteresis": 2,
                "min_loss_scale": 1,
            }
        }
    if precision == "fp32":
        return {"bf16": {"enabled": False}, "fp16": {"enabled": False}}
    raise UsageError(f"--precision {precision!r}: choose bf16, fp16 or fp32")


def _offload_block(kind: str, device: str, nvme_path: str | None, pin_memory: bool) -> dict[str, Any]:
    if device not in ("none", "cpu", "nvme"):
        raise UsageError(f"--offload-{kind} {device!r}: choose none, cpu or nvme")
    block: dict[str, Any] = {"device": device, "pin_memory": pin_memory}
    if device == "nvme":
        if not nvme_path:
            # DeepSpeed would accept this and fail later (TypeError / AssertionError at zero.Init)
            raise UsageError(f"--offload-{kind} nvme needs --nvme-path DIR (a directory on a local NVMe drive)")
        block["nvme_path"] = nvme_path
    return block


def deepspeed_config(
    stage: int,
    *,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    nvme_path: str | None = None,
    precision: str = "bf16",
    micro_batch: int = 1,
    grad_accum: int = 1,
    world_size: int | None = None,
    clip: float = 1.0,
    optimizer: str = "adamw",
    lr: float = 1e-4,
    weight_decay: float = 0.0,
    pin_memory: bool = True,
    hf_auto: bool = False,
) -> dict[str, Any]:
    """A DeepSpeed ZeRO-2 or ZeRO-3 config dict; UsageError for combinations DeepSpeed would
    accept and then ignore or crash on (param offload at stage 2, nvme without a path ...)."""
    if stage not in (2, 3):
        raise UsageError(f"stage {stage}: shardkit generates ZeRO-2 and ZeRO-3 configs")
    for flag, value in (("--micro-batch", micro_batch), ("--grad-accum", grad_accum)):
        if value < 1:
            raise UsageError(f"{flag} {value}: must be at least 1")
    if world_size is not None and world_size < 1:
        raise UsageError(f"--world-size {world_size}: must be at least 1")
    if clip < 0:
        raise UsageError(f"--clip {clip}: must be >= 0 (0 disables clipping)")
    if stage == 2 and offload_param != "none":
        raise UsageError("--offload-param needs ZeRO-3; ZeRO-2 would ignore it silently. Use `shardkit config zero3`.")
    if stage == 2 and offload_optimizer == "nvme":
        raise UsageError("--offload-optimizer nvme needs ZeRO-3; ZeRO-2 would silently use cpu. Use cpu or zero3.")
    if nvme_path and "nvme" not in (offload_optimizer, offload_param):
        raise UsageError("--nvme-path is only used with --offload-optimizer nvme or --offload-param nvme")

    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if stage == 2:
        zero.update(
            reduce_scatter=True,
            reduce_bucket_size=AUTO if hf_auto else 500_000_000,
            allgather_partitions=True,
            allgather_bucket_size=500_000_000,
        )
    else:
        zero.update(
            # HF fills the three "auto" sizes from the model's hidden size
            reduce_bucket_size=AUTO if hf_auto else 50_000_000,
            stage3_prefetch_bucket_size=AUTO if hf_auto else 50_000_000,
            stage3_param_persistence_threshold=AUTO if hf_auto else 100_000,
            stage3_max_live_parameters=1_000_000_000,
            stage3_max_reuse_distance=1_000_000_000,
            sub_group_size=1_000_000_000,
            # so save_16bit_model / HF save_model write a usable consolidated model
            stage3_gather_16bit_weights_on_model_save=True,
        )
    if offload_optimizer != "none":
        zero["offload_optimizer"] = _offload_block("optimizer", offload_optimizer, nvme_path, pin_memory)
    if offload_param != "none":
        zero["offload_param"] = _offload_block("param", offload_param, nvme_path, pin_memory)

    cfg: dict[str, Any] = {}
    if hf_auto:
        cfg.update(train_batch_size=AUTO, train_micro_batch_size_per_gpu=AUTO, gradient_accumulation_steps=AUTO)
    else:
        if world_size is not None:
            cfg["train_batch_size"] = micro_batch * grad_accum * world_size
        cfg.update(train_micro_batch_size_per_gpu=micro_batch, gradient_accumulation_steps=grad_accum)
    cfg["gradient_clipping"] = AUTO if hf_auto else clip
    cfg["optimizer"] = _optimizer_block(optimizer, lr, weight_decay, hf_auto)
    cfg.update(_precision_blocks(precision, hf_auto))
    cfg["zero_optimization"] = zero
    cfg.update(steps_per_print=100, wall_clock_breakdown=False)
    return cfg


def fsdp_config(
    *,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    pin_memory: bool = False,
    mixed_precision: str = "bf16",
    wrap: Sequence[str] = ("LlamaDecoderLayer",),
    state_dict: str = "sharded",
    micro_batch: int = 1,
    grad_accum: int = 1,
    lr: float = 1e-4,
    weight_decay: float = 0.0,
    clip: float = 1.0,
) -> dict[str, Any]:
    """shardkit's FSDP2 config dict (every field written out)."""
    if pin_memory and not cpu_offload:
        raise UsageError("--pin-memory only applies with --cpu-offload")
    from pydantic import ValidationError

    try:
        cfg = FSDPConfig(
            fsdp=FSDPOptions(
                reshard_after_forward=reshard_after_forward,
                cpu_offload=cpu_offload,
                pin_memory=pin_memory,
                mixed_precision=mixed_precision,  # type: ignore[arg-type]
                wrap=list(wrap),
                state_dict=state_dict,  # type: ignore[arg-type]
            ),
            train=TrainOptions(micro_batch=micro_batch, grad_accum=grad_accum, lr=lr, weight_decay=weight_decay, clip=clip),
        )
    except ValidationError as exc:
        raise UsageError("; ".join(f"{k}={v!r}: {m}" for k, v, m in validation_problems(exc))) from exc
    return cfg.model_dump(mode="json")


def accelerate_fsdp_config(cfg: dict[str, Any], num_processes: int | None = None) -> dict[str, Any]:
    """The Accelerate config (as written by `accelerate config`, fsdp_version 2) equivalent to a
    shardkit FSDP2 config: run it with `accelerate launch --config_file FILE train.py`."""
    parsed = fsdp_config_from_dict(cfg)
    o = parsed.fsdp
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "mixed_precision": {"bf16": "bf16", "fp16": "fp16", "none": "no"}[o.mixed_precision],
        "num_machines": 1,
        "machine_rank": 0,
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP" if o.wrap else "NO_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": ",".join(o.wrap),
            "fsdp_reshard_after_forward": o.reshard_after_forward,
            "fsdp_offload_params": o.cpu_offload,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT" if o.state_dict == "sharded" else "FULL_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_activation_checkpointing": False,
        },
    }
    if num_processes is not None:
        out["num_processes"] = num_processes
    if not o.wrap:
        del out["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"]
    return out


# The presets in ds_configs/, each the output of `shardkit config <args>` (tests/test_presets.py
# asserts the files equal the generator's output). Regenerate with
# `shardkit config <args> -o ds_configs/<name>.json`.
PRESETS: dict[str, list[str]] = {
    "zero2": ["zero2", "--precision", "fp32"],
    "zero3": ["zero3", "--precision", "fp32"],
    "zero3_bf16": ["zero3", "--precision", "bf16"],
    # offload presets are written for GPU hosts: --pin-memory keeps them the same on every machine
    # (the CLI default follows the machine's accelerator)
    "zero3_offload_cpu": [
        "zero3", "--precision", "bf16", "--offload-optimizer", "cpu", "--offload-param", "cpu", "--pin-memory",
    ],
    # deliberate: fp32 masters and Adam states stay on the accelerator to spare host RAM
    "zero3_offload_param_only": ["zero3", "--precision", "bf16", "--offload-param", "cpu", "--pin-memory"],
    "zero3_offload_nvme": [
        "zero3", "--precision", "bf16", "--offload-optimizer", "nvme", "--offload-param", "nvme",
        "--nvme-path", "/local_nvme", "--pin-memory",
    ],
    "fsdp2_full_shard": ["fsdp", "--wrap", "LlamaDecoderLayer", "--mixed-precision", "bf16"],
    "fsdp2_cpu_offload": ["fsdp", "--wrap", "LlamaDecoderLayer", "--mixed-precision", "bf16", "--cpu-offload"],
}
