"""What DeepSpeed ZeRO allocates per rank, item by item, as DeepSpeed 0.19.8's code allocates it.

Sources (site-packages/deepspeed/runtime/zero/): ``stage3.py`` (``DeepSpeedZeroOptimizer_Stage3``:
``_create_fp16_partitions_with_defragmentation``, ``_create_fp32_partitions``, ``initialize_optimizer_states``,
the IPG buckets and ``grad_partitions_flat_buffer`` at the end of ``__init__``), ``partition_parameters.py``
(each parameter split into ``ceil(numel / world)`` elements per rank, ``_aligned_size``),
``parameter_offload.py`` (``mark_persistent_parameters``), ``partitioned_param_coordinator.py`` (prefetch
capped by ``max_live_parameters``), ``stage_1_and_2.py`` (flat 16-bit groups padded to ``2 x world``,
the CPU-offload buffers) and ``runtime/fp16/fused_optimizer.py`` (ZeRO-0 with 16-bit params).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardkit.estimate.model import ModelShape
from shardkit.estimate.report import Device, MemoryItem, RunShape
from shardkit.estimate.settings import (
    NVME_OPTIMIZER_BUFFER_COUNT,
    NVME_PARAM_BUFFER_COUNT,
    NVME_PARAM_BUFFER_SIZE,
    ZeroSettings,
)

FP32 = 4


def _dtype_bytes(dtype: str) -> int:
    return 2 if dtype in ("bfloat16", "float16", "bf16", "fp16", "half") else 4


def _partitions(model: ModelShape, world: int) -> list[int]:
    """Each parameter's partition on one rank: ceil(numel / world) (partition_parameters.py pads to a multiple)."""
    if model.params:
        return [math.ceil(p.numel / world) for p in model.params]
    return [math.ceil(model.total_params / world)]


def _persistent(model: ModelShape, s: ZeroSettings) -> tuple[int, int]:
    """(count, elements) of the parameters ZeRO-3 keeps whole on every GPU (mark_persistent_parameters: in
    named_parameters order, numel <= param threshold while the running total stays <= model threshold)."""
    count = total = 0
    for p in model.params:
        if p.numel + total > s.model_persistence_threshold:
            continue
        if p.numel <= s.param_persistence_threshold:
            count += 1
            total += p.numel
    return count, total


@dataclass(frozen=True)
class SubGroups:
    """The optimizer sub-groups of one rank, as runs of (elements, how many groups): a bare count at a small
    sub_group_size is millions of equal groups, counted here, never listed."""

    runs: tuple[tuple[int, int], ...]

    def __len__(self) -> int:
        return sum(count for _, count in self.runs)

    @property
    def largest(self) -> int:
        return max(size for size, _ in self.runs)

    def sizes(self) -> list[int]:
        """Every group's elements, in order (for a few groups: tests and reports)."""
        return [size for size, count in self.runs for _ in range(count)]

    def elements_from(self, first: int) -> int:
        """Elements of the groups from index ``first`` on."""
        total = index = 0
        for size, count in self.runs:
            skipped = min(count, max(0, first - index))
            total += size * (count - skipped)
            index += count
        return total


def _sub_groups(partitions: list[int], sub_group_size: int) -> SubGroups:
    """Elements of each optimizer sub-group (stage3.py ``_create_fp16_sub_groups``: a group closes once it
    reaches sub_group_size; one group when the whole partition is smaller)."""
    total = sum(partitions)
    if sub_group_size >= total:
        return SubGroups(((total, 1),))
    if len(partitions) == 1:  # a bare count: equal groups, the last one the remainder
        n = math.ceil(total / sub_group_size)
        last = total - sub_group_size * (n - 1)
        return SubGroups(((sub_group_size, n - 1), (last, 1)) if n > 1 else ((last, 1),))
    groups, size = [], 0
    for i, n in enumerate(partitions):
        size += n
        if size >= sub_group_size or i == len(partitions) - 1:
            groups.append((size, 1))
            size = 0
    return SubGroups(tuple(groups))


def _optimizer_split(groups: SubGroups, s: ZeroSettings) -> tuple[int, int]:
    """(elements on the GPU, elements on the host) of the fp32 partitions: with offload_optimizer, the last
    ``ratio`` share of sub-groups goes to the CPU (stage3.py ``subgroup_to_device``)."""
    total = groups.elements_from(0)
    if s.offload_optimizer == "none":
        return total, 0
    first_cpu = int((1 - s.ratio) * len(groups))
    host = groups.elements_from(first_cpu)
    return total - host, host


def zero3_items(model: ModelShape, s: ZeroSettings, run: RunShape) -> tuple[list[MemoryItem], list[str]]:
    world, lp, n_states = run.world_size, s.lp_bytes, s.optimizer_states
    parts = _partitions(model, world)
    part = sum(parts)
    groups = _sub_groups(parts, s.sub_group_size)
    gpu_opt, host_opt = _optimizer_split(groups, s)
    opt_host = s.offload_optimizer != "none"
    param_dev: Device = "host" if s.offload_param != "none" else "gpu"
    grad_dev: Device = "host" if opt_host else "gpu"
    lp_name = "16-bit" if lp == 2 else "fp32"
    items: list[MemoryItem] = []
    notes: list[str] = []
    key_p, key_o = "zero_optimization.offload_param", "zero_optimization.offload_optimizer"
    split = f"sum of ceil(numel/{world}) = {part:,} elements"

    if s.offload_param == "nvme":
        swap = NVME_PARAM_BUFFER_COUNT * NVME_PARAM_BUFFER_SIZE * lp
        items.append(MemoryItem("z3.lp_partitions", f"{lp_name} parameter swap buffers (partitions on NVMe)",
                                "parameters", "host", swap, pinned=True,
                                how=f"{key_p}.buffer_count {NVME_PARAM_BUFFER_COUNT} x buffer_size "
                                    f"{NVME_PARAM_BUFFER_SIZE:.0e} x {lp} B (defaults)"))
    else:
        items.append(MemoryItem("z3.lp_partitions", f"{lp_name} parameter partitions (param.ds_tensor)", "parameters",
                                param_dev, part * lp, pinned=param_dev == "host" and s.pin_param,
                                how=f"{split} x {lp} B; {key_p}.device={s.offload_param}"))
    if model.params:
        n_persist, persist = _persistent(model, s)
        items.append(MemoryItem("z3.persistent", "persistent parameters kept whole (ds_persist)", "parameters",
                                "gpu", persist * lp,
                                how=f"{n_persist} params of <= {s.param_persistence_threshold:,} elements "
                                    f"(stage3_param_persistence_threshold): {persist:,} x {lp} B, on the GPU "
                                    "even with offload_param"))
    items.append(MemoryItem("z3.grad_partitions", f"{lp_name} gradient partitions (grad_partitions_flat_buffer)",
                            "gradients", grad_dev, part * lp, pinned=opt_host and s.pin_optimizer,
                            how=f"{split} x {lp} B; on {key_o}.device={s.offload_optimizer}"))
    if opt_host and s.offload_optimizer == "cpu":
        items.append(MemoryItem("z3.fp32_grads", "fp32 gradients of the CPU optimizer (per sub-group)",
                                "gradients", "host", host_opt * FP32, pinned=s.pin_optimizer,
                                how=f"{host_opt:,} elements x 4 B (pin_memory={s.pin_optimizer})"))
        if gpu_opt:
            items.append(MemoryItem("z3.fp32_grads_gpu", "fp32 gradients of the sub-groups kept on the GPU (ratio)",
                                    "gradients", "gpu", gpu_opt * FP32,
                                    how=f"{gpu_opt:,} elements x 4 B; {key_o}.ratio={s.ratio}"))
    elif not opt_host:
        largest = groups.largest
        items.append(MemoryItem("z3.fp32_grads", "fp32 gradients of one sub-group at the step", "gradients", "gpu",
                                largest * FP32, "step",
                                how=f"largest sub-group {largest:,} elements x 4 B (sub_group_size="
                                    f"{s.sub_group_size:.0e}, {len(groups)} sub-group(s)), one at a time"))
    if s.offload_optimizer != "nvme":
        # initialize_optimizer_states: a zeroed fp32 buffer of the largest sub-group on the optimizer's device
        largest = groups.largest
        items.append(MemoryItem("z3.init_grad_buffer", "fp32 gradient buffer of initialize_optimizer_states",
                                "gradients", grad_dev, largest * FP32, "init", how=f"{largest:,} elements x 4 B"))
    # fp32 masters: stage3.py reuses the partitions when they already are fp32 on the optimizer's device
    aliased = lp == FP32 and ((param_dev == "host") == opt_host) and s.offload_param != "nvme"
    if s.offload_optimizer == "nvme":
        largest = groups.largest
        items.append(MemoryItem("z3.nvme_swap", "optimizer swap buffers (fp32 masters and state on NVMe)",
                                "buffers", "host", NVME_OPTIMIZER_BUFFER_COUNT * largest * FP32, pinned=True,
                                how=f"{key_o}.buffer_count {NVME_OPTIMIZER_BUFFER_COUNT} x largest sub-group "
                                    f"{largest:,} x 4 B"))
    elif aliased:
        notes.append("fp32 run: the parameter partitions are the fp32 masters (stage3.py reuses them, no copy)")
    else:
        for dev, n in (("gpu", gpu_opt), ("host", host_opt)):
            items.append(MemoryItem(f"z3.fp32_masters{'' if dev == ('host' if opt_host else 'gpu') else '_' + dev}",
                                    "fp32 master partitions (fp32_partitioned_groups_flat)", "fp32 masters",
                                    dev, n * FP32, how=f"{n:,} elements x 4 B"))  # type: ignore[arg-type]
        # _create_fp32_partitions converts the 16-bit partition (`converted`), then keeps a .clone() of it
        items.append(MemoryItem("z3.init_fp32_copy", "fp32 conversion cloned into the masters", "fp32 masters",
                                "host" if opt_host else "gpu", groups.largest * FP32, "init",
                                how=f"largest sub-group {groups.largest:,} elements x 4 B, until the clone"))
    if s.offload_optimizer != "nvme":
        for dev, n in (("gpu", gpu_opt), ("host", host_opt)):
            items.append(MemoryItem(f"z3.optimizer_state{'' if dev == ('host' if opt_host else 'gpu') else '_' + dev}",
                                    f"{s.optimizer} state ({n_states} fp32 tensor(s) per element)",
                                    "optimizer state", dev, n * FP32 * n_states,  # type: ignore[arg-type]
                                    how=f"{n:,} elements x {n_states} x 4 B"))
    if s.contiguous_gradients:
        items.append(MemoryItem("z3.reduce_bucket", "reduce bucket (IPG buffer)", "buffers", "gpu",
                                s.reduce_bucket_size * lp,
                                how=f"reduce_bucket_size {s.reduce_bucket_size:,} x {lp} B, allocated at initialize "
                                    "(contiguous_gradients)"))
        # comm/coalesced_collectives.py reduce_scatter_coalesced: torch.cat of the bucket's gradients, then
        # each rank's reduced partition
        filled = min(s.reduce_bucket_size, model.total_params)
        items.append(MemoryItem("z3.reduce_scatter_copy", "bucket flattened for reduce-scatter, and its output",
                                "buffers", "gpu", filled * lp + math.ceil(filled / world) * lp, "step",
                                how=f"min(reduce_bucket_size, all parameters) = {filled:,} x {lp} B, + 1/{world} "
                                    "of it (reduce_scatter_coalesced)"))
    layer = model.largest_layer_params
    items.append(MemoryItem("z3.gathered", "parameters gathered for the running module", "buffers", "gpu",
                            layer * lp, "step", how=f"largest module {layer:,} elements x {lp} B"))
    # partitioned_param_coordinator.py: prefetch up to min(max_live - available, prefetch_bucket_size); it
    # cannot prefetch more than the model's other non-persistent parameters
    persist_total = _persistent(model, s)[1] if model.params else 0
    others = max(0, model.total_params - persist_total - layer)
    prefetch = min(s.prefetch_bucket_size, max(0, s.max_live_parameters - layer), others)
    items.append(MemoryItem("z3.prefetch", "prefetched parameters", "buffers", "gpu", prefetch * lp, "step",
                            how=f"min(stage3_prefetch_bucket_size {s.prefetch_bucket_size:,}, "
                                f"stage3_max_live_parameters {s.max_live_parameters:,} - {layer:,}, the other "
                                f"{others:,} non-persistent) x {lp} B"))
    items.append(MemoryItem("z3.layer_grads", f"{lp_name} gradients of the module in backward", "gradients", "gpu",
                            layer * lp, "step", how=f"largest module {layer:,} elements x {lp} B, before reduction"))
    if run.whole_model_init:
        items += _whole_model_init(model, lp, "z3")
    return items, notes


def _whole_model_init(model: ModelShape, lp: int, prefix: str) -> list[MemoryItem]:
    built = model.total_params * _dtype_bytes(model.dtype)
    return [
        MemoryItem(f"{prefix}.init_host", "whole model built on the host before initialize", "parameters", "host",
                   built, "init", how=f"{model.total_params:,} x {_dtype_bytes(model.dtype)} B ({model.dtype}); "
                                      "no deepspeed.zero.Init"),
        MemoryItem(f"{prefix}.init_gpu", "whole model moved to the GPU before partitioning", "parameters", "gpu",
                   model.total_params * lp, "init",
                   how=f"{model.total_params:,} x {lp} B: engine.py _configure_distributed_model casts then "
                       "module.to(device) when the model was not built under zero.Init; freed after partitioning, "
                       "but the caching allocator keeps it reserved (nvidia-smi)"),
    ]


def zero12_items(model: ModelShape, s: ZeroSettings, run: RunShape) -> tuple[list[MemoryItem], list[str]]:
    world, lp, n_states = run.world_size, s.lp_bytes, s.optimizer_states
    align = 2 * world  # nccl_start_alignment_factor (2) x world: flatten_dense_tensors_aligned
    padded = math.ceil(model.total_params / align) * align
    part = padded // world
    offload = s.offload_optimizer != "none"
    opt_dev: Device = "host" if offload else "gpu"
    largest_param = max((p.numel for p in model.params), default=model.largest_layer_params)
    lp_name = "16-bit" if lp == 2 else "fp32"
    items = [
        MemoryItem("z12.params", f"{lp_name} parameters, whole (bit16_groups_flat)", "parameters", "gpu", padded * lp,
                   how=f"{model.total_params:,} padded to a multiple of {align} = {padded:,} x {lp} B"),
        MemoryItem("z12.fp32_masters", "fp32 master partition (single_partition_of_fp32_groups)", "fp32 masters",
                   opt_dev, part * FP32, pinned=offload and s.pin_optimizer, how=f"{padded:,}/{world} x 4 B"),
        MemoryItem("z12.optimizer_state", f"{s.optimizer} state ({n_states} fp32 tensor(s) per element)",
                   "optimizer state", opt_dev, part * FP32 * n_states, how=f"{part:,} x {n_states} x 4 B"),
    ]
    if offload:
        pin = s.pin_optimizer
        items += [
            MemoryItem("z12.fp32_grads", "fp32 gradient partition (single_partition_of_fp32_groups.grad)",
                       "gradients", "host", part * FP32, pinned=pin, how=f"{part:,} x 4 B"),
            MemoryItem("z12.lp_staging", f"{lp_name} partition for the update (param_buffer_of_bit16_for_cpu_offload)",
                       "buffers", "host", part * lp, pinned=pin, how=f"{part:,} x {lp} B"),
            MemoryItem("z12.temp_grad_host", "largest-parameter gradient buffer (temp_grad_buffer_for_cpu_offload)",
                       "buffers", "host", largest_param * lp, pinned=pin, how=f"{largest_param:,} x {lp} B"),
            MemoryItem("z12.temp_grad_gpu", "largest-parameter gradient buffer (temp_grad_buffer_for_gpu_offload)",
                       "buffers", "gpu", largest_param * lp, how=f"{largest_param:,} x {lp} B"),
        ]
    else:
        if s.stage == 2:
            items.append(MemoryItem("z12.grads", f"{lp_name} gradient partition (grads_in_partition)", "gradients",
                                    "gpu", part * lp, "step", how=f"{part:,} x {lp} B"))
        else:
            items.append(MemoryItem("z12.grads", f"{lp_name} gradients, whole (reduced at the boundary)", "gradients",
                                    "gpu", padded * lp, "step", how=f"{padded:,} x {lp} B"))
        items.append(MemoryItem("z12.fp32_grads", "fp32 gradient partition at the step", "gradients", "gpu",
                                part * FP32, "step", how=f"{part:,} x 4 B"))
    if s.stage == 2 and s.contiguous_gradients:
        items.append(MemoryItem("z12.reduce_bucket", "reduce bucket (IPG buffer)", "buffers", "gpu",
                                s.reduce_bucket_size * lp, "step",
                                how=f"reduce_bucket_size {s.reduce_bucket_size:,} x {lp} B"))
    if run.whole_model_init:
        items += _whole_model_init(model, lp, "z12")[:1]
    return items, []


def zero0_items(model: ModelShape, s: ZeroSettings, run: RunShape) -> tuple[list[MemoryItem], list[str]]:
    p, lp, n_states = model.total_params, s.lp_bytes, s.optimizer_states
    items = [
        MemoryItem("z0.params", "parameters" if lp == FP32 else "16-bit parameters (fp16_groups_flat)", "parameters",
                   "gpu", p * lp, how=f"{p:,} x {lp} B"),
        MemoryItem("z0.optimizer_state", f"{s.optimizer} state", "optimizer state", "gpu", p * FP32 * n_states,
                   how=f"{p:,} x {n_states} x 4 B"),
        MemoryItem("z0.grads", "gradients", "gradients", "gpu", p * lp, "step", how=f"{p:,} x {lp} B"),
    ]
    if lp != FP32:
        items += [
            MemoryItem("z0.fp32_masters", "fp32 masters (fp32_groups_flat)", "fp32 masters", "gpu", p * FP32,
                       how=f"{p:,} x 4 B"),
            MemoryItem("z0.fp32_grads", "fp32 flat gradient at the step", "gradients", "gpu", p * FP32, "step",
                       how=f"{p:,} x 4 B"),
        ]
    if run.whole_model_init:
        items += _whole_model_init(model, lp, "z0")[:1]
    return items, []


def zero_items(model: ModelShape, s: ZeroSettings, run: RunShape) -> tuple[list[MemoryItem], list[str]]:
    if s.stage == 3:
        return zero3_items(model, s, run)
    if s.stage in (1, 2):
        return zero12_items(model, s, run)
    return zero0_items(model, s, run)
