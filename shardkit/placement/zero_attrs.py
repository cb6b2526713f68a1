"""Where each tensor attribute of a DeepSpeed ZeRO optimizer belongs, by what DeepSpeed uses it for.

One table serves the live preflight (``placement/deepspeed.py``) and the judge of recorded
snapshots (``placement/observed.py``). It was written from DeepSpeed 0.19.8's ``stage3.py``,
``stage_1_and_2.py`` and ``fp16/fused_optimizer.py`` and checked against recordings of 14 healthy
runs on an H100 (``tests/data/gpu_truth/``): every attribute those runs hold is here, and an
attribute that is not is reported as "not checked", never guessed.

No attribute changes role between stages, so one table covers ZeRO-0 to ZeRO-3; ``optimizer``
already means the compute device wherever a stage has no optimizer offload.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardkit.placement.expected import ExpectedDevices

# Roles: what decides the device of a tensor with that role.
COMPUTE = "compute"
"""Used in forward/backward: the rank's compute device."""
PARAM_SHARD = "param_shard"
"""A ZeRO-3 partition of the bit16 parameters: follows ``offload_param``."""
OPTIMIZER = "optimizer"
"""Lives with the optimizer step: follows ``offload_optimizer`` (ZeRO-3's ``self.device``)."""
FP32_SUBGROUP = "fp32_subgroup"
"""A ZeRO-3 fp32 sub-group: ``offload_optimizer`` with its ``ratio`` (``ExpectedDevices.fp32_subgroup``)."""
HOST = "host"
"""A (pinned) host staging buffer: CPU by construction."""
META = "meta"
"""Shape-only bookkeeping DeepSpeed keeps on the meta device by construction."""


@dataclass(frozen=True)
class AttrRule:
    """How one ZeRO optimizer attribute is placed."""

    role: str
    """One of the roles above."""
    why: str
    """What DeepSpeed uses the tensor for (the reason shown next to the expected device)."""
    live: bool = False
    """Also checked by the live preflight (False for lists that alias parameters already checked by name,
    and for the tensors the live collector records under its own names: ``zero.fp32_partition[i]`` ...)."""


ZERO_ATTRS: dict[str, AttrRule] = {
    # ZeRO-3 (stage3.py)
    "fp16_groups": AttrRule(COMPUTE, "the model's bit16 parameters, gathered on the compute device"),
    "fp16_partitioned_groups": AttrRule(PARAM_SHARD, "the parameters' ZeRO-3 partitions (ds_tensor)"),
    "fp16_partitioned_groups_flat": AttrRule(PARAM_SHARD, "flat buffer of the ZeRO-3 bit16 partitions", live=True),
    "fp32_partitioned_groups_flat": AttrRule(FP32_SUBGROUP, "fp32 master partition of a sub-group"),
    "grad_partitions_flat_buffer": AttrRule(OPTIMIZER, "gradient partitions, reduced where the optimizer steps"),
    "__param_id_to_grad_partition": AttrRule(OPTIMIZER, "views into grad_partitions_flat_buffer"),
    "inf_or_nan_tracker": AttrRule(OPTIMIZER, "overflow flag, created on the optimizer device (stage3.py)", live=True),
    "lp_param_buffer": AttrRule(PARAM_SHARD, "defragmented bit16 partitions (only without param offload)", live=True),
    "param_groups_fp16_flat_cpu_memory": AttrRule(HOST, "pinned host buffer for offloaded bit16 partitions", live=True),
    "lp_param_contiguous_pin_buffer": AttrRule(HOST, "pinned host buffer for bit16 partitions", live=True),
    "lp_grad_partitions_flat_pin_buffers": AttrRule(HOST, "pinned host buffer for gradient partitions", live=True),
    "persistent_parameters": AttrRule(COMPUTE, "parameters below param_persistence_threshold: kept whole on the compute device"),
    "param_dict": AttrRule(COMPUTE, "the model's parameters by id"),
    "_global_grad_norm": AttrRule(OPTIMIZER, "global gradient norm, computed where the gradient partitions are", live=True),
    # ZeRO-1/2 (stage_1_and_2.py)
    "bit16_groups": AttrRule(COMPUTE, "the model's bit16 parameters"),
    "bit16_groups_flat": AttrRule(COMPUTE, "flat bit16 weights the model computes with"),
    "parallel_partitioned_bit16_groups": AttrRule(COMPUTE, "this rank's views into the flat bit16 weights"),
    "round_robin_bit16_groups": AttrRule(COMPUTE, "the model's bit16 parameters, reordered"),
    "params_in_partition": AttrRule(COMPUTE, "parameters whose gradients this rank owns"),
    "params_not_in_partition": AttrRule(COMPUTE, "parameters whose gradients other ranks own"),
    "round_robin_bit16_meta": AttrRule(META, "shape-only copies DeepSpeed keeps on the meta device"),
    "single_partition_of_fp32_groups": AttrRule(OPTIMIZER, "fp32 master partition"),
    "offload_gradient_dict": AttrRule(OPTIMIZER, "fp32 gradients of the offloaded partition", live=True),
    "param_buffer_of_bit16_for_cpu_offload_groups": AttrRule(HOST, "pinned host copy of the bit16 partition", live=True),
    "temp_grad_buffer_for_cpu_offload": AttrRule(HOST, "pinned host staging buffer for gradients", live=True),
    "temp_grad_buffer_for_gpu_offload": AttrRule(COMPUTE, "accelerator staging buffer for gradients", live=True),
    # ZeRO-0 with bf16/fp16 (fp16/fused_optimizer.py) and plain FusedAdam
    "fp16_groups_flat": AttrRule(COMPUTE, "flat bit16 weights (ZeRO-0)", live=True),
    "fp32_groups_flat": AttrRule(OPTIMIZER, "flat fp32 masters (ZeRO-0)", live=True),
    "flatten_grad_norm_mask_list": AttrRule(COMPUTE, "gradient-norm masks (ZeRO-0)", live=True),
    "_dummy_overflow_buf": AttrRule(COMPUTE, "FusedAdam's overflow flag", live=True),
}

_MANGLED = re.compile(r"^_\w+?(__[A-Za-z]\w*)$")


def attr_key(attr: str) -> str:
    """``_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition`` -> ``__param_id_to_grad_partition``:
    Python mangles private names with the class name, which differs between stages and subclasses."""
    m = _MANGLED.match(attr)
    return m.group(1) if m else attr


def rule_for(attr: str) -> AttrRule | None:
    return ZERO_ATTRS.get(attr_key(attr))


def expected_for(rule: AttrRule, expected: "ExpectedDevices", index: int = 0, count: int = 1) -> tuple[str, str]:
    """(device, why) for a tensor of ``rule``'s role; ``index``/``count`` place a ZeRO-3 fp32 sub-group."""
    if rule.role == COMPUTE:
        return expected.compute, f"{rule.why}: compute device"
    if rule.role == PARAM_SHARD:
        return expected.param_shard, f"{rule.why}; {expected.param_shard_why}"
    if rule.role == OPTIMIZER:
        return expected.optimizer, f"{rule.why}; {expected.optimizer_why}"
    if rule.role == FP32_SUBGROUP:
        dev, why = expected.fp32_subgroup(index, count)
        return dev, f"{rule.why}; {why}"
    if rule.role == HOST:
        return "cpu", rule.why
    return "meta", rule.why
