"""What FSDP2 (``torch.distributed.fsdp.fully_shard``) allocates per rank, item by item.

From torch's ``_fsdp_param.py``/``_fsdp_param_group.py``: each parameter is sharded on dim 0 into
``ceil(dim0 / world)`` rows per rank (padded), kept in the model's dtype (mixed precision only changes the
all-gather and compute dtype); gradients are sharded the same way; the optimizer's state follows the
sharded parameters (CPU with ``CPUOffloadPolicy``), and torch's default AdamW keeps each ``step`` as a
CPU scalar. In forward and backward one unit (a wrapped module) is gathered whole, the next one is
prefetched, and the root's own parameters stay gathered until backward.
"""

from __future__ import annotations

import math

from shardkit.estimate.model import ModelShape
from shardkit.estimate.report import Device, MemoryItem, RunShape
from shardkit.estimate.settings import FSDPSettings


def _dtype_bytes(dtype: str) -> int:
    return 2 if dtype in ("bfloat16", "float16", "bf16", "fp16", "half") else 4


def sharded_elements(model: ModelShape, world: int) -> int:
    """Elements one rank holds: ceil(dim0 / world) rows of each parameter (FSDP2 pads the last rank's)."""
    if not model.params:
        return math.ceil(model.total_params / world)
    return sum(math.ceil(p.dim0 / world) * (p.numel // p.dim0 if p.dim0 else 0) for p in model.params)


def fsdp_compute_bytes(model: ModelShape, s: FSDPSettings) -> int:
    return 2 if s.mixed_precision in ("bf16", "fp16") else _dtype_bytes(model.dtype)


def fsdp2_items(model: ModelShape, s: FSDPSettings, run: RunShape) -> tuple[list[MemoryItem], list[str]]:
    world = run.world_size
    shard = sharded_elements(model, world)
    d = _dtype_bytes(model.dtype)
    c = fsdp_compute_bytes(model, s)
    reduce_bytes = 4 if s.mixed_precision in ("bf16", "fp16") else d  # shardkit's policy reduces in fp32
    dev: Device = "host" if s.cpu_offload else "gpu"
    pin = s.cpu_offload and s.pin_memory
    n_states = s.optimizer_states
    n_tensors = len(model.params)
    unit = model.largest_unit_params()
    root = model.root_params()
    where = "cpu_offload" if s.cpu_offload else "on the GPU"
    items = [
        MemoryItem("fsdp.params", f"sharded parameters ({model.dtype}; the masters)", "parameters", dev, shard * d,
                   pinned=pin, how=f"sum of ceil(dim0/{world}) rows = {shard:,} elements x {d} B, {where}"),
        MemoryItem("fsdp.optimizer_state", f"{s.optimizer} state ({n_states} tensor(s) per element)",
                   "optimizer state", dev, shard * d * n_states, how=f"{shard:,} x {n_states} x {d} B"),
        MemoryItem("fsdp.grads", "sharded gradients", "gradients", dev, shard * d, "step", pinned=pin,
                   how=f"{shard:,} x {d} B, from backward until zero_grad(set_to_none=True)"),
    ]
    if n_tensors:
        items.append(MemoryItem("fsdp.step", "optimizer step counters (CPU scalars)", "optimizer state", "host",
                                n_tensors * 4, how=f"{n_tensors} parameters x 4 B (torch keeps step on the CPU "
                                                   "unless fused/capturable)"))
    # torch.optim.AdamW's default implementation: foreach on accelerator tensors, whose step makes one
    # temporary the size of every shard (sqrt(exp_avg_sq)); the for-loop one on CPU tensors, one parameter's worth
    largest_shard = max((math.ceil(p.dim0 / world) * (p.numel // p.dim0 if p.dim0 else 0) for p in model.params),
                        default=shard)
    temp = largest_shard if s.cpu_offload else shard
    items.append(MemoryItem("fsdp.adam_temp", "AdamW step temporaries (sqrt of exp_avg_sq)", "optimizer state", dev,
                            temp * d, "step",
                            how=f"{temp:,} x {d} B: {'for-loop (CPU) implementation: the largest shard' if s.cpu_offload else 'foreach implementation: every shard at once'}"))
    if s.reshard_after_forward:
        gathered, how = root + 2 * unit, f"(root {root:,} + 2 x largest unit {unit:,}) x {c} B: one unit and the next"
    else:
        gathered, how = model.total_params, f"all {model.total_params:,} elements x {c} B: reshard_after_forward false"
    items += [
        MemoryItem("fsdp.gathered", "parameters gathered for compute", "buffers", "gpu", gathered * c, "step",
                   how=how),
        MemoryItem("fsdp.unsharded_grads", "unsharded gradients of one unit before reduce-scatter", "buffers", "gpu",
                   max(unit, root) * (c + reduce_bytes if reduce_bytes != c else c), "step",
                   how=f"largest unit (the root's own {root:,} or a wrapped {unit:,}) x "
                       + (f"({c} B computed + {reduce_bytes} B reduced)" if reduce_bytes != c else f"{c} B")),
    ]
    if s.cpu_offload:
        items.append(MemoryItem("fsdp.offload_copy", "one unit's shard copied to the GPU for the all-gather",
                                "buffers", "gpu", math.ceil(unit / world) * d, "step",
                                how=f"{unit:,}/{world} x {d} B"))
    if run.whole_model_init:
        items.append(MemoryItem("fsdp.init_host", "whole model built on the host before fully_shard", "parameters",
                                "host", model.total_params * d, "init", how=f"{model.total_params:,} x {d} B"))
        if not s.cpu_offload:
            items.append(MemoryItem("fsdp.init_gpu", "whole model moved to the GPU before fully_shard", "parameters",
                                    "gpu", model.total_params * d, "init", how=f"{model.total_params:,} x {d} B"))
        items.append(MemoryItem("fsdp.init_shards", "shards copied out while the whole parameters still exist",
                                "parameters", "host" if s.cpu_offload else "gpu", shard * d, "init",
                                how=f"{shard:,} x {d} B, in fully_shard"))
    notes = [] if model.params else ["FSDP2 units unknown (parameter count only): the gathered unit is estimated "
                                     "from hidden/intermediate sizes when given, else not counted"]
    return items, notes
