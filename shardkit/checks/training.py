"""Precision, batch arithmetic, optimizer and saving rules for DeepSpeed configs."""

from __future__ import annotations

import json
from typing import Any

from shardkit.config.paths import get
from shardkit.config.view import DeepSpeedView, as_int, as_number, is_auto
from shardkit.core.findings import Finding, Severity

# Optimizers DeepSpeed has a CPU implementation for, used when offload_optimizer is on
# (engine._configure_basic_optimizer: DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion).
CPU_OFFLOAD_OPTIMIZERS = ("adam", "adamw", "adagrad", "lion")


def training_findings(view: DeepSpeedView, *, world_size: int | None, expect_hf_auto: bool) -> list[Finding]:
    cfg = view.raw
    out: list[Finding] = []
    out += _precision(view)
    out += _batch(cfg, world_size)
    out += _optimizer(view)
    out += _clipping(cfg)
    out += _save(view, expect_hf_auto)
    return out


def _precision(view: DeepSpeedView) -> list[Finding]:
    if view.fp16 and view.bf16:
        return [
            Finding(
                Severity.ERROR,
                f"{view.bf16_key}.enabled",
                True,
                "fp16 and bf16 are both enabled; DeepSpeed refuses this at initialize "
                "('bfloat16 and fp16 modes cannot be simultaneously enabled')",
                'keep one: "bf16" on Ampere+ GPUs (no loss scaling needed), "fp16" otherwise',
                "fp16-and-bf16",
            )
        ]
    return []


def _batch(cfg: dict[str, Any], world_size: int | None) -> list[Finding]:
    out: list[Finding] = []
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    values: dict[str, int | None] = {}
    for name in names:
        raw = cfg.get(name)
        if name not in cfg or is_auto(raw):
            values[name] = None
            continue
        n = as_int(raw)
        if n is None or n < 1:
            out.append(
                Finding(
                    Severity.ERROR,
                    name,
                    raw,
                    f"{name} must be a positive integer",
                    f'set "{name}" to an integer >= 1',
                    "batch-type",
                )
            )
        values[name] = n if n is not None and n >= 1 else None
    if out:
        return out
    tb, mb, ga = (values[n] for n in names)
    if all(n not in cfg for n in names[:2]):
        return [
            Finding(
                Severity.ERROR,
                "train_micro_batch_size_per_gpu",
                None,
                "neither train_batch_size nor train_micro_batch_size_per_gpu is set; DeepSpeed refuses to start",
                'set "train_micro_batch_size_per_gpu" (and optionally "gradient_accumulation_steps")',
                "batch-arithmetic",
            )
        ]
    ws = f"world size {world_size}" if world_size else "any world size"
    problem = None
    if tb is not None and mb is not None and ga is not None:
        if world_size and tb != mb * ga * world_size:
            problem = f"train_batch_size {tb} != micro {mb} x grad_accum {ga} x world size {world_size} = {mb * ga * world_size}"
        elif not world_size and tb % (mb * ga):
            problem = f"train_batch_size {tb} is not a multiple of micro {mb} x grad_accum {ga}, so it holds for no world size"
    elif tb is not None and mb is not None and world_size:
        if tb % (mb * world_size):
            problem = f"train_batch_size {tb} is not divisible by micro {mb} x world size {world_size}"
    elif tb is not None and ga is not None and world_size:
        if tb % (ga * world_size):
            problem = f"train_batch_size {tb} is not divisible by grad_accum {ga} x world size {world_size}"
    elif tb is not None and mb is None and ga is None and world_size and tb % world_size:
        problem = f"train_batch_size {tb} is not divisible by world size {world_size}"
    if problem:
        fix = (
            f'set "train_batch_size": {mb * ga * world_size}, or drop it and let DeepSpeed compute it'
            if (mb and ga and world_size)
            else "drop train_batch_size and set train_micro_batch_size_per_gpu and gradient_accumulation_steps"
        )
        if tb is not None and mb and ga and world_size and tb % (mb * ga) == 0:
            # the common case: a config generated (or written) for another number of ranks
            made_for = tb // (mb * ga)
            problem += f" (the config fixes the global batch for {made_for} rank(s))"
            fix = (
                f"regenerate it for this run: the same `shardkit config ...` command with --world-size {world_size} "
                f'(or set "train_batch_size": {mb * ga * world_size}); or drop train_batch_size so DeepSpeed '
                "computes it for any world size"
            )
            if tb % (mb * world_size) == 0:
                fix += (
                    f"; to keep the global batch of {tb} on {world_size} rank(s), use --grad-accum "
                    f"{tb // (mb * world_size)} (gradient_accumulation_steps)"
                )
        out.append(
            Finding(
                Severity.ERROR,
                "train_batch_size",
                tb,
                f"batch arithmetic cannot hold for {ws}: {problem}. DeepSpeed asserts "
                "train_batch_size == micro_batch_per_gpu x gradient_accumulation_steps x world_size",
                fix,
                "batch-arithmetic",
            )
        )
    return out


def _optimizer(view: DeepSpeedView) -> list[Finding]:
    out: list[Finding] = []
    cfg = view.raw
    opt = view.offload_optimizer
    if opt.active and view.stage:
        if not view.has_optimizer_section:
            if get(cfg, "zero_force_ds_cpu_optimizer") is not False:
                out.append(
                    Finding(
                        Severity.WARNING,
                        "optimizer",
                        None,
                        "offload_optimizer is on but the config has no 'optimizer' section, so the optimizer "
                        "comes from your code (the HF Trainer passes torch AdamW): DeepSpeed >= 0.8.3 raises "
                        "ZeRORuntimeException at initialize unless it is DeepSpeedCPUAdam/DeepSpeedCPULion (PR #2971)",
                        'add "optimizer": {"type": "AdamW", "params": {...}} (DeepSpeed then builds DeepSpeedCPUAdam), '
                        'pass DeepSpeedCPUAdam yourself, or set "zero_force_ds_cpu_optimizer": false if a slower '
                        "custom optimizer is deliberate",
                        "offload-client-optimizer",
                    )
                )
        elif view.optimizer_type is not None and view.optimizer_type.lower() not in CPU_OFFLOAD_OPTIMIZERS:
            out.append(
                Finding(
                    Severity.ERROR,
                    "optimizer.type",
                    view.optimizer_type,
                    f"with offload_optimizer the step runs on the CPU, but DeepSpeed has CPU implementations only "
                    f"for {', '.join(CPU_OFFLOAD_OPTIMIZERS)}; {view.optimizer_type!r} would be built for the accelerator",
                    'use "type": "AdamW" (DeepSpeedCPUAdam) or turn offload_optimizer off',
                    "offload-optimizer-type",
                )
            )
    if view.has_optimizer_section and view.optimizer_type is None and not is_auto(get(cfg, "optimizer.type")):
        out.append(
            Finding(
                Severity.ERROR,
                "optimizer.type",
                get(cfg, "optimizer.type"),
                "the optimizer section has no usable 'type' (a string such as \"AdamW\")",
                'set "optimizer.type": "AdamW"',
                "optimizer-type",
            )
        )
    elif view.optimizer_type is not None:
        finding = _unknown_optimizer(view.optimizer_type)
        if finding:
            out.append(finding)
    params = get(cfg, "optimizer.params")
    if isinstance(params, dict) and "max_grad_norm" in params:
        # DeepSpeed's _configure_basic_optimizer raises ValueError("'max_grad_norm' is not supported
        # as an optimizer parameter ...") whenever the key is present, whatever its value (0 included).
        mgn = params["max_grad_norm"]
        out.append(
            Finding(
                Severity.ERROR,
                "optimizer.params.max_grad_norm",
                mgn,
                "DeepSpeed refuses max_grad_norm as an optimizer parameter (any value, 0 included): "
                "deepspeed.initialize raises ValueError",
                f'remove it and set top-level "gradient_clipping": {json.dumps(mgn, default=str)}',
                "max-grad-norm-refused",
            )
        )
    return out


def _unknown_optimizer(name: str) -> Finding | None:
    """DeepSpeed builds its own optimizers by name, else looks the name up in torch.optim."""
    try:
        from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    except Exception:  # no deepspeed here: the schema rule already says so
        return None
    if name.lower() in DEEPSPEED_OPTIMIZERS:
        return None
    import torch.optim

    if isinstance(getattr(torch.optim, name, None), type):
        return None
    return Finding(
        Severity.ERROR,
        "optimizer.type",
        name,
        f"{name!r} is neither a DeepSpeed optimizer ({', '.join(DEEPSPEED_OPTIMIZERS)}) nor a torch.optim class; "
        "deepspeed.initialize fails looking it up",
        'use e.g. "AdamW"',
        "optimizer-type",
    )


def _clipping(cfg: dict[str, Any]) -> list[Finding]:
    raw = cfg.get("gradient_clipping")
    if "gradient_clipping" not in cfg or is_auto(raw):
        return []
    n = as_number(raw)
    if n is not None and n < 0:
        # Every DeepSpeed 0.19.8 optimizer clips only `if self.clip_grad > 0.` (stage3.py, stage_1_and_2.py,
        # bf16_optimizer.py, fp16/fused_optimizer.py): a negative value trains without clipping, silently.
        return [
            Finding(
                Severity.WARNING,
                "gradient_clipping",
                raw,
                f"gradient_clipping is negative ({raw}): DeepSpeed clips only when it is > 0, so this run trains "
                "without gradient clipping and says nothing",
                'set a positive max norm, e.g. "gradient_clipping": 1.0, or 0 to say that no clipping is meant',
                "clipping-negative",
            )
        ]
    if n is None:
        # DeepSpeed reads it with get_scalar_param (no schema) and fails only at the first step.
        return [
            Finding(
                Severity.ERROR,
                "gradient_clipping",
                raw,
                f"gradient_clipping must be a number (0 disables clipping), got {raw!r}; DeepSpeed does not "
                "validate it and fails at the first step, comparing it with 0",
                'set "gradient_clipping": 1.0 (or 0 to disable)',
                "clipping-type",
            )
        ]
    return []


def _save(view: DeepSpeedView, expect_hf_auto: bool) -> list[Finding]:
    if view.stage != 3:
        return []
    zero = view.raw.get("zero_optimization")
    value = zero.get("stage3_gather_16bit_weights_on_model_save") if isinstance(zero, dict) else None
    if value is True or is_auto(value):
        return []
    who = "the HF Trainer's save_model/save_pretrained" if expect_hf_auto else "engine.save_16bit_model() / HF save_model"
    return [
        Finding(
            Severity.WARNING,
            "zero_optimization.stage3_gather_16bit_weights_on_model_save",
            value,
            f"off (DeepSpeed's default) at ZeRO-3: {who} cannot gather the partitioned weights, so no usable "
            "16-bit model file is written (the HF Trainer then saves only the DeepSpeed checkpoint). "
            "Deliberate if you only keep engine.save_checkpoint() output and convert it with zero_to_fp32.py",
            'set "zero_optimization.stage3_gather_16bit_weights_on_model_save": true',
            "gather-16bit-on-save",
        )
    ]
