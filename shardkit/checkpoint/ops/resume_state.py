"""What the in-process resumes share (``resume_zero3`` for ZeRO-3 engines, ``resume_zero12`` for ZeRO-1/2
ones): the manifest check before anything is read, the run state ``DeepSpeedEngine.load_checkpoint`` restores
beside the tensors, fitting saved optimizer state to the optimizer the engine has now, the result they return
and the placement check they run afterwards.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from shardkit.checkpoint.ops.cpu_adam_kernel import KernelReplay
from shardkit.checkpoint.zero3.layout import DEEPSPEED_MODEL_KEYS
from shardkit.placement.preflight import preflight as placement_preflight
from shardkit.placement.replace import Move
from shardkit.storage.manifest import MANIFEST_NAME
from shardkit.storage.verify import check_resumable_distributed


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


def verify_manifest(tag_dir: Path, world_size: int) -> None:
    """Check the shardkit manifest of ``tag_dir``, where it has one. Collective: the manifest test gives the same
    answer on every rank (one shared filesystem), so either all ranks enter the check or none does; each rank
    hashes files[rank::world], so a corrupted file of the right size is refused by every rank with the same
    message, and the N ranks read the checkpoint once between them."""
    if (tag_dir / MANIFEST_NAME).is_file():
        check_resumable_distributed(tag_dir, world_size=world_size, engine="deepspeed", allow_reshard=True)


def restore_run_state(engine: Any, model_sd: dict[str, Any], saved_world: int | None, load_lr_scheduler: bool) -> None:
    """What ``DeepSpeedEngine.load_checkpoint`` restores from the model-states dict beside the tensors: the saved
    world sizes, the LR scheduler (with ``load_lr_scheduler``) and the step counters."""
    engine.loaded_checkpoint_dp_world_size = saved_world
    engine.loaded_checkpoint_mp_world_size = model_sd.get("mp_world_size", 1)
    if load_lr_scheduler and engine.lr_scheduler is not None and model_sd.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(model_sd["lr_scheduler"])
    engine.global_steps = model_sd["global_steps"]
    engine.global_samples = model_sd.get("global_samples", engine.global_steps * engine.train_batch_size())
    engine.skipped_steps = model_sd["skipped_steps"]


def loaded_result(opt: Any, flats: list[Any], tag_dir: Path, saved_world: int, world: int, model_sd: dict[str, Any],
                  kernels: list[KernelReplay], notes: Iterable[str | None]) -> Zero3LoadResult:
    """What a resume did on this rank, before the re-placement and the preflight: the client state, where the
    fp32 partitions ``flats`` and their optimizer state are now, the kernels replayed, the ``notes`` given."""
    return Zero3LoadResult(
        path=tag_dir, tag=tag_dir.name, saved_world_size=saved_world, world_size=world,
        client_state={k: v for k, v in model_sd.items() if k not in DEEPSPEED_MODEL_KEYS},
        fp32_devices=[str(f.device) for f in flats],
        state_devices=sorted({str(v.device) for f in flats for v in opt.optimizer.state.get(f, {}).values()
                              if hasattr(v, "device")}),
        kernel_replays=kernels, notes=[n for n in notes if n])


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
