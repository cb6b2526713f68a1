"""What the in-process resumes share (``resume_zero3`` for ZeRO-3 engines, ``resume_zero12`` for ZeRO-1/2
ones): the result they return, fitting saved optimizer state to the optimizer the engine has now, and the
placement check they run afterwards.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardkit.checkpoint.ops.cpu_adam_kernel import KernelReplay
from shardkit.placement.preflight import preflight as placement_preflight
from shardkit.placement.replace import Move


@dataclass
class Zero3LoadResult:
    """What ``load_checkpoint_resharded`` did on this rank."""

    path: Path
    """The tag folder that was read."""
    tag: str
    saved_world_size: int
    world_size: int
    client_state: dict[str, Any] = field(default_factory=dict)
    """Entries of the checkpoint that are not DeepSpeed's own (``layout.DEEPSPEED_MODEL_KEYS``): the
    ``client_state`` the training script saved. (DeepSpeed's ``load_checkpoint`` also hands back
    some of its own entries, ds_config, param_shapes ..., as client state; they are left out here.)"""
    fp32_devices: list[str] = field(default_factory=list)
    """Device of each fp32 partition (sub-group) after loading."""
    state_devices: list[str] = field(default_factory=list)
    """Devices of the optimizer state tensors after loading."""
    kernel_replays: list[KernelReplay] = field(default_factory=list)
    """CPU Adam kernels whose hidden beta powers were brought to the loaded step."""
    moves: list[Move] = field(default_factory=list)
    """Optimizer tensors ``replace_optimizer_state`` moved next to their partition after the load
    (a client optimizer's param_group tensors), before the placement preflight ran."""
    placement_checked: bool = False
    """True when shardkit's placement preflight ran (and passed)."""
    notes: list[str] = field(default_factory=list)
    """Things the user should know (client_state taken from rank 0 at another world size ...)."""


def fit_to_current_optimizer(osd: dict[str, Any], opt: Any) -> None:
    """Make the saved inner-optimizer state fit the optimizer the engine has *now*.

    Toggling ``offload_optimizer`` swaps the optimizer class (DeepSpeedCPUAdam <-> FusedAdam, or
    torch.optim.AdamW with ``torch_adam``): keys only the current class has are kept from its
    param groups (saved hyperparameters still win), and ``step`` takes the type that class expects
    (an int for DeepSpeed's Adam kernels, a float32 tensor for torch's optimizers, which place it by
    torch's own fused/capturable rule).
    """
    import torch

    inner = opt.optimizer
    current_groups = inner.param_groups
    saved = osd["optimizer_state_dict"]
    for g, group in enumerate(saved["param_groups"]):
        if g < len(current_groups):
            merged = {k: copy.copy(v) for k, v in current_groups[g].items() if k != "params"}
            merged.update(group)
            saved["param_groups"][g] = merged
    torch_optimizer = type(inner).__module__.startswith("torch.optim")
    for entry in saved["state"].values():
        step = entry.get("step")
        if step is None:
            continue
        if torch_optimizer and not torch.is_tensor(step):
            entry["step"] = torch.tensor(float(step), dtype=torch.float32)
        elif not torch_optimizer and torch.is_tensor(step):
            entry["step"] = int(step.item())


def run_preflight(engine: Any) -> bool:
    """shardkit's placement preflight on ``engine`` (raises on a misplaced tensor); True when it ran."""
    placement_preflight(engine)
    return True


def engine_precision(engine: Any) -> str:
    """'bf16', 'fp16' or 'fp32': what ``engine`` trains in."""
    return "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
