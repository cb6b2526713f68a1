"""Partial optimizer offload (``zero_optimization.offload_optimizer.ratio``): where DeepSpeed 0.19.8
refuses the ratio, ignores it, or does something other than "this share of the optimizer on the
CPU".

What DeepSpeed does with it, read from its source (the rule itself lives in
``shardkit.platform.device_rules.zero3_first_cpu_subgroup``, shared with the placement preflight):

- ``runtime/zero/offload_config.py:99``: ``ratio: float = Field(1.0, ge=0.0, le=1.0)``.
- ``runtime/zero/config.py:395-400``: any ``ratio < 1`` outside stage 3 refuses the whole config
  ("Partial offloading only supported for ZeRO Stage 3."), whatever the offload device.
- ``runtime/zero/stage3.py:1100-1108``: only with ``offload_optimizer`` on, the ZeRO-3 fp32
  sub-groups ``[0, int((1 - ratio) * n))`` stay on the accelerator, the rest go to the CPU.
- ``stage3.py:313-326, 1249-1258``: the accelerator sub-groups are stepped by a torch AdamW
  (``backup_optimizer``), built only after asserting the optimizer is exactly DeepSpeedCPUAdam.
- ``stage3.py:3443, 3552``: checkpoints save and load only DeepSpeedCPUAdam's state.
"""

from __future__ import annotations

from typing import Any

from shardkit.config.view import DeepSpeedView, as_number
from shardkit.core.findings import Finding, Severity
from shardkit.platform.device_rules import zero3_first_cpu_subgroup, zero3_offload_ratio

RULE = "offload-ratio"
"""DeepSpeed refuses the ratio (or the optimizer it needs)."""
RULE_IGNORED = "offload-ratio-ignored"
"""The ratio is accepted and has no effect."""
RULE_NVME = "offload-ratio-nvme"
"""The ratio with NVMe offload: split, then swapped."""
RULE_SPLIT = "offload-ratio-split"
"""What an accepted ratio really does."""
SUB_GROUP_SIZE_DEFAULT = 1_000_000_000
"""DeepSpeedZeroConfig.sub_group_size's default (runtime/zero/config.py)."""


def offload_ratio_findings(view: DeepSpeedView) -> list[Finding]:
    """Every finding about ``offload_optimizer.ratio``; none when the key is absent."""
    zero = view.raw.get("zero_optimization")
    block = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    if not isinstance(block, dict) or "ratio" not in block:
        return []
    key = f"{view.offload_optimizer.key}.ratio"
    raw = block["ratio"]
    if raw == "auto":
        return []  # DeepSpeed drops "auto" keys (the default, 1.0, applies): the "auto" rule says so
    ratio = zero3_offload_ratio(raw)
    if ratio is None:
        return [Finding(
            Severity.ERROR, key, raw,
            f"DeepSpeed refuses the config: ratio must be a number from 0 to 1 (deepspeed/runtime/zero/"
            f"offload_config.py:99, Field(1.0, ge=0.0, le=1.0)); {raw!r} is not. It is the share of the ZeRO-3 "
            "fp32 sub-groups whose optimizer step runs on the CPU",
            '1.0 (the default) offloads every sub-group; e.g. "ratio": 0.3 keeps the first int(0.7 * n) of n '
            "sub-groups on the accelerator",
            RULE)]
    if ratio >= 1.0:
        return []  # the default: full offload, nothing split
    stage = view.stage
    if stage is None:
        return []  # the stage itself is refused and reported by its own rule
    if stage != 3:
        return [Finding(
            Severity.ERROR, key, raw,
            f"partial optimizer offload (ratio < 1) exists only in ZeRO stage 3: at stage {stage} DeepSpeed "
            "refuses the whole config with 'Partial offloading only supported for ZeRO Stage 3.' "
            "(deepspeed/runtime/zero/config.py:395-400), whatever offload_optimizer.device is",
            'remove "ratio" (1.0 is the default), or set "zero_optimization.stage": 3',
            RULE)]
    device = view.offload_optimizer.device
    if device == "none":
        return [Finding(
            Severity.WARNING, key, raw,
            f"ratio has no effect: offload_optimizer.device is {block.get('device', 'none')!r}, so DeepSpeed never "
            "splits the sub-groups (stage3.py:1100 builds the split only when the optimizer is offloaded) and "
            "every fp32 master weight and Adam state stays on the accelerator",
            'set "device": "cpu" to offload part of the optimizer, or remove "ratio"',
            RULE_IGNORED)]
    out = _optimizer_rules(view, key, raw)
    if device == "nvme":
        out.append(Finding(
            Severity.WARNING, key, raw,
            "ratio with device nvme: DeepSpeed 0.19.8 documents the ratio for CPU Adam only (offload_config.py:100) "
            "but still splits the sub-groups (stage3.py:1100-1108); a sub-group of at least max(1 MiB, "
            "aio.block_size) of fp32 is swapped to NVMe whichever side it is on (stage3.py:1117, "
            "swap_tensor/optimizer_utils.py:225-232), and the accelerator side's torch AdamW keeps its state "
            "outside the swapper; shardkit's preflight expects the split as for cpu",
            'use "device": "cpu" for partial offload, or remove "ratio" to swap every sub-group to NVMe',
            RULE_NVME))
    out.append(_split_finding(view, key, raw, ratio, zero))
    return out


def _optimizer_rules(view: DeepSpeedView, key: str, raw: Any) -> list[Finding]:
    """stage3.py:316 asserts ``type(init_optimizer) == DeepSpeedCPUAdam`` ('Hybrid Optimizer Only
    Supports DeepSpeedCPUAdam'): an exact type, so neither torch's Adam nor ZenFlow's subclass."""
    opt = view.raw.get("optimizer")
    params = opt.get("params") if isinstance(opt, dict) else None
    zero = view.raw.get("zero_optimization")
    assertion = "DeepSpeed stops at initialize with AssertionError 'Hybrid Optimizer Only Supports DeepSpeedCPUAdam' (stage3.py:316)"
    if view.optimizer_type is None:
        return [Finding(
            Severity.WARNING, key, raw,
            "partial offload needs the optimizer to be exactly DeepSpeedCPUAdam; with no 'optimizer' section the "
            f"client optimizer decides, and anything else (torch's AdamW, a subclass) means {assertion}",
            'add "optimizer": {"type": "AdamW", ...} so DeepSpeed builds DeepSpeedCPUAdam, or pass a '
            "deepspeed.ops.adam.DeepSpeedCPUAdam yourself",
            RULE)]
    if view.optimizer_type.lower() not in ("adam", "adamw"):
        return [Finding(
            Severity.ERROR, key, raw,
            f"partial offload needs DeepSpeedCPUAdam, which DeepSpeed builds only for optimizer.type Adam/AdamW; "
            f"optimizer.type is {view.optimizer_type!r}, so {assertion}",
            'set "optimizer": {"type": "AdamW", ...}, or remove "ratio"',
            RULE)]
    if isinstance(params, dict) and params.get("torch_adam") is True:
        return [Finding(
            Severity.ERROR, "optimizer.params.torch_adam", True,
            f"torch_adam makes DeepSpeed build torch.optim.AdamW (engine.py:2380), and with {key}={raw} {assertion}",
            'remove "torch_adam", or remove "ratio"',
            RULE)]
    if isinstance(zero, dict) and zero.get("zenflow") is not None:
        return [Finding(
            Severity.ERROR, "zero_optimization.zenflow", "set",
            f"ZenFlow makes DeepSpeed build ZenFlowCPUAdam (engine.py:2386), a subclass the exact type check "
            f"refuses: with {key}={raw} {assertion}",
            'remove "ratio" (ZenFlow has its own selective update), or remove "zenflow"',
            RULE)]
    return []


def _split_finding(view: DeepSpeedView, key: str, raw: Any, ratio: float, zero: Any) -> Finding:
    """What a ratio really does: a split by sub-group, and a checkpoint that forgets one side."""
    size_raw = zero.get("sub_group_size", SUB_GROUP_SIZE_DEFAULT) if isinstance(zero, dict) else SUB_GROUP_SIZE_DEFAULT
    size = as_number(size_raw)
    size_text = f"{int(size):,}" if size is not None else repr(size_raw)
    if ratio == 0.0:
        return Finding(
            Severity.WARNING, key, raw,
            "ratio 0 offloads nothing: int((1 - 0) * n) = n, so every sub-group's fp32 master weights and Adam state "
            "stay on the accelerator, stepped by a torch AdamW, while DeepSpeed still keeps its gradient partitions "
            "on the CPU (stage3.py:333, the optimizer device is cpu whenever offload_optimizer is on), and "
            "engine.save_checkpoint saves none of that Adam state (stage3.py:3443 saves DeepSpeedCPUAdam's only)",
            'remove offload_optimizer to keep the optimizer on the accelerator, or use a ratio above 0',
            RULE_SPLIT)
    needed = _sub_groups_needed(ratio)
    return Finding(
        Severity.WARNING, key, raw,
        f"ratio={ratio:g} splits by sub-group, not by bytes: of the n sub-groups each rank's partition forms (one "
        f"per {size_text} elements, zero_optimization.sub_group_size), DeepSpeed keeps the first "
        f"int((1 - {ratio:g}) * n) on the accelerator, stepped by a torch AdamW, and the rest on the CPU with "
        f"DeepSpeedCPUAdam (stage3.py:1100-1108). Below {needed} sub-groups none stays on the accelerator (one "
        "sub-group: everything is offloaded, as with ratio 1.0). And engine.save_checkpoint saves only "
        "DeepSpeedCPUAdam's state (stage3.py:3443): on resume the accelerator sub-groups' Adam moments restart "
        "from zero",
        f"give each rank at least {needed} sub-groups (sub_group_size at most the per-rank parameter count / "
        f"{needed}) and check the split with `shardkit preflight` (it names each sub-group's side); use ratio 1.0 "
        "where a resume must keep every Adam moment",
        RULE_SPLIT)


def _sub_groups_needed(ratio: float) -> int:
    """Fewest sub-groups for which ``ratio`` keeps at least one on the accelerator (DeepSpeed's rounding)."""
    n = max(1, int(1 / (1 - ratio)) - 2)  # close below the answer; the loop applies DeepSpeed's float rounding
    while zero3_first_cpu_subgroup(ratio, n) < 1:
        n += 1
    return n
