"""Resume a DeepSpeed ZeRO-3 engine from a checkpoint saved at any world size and offload setting.

``load_checkpoint_resharded(engine, path)`` is ``engine.load_checkpoint(path)`` without its same-world-
size restriction and without an offline conversion: every rank reads, through the checkpoint model's
ZeRO-3 reader (``readers.zero3``: each tensor's byte ranges in the rank files), exactly the slices of
the fp32 masters and Adam moments its *current* partition needs (``ceil(numel / world)`` per
parameter, the engine's own sub-groups; ``resume_zero3_state``), and hands them to DeepSpeed's own
``_rigid_load_state_dict``. The fp32 partitions it writes into are the
ones the engine allocated for its current config, and the optimizer state is cast by torch's
``Optimizer.load_state_dict`` to each partition's device, so a checkpoint saved without
``offload_optimizer`` lands on the CPU when offload is now on, and the other way round.

The order follows ``DeepSpeedEngine.load_checkpoint`` (0.19.8): checkpoint prologue, module state
(buffers, frozen fragments), LR scheduler and counters, optimizer, the step state DeepSpeed's CPU
Adam kernels keep outside the checkpoint (``cpu_adam_kernel``), epilogue. Afterwards a client
optimizer's param_group tensors are re-placed (``replace_optimizer_state``) and the placement
preflight (``shardkit.preflight``) checks every tensor is where the config says.

Param groups and non-partition optimizer state come from each rank's own file at the saved world
size; at another, from rank 0's, with a ``PerRankValuesWarning`` naming what the saved ranks did
not share (``readers.zero3_rank_values.check_rank_values``).

For runs that keep DeepSpeed's own ``engine.load_checkpoint``, ``guard_plain_loads(engine)`` wraps
that one engine's method: a checkpoint whose optimizer files are named for another precision is
refused before DeepSpeed reads it, and so is a symlink leading out of the tag folder
(``check_files_match_engine``), and the CPU Adam kernel state is
replayed after every load (``restore_after_plain_load``; a ``KernelNotRestoredWarning`` where it
cannot be).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkit.checkpoint.ops import resume_zero12
from shardkit.checkpoint.ops.cpu_adam_kernel import KernelReplay, restore_cpu_adam_kernel_state
from shardkit.checkpoint.ops.resume_state import Zero3LoadResult, loaded_result, restore_run_state, verify_manifest
from shardkit.checkpoint.ops.resume_state import engine_precision as _engine_precision
from shardkit.checkpoint.ops.resume_state import fit_to_current_optimizer as _fit_to_current_optimizer
from shardkit.checkpoint.ops.resume_zero3_state import model_state_for_rank, optim_state_for_rank
from shardkit.checkpoint.readers.zero3 import describe_zero3
from shardkit.checkpoint.readers.zero3_open import open_zero3_layout
from shardkit.checkpoint.readers.zero3_rank_values import check_rank_values
from shardkit.checkpoint.zero3.checkpoint import Zero3Checkpoint
from shardkit.checkpoint.zero3.layout import partition_numel
from shardkit.checkpoint.zero3.repartition import TargetLayout, client_state_note, layout_from_names
from shardkit.core.deprecated import deprecated_alias
from shardkit.core.errors import CheckpointError
from shardkit.placement.preflight import preflight as placement_preflight
from shardkit.placement.replace import replace_optimizer_state, summarize_moves
from shardkit.storage.tags import LATEST_NAME, read_latest
from shardkit.storage.verify import precision_naming_problem, refuse_links_leaving

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

def load_checkpoint_resharded(
    engine: "DeepSpeedEngine",
    path: str | Path,
    *,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_strict: bool = True,
    verify: bool = True,
    preflight: bool = True,
) -> Zero3LoadResult:
    """Load the ZeRO-3 checkpoint at ``path`` into ``engine`` at the engine's world size and offload.

    A ZeRO-1 or ZeRO-2 engine is handed to ``resume_zero12.load_zero12_checkpoint`` (a ZeRO-1/2
    checkpoint saved at any world size, same arguments and result); a ZeRO-1/2 checkpoint given to a
    ZeRO-3 engine is refused before anything is loaded.

    Collective: call on every rank. ``path`` is the checkpoint folder (with ``latest``), a tag
    folder, or a rank file. With ``verify`` a shardkit manifest, when the checkpoint has one, is
    checked first (files present, sizes, digests with each rank hashing its share; engine), and
    every rank refuses a bad checkpoint with the same error. With ``preflight`` the placement
    check runs afterwards when shardkit.placement is available.
    """
    import torch.distributed as dist

    if resume_zero12.is_zero12_engine(engine):
        return resume_zero12.load_zero12_checkpoint(
            engine, path, load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_strict=load_module_strict, verify=verify, preflight=preflight)
    opt = _zero3_optimizer(engine)
    # the tag folder listed once, for every step below (at 1,024 ranks each listing is a metadata storm)
    listing = resume_zero12.refuse_zero12_source(path, 3)
    ckpt = open_zero3_layout(listing.folder, listing=listing)
    # a link out of the tag folder is never read through, manifest or not (verify names it too)
    refuse_links_leaving(ckpt.tag_dir, "load", listing)
    if verify:
        verify_manifest(ckpt.tag_dir, dist.get_world_size(group=opt.dp_process_group))
    precision_note = _precision_note(ckpt, engine)
    layout = engine_layout(engine, ckpt)
    rank = dist.get_rank(group=opt.dp_process_group)

    # each tensor's byte ranges in the rank files; lazy: a rank file is parsed when a slice this rank needs lies in it
    model = describe_zero3(ckpt, lazy=True)

    if engine._optimizer_has_ckpt_event_prologue():
        opt.checkpoint_event_prologue()

    model_sd = model_state_for_rank(ckpt, model, layout, rank)
    engine.load_module_state_dict(checkpoint=model_sd, strict=load_module_strict)
    restore_run_state(engine, model_sd, ckpt.world_size, load_lr_scheduler_states)

    # At the saved world size this rank reads its own file: a custom optimizer's param_groups and
    # non-partition state (Prodigy's D statistics, computed from this rank's partition) are its own.
    # At another there is no mapping of ranks: rank 0's, with a warning where the ranks disagreed.
    same_ranks = layout.world_size == ckpt.world_size
    rank_values_note = None if same_ranks else check_rank_values(ckpt, layout.world_size)
    rank_sd = optim_state_for_rank(ckpt, model, layout, rank)
    _fit_to_current_optimizer(rank_sd["optimizer_state_dict"], opt)
    state_list: list[Any] = [None] * layout.world_size
    state_list[rank] = rank_sd["optimizer_state_dict"]
    # DeepSpeed's own loader for one rank's state: loss scaler, torch Optimizer.load_state_dict
    # (casts state to each fp32 partition's device), fp32 copy, bit16 refresh, persistent params.
    opt.load_state_dict(state_list, load_optimizer_states=load_optimizer_states, load_from_fp32_weights=True)
    del rank_sd, state_list
    # DeepSpeed's CPU Adam kernels keep beta**step outside the optimizer state; without this the
    # first step after resume differs from an uninterrupted run in the last bit (see cpu_adam_kernel).
    kernels = restore_cpu_adam_kernel_state(engine) if load_optimizer_states else []

    if engine._optimizer_has_ckpt_event_epilogue():
        opt.checkpoint_event_epilogue()

    result = loaded_result(opt, opt.fp32_partitioned_groups_flat, ckpt.tag_dir, ckpt.world_size, layout.world_size,
                           model_sd, kernels, [client_state_note(ckpt.model_state, ckpt.world_size, layout.world_size),
                                               precision_note, rank_values_note])
    # DeepSpeed places the fp32 partitions and torch's load_state_dict their state, but a client
    # optimizer's param_group tensors (prodigy-plus-schedule-free's running_d_*) stay where
    # torch.load put them, the CPU: re-place them first, or the preflight below blocks a healthy
    # GPU run without offload over tensors the next step would use from the wrong device.
    result.moves = replace_optimizer_state(engine.optimizer)
    if result.moves:
        result.notes.append(summarize_moves(result.moves))
    if preflight:
        result.placement_checked = _run_preflight(engine)
    return result


# the name before it took ZeRO-1/2 engines too; warns on call, goes in the next release
load_zero3_checkpoint = deprecated_alias("load_zero3_checkpoint", "load_checkpoint_resharded", load_checkpoint_resharded)


def _zero3_optimizer(engine: Any) -> Any:
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None
    if stage != 3:
        raise CheckpointError(
            f"load_checkpoint_resharded reshards ZeRO partitions, and this engine runs stage {stage}: "
            "no ZeRO partitions to reshard (it takes ZeRO stages 1, 2 and 3). Use engine.load_checkpoint "
            "for an engine without ZeRO."
        )
    opt = engine.optimizer
    if getattr(opt, "swap_optimizer", False):
        raise CheckpointError(
            "zero_optimization.offload_optimizer.device is 'nvme': NVMe-swapped optimizer state is not supported "
            "by load_checkpoint_resharded. Resume with offload_optimizer 'cpu' or 'none', or reshard with "
            "`shardkit reshard` and use engine.load_checkpoint."
        )
    return opt


def engine_layout(engine: Any, ckpt: Zero3Checkpoint) -> TargetLayout:
    """The engine's own sub-groups and partition sizes, checked against the checkpoint's parameters."""
    import torch.distributed as dist

    opt = engine.optimizer
    world = dist.get_world_size(group=opt.dp_process_group)
    names, owners = [], []
    for j, group in enumerate(opt.fp16_groups):
        group_names = []
        for p in group:
            name = engine.param_names.get(p)
            if name is None:
                raise CheckpointError(
                    f"sub-group {j}: a parameter the optimizer trains (shape {tuple(getattr(p, 'ds_shape', p.shape))}, "
                    f"ds_id {getattr(p, 'ds_id', '?')}) has no name in engine.param_names, so it cannot be matched "
                    "to the checkpoint. It was added to the optimizer but is not a parameter of the engine's module "
                    "(engine.module.named_parameters()); register it on the model before deepspeed.initialize"
                )
            if p.partition_numel() != partition_numel(p.ds_numel, world):
                raise CheckpointError(
                    f"parameter {name}: the engine partitions {p.ds_numel} elements as {p.partition_numel()} per "
                    f"rank, not ceil(numel/{world}); unknown ZeRO-3 partitioning, cannot place the checkpoint"
                )
            group_names.append(name)
        names.append(group_names)
        owners.append(opt.sub_group_to_group_id[j])
    layout = layout_from_names(ckpt, world, names, owners)
    by_name = {s.name: s for s in ckpt.slots}
    for group in opt.fp16_groups:
        for p in group:
            name = engine.param_names[p]
            if tuple(p.ds_shape) != by_name[name].shape:
                raise CheckpointError(
                    f"{ckpt.tag_dir}: parameter {name} has shape {tuple(p.ds_shape)} in the model but "
                    f"{by_name[name].shape} in the checkpoint: not the same model"
                )
    for j, flat in enumerate(opt.fp32_partitioned_groups_flat):
        if flat.numel() != layout.sub_group_numel(j):
            raise CheckpointError(
                f"sub-group {j}: the engine's fp32 partition has {flat.numel()} elements, the planned layout "
                f"{layout.sub_group_numel(j)}; unknown ZeRO-3 layout"
            )
    return layout


def _run_preflight(engine: Any) -> bool:
    placement_preflight(engine)  # looked up here: tests/_ranks_real_optimizers patches this module's name
    return True


def _precision_note(ckpt: Zero3Checkpoint, engine: Any) -> str | None:
    """What ``load_checkpoint_resharded`` says when the checkpoint was written in another precision: it
    reads the fp32 masters whichever way the files are named, so this is a note, not a refusal."""
    now = _engine_precision(engine)
    if ckpt.precision == now:
        return None
    return (f"{ckpt.tag_dir} was written by a {ckpt.precision} run, this engine runs {now}: the fp32 masters and Adam "
            f"moments were loaded as they are and the {now} weights rebuilt from them (DeepSpeed's plain "
            "load_checkpoint would not find the files: they are named for the other precision)")


# --- DeepSpeed's plain load_checkpoint, guarded ---------------------------------------------------


def _tag_dir_deepspeed_loads(load_dir: str | Path, tag: str | None) -> Path | None:
    """The folder ``engine.load_checkpoint(load_dir, tag)`` reads: ``load_dir/tag``, or the tag
    its ``latest`` file names (DeepSpeed reads that file as is; None when there is none, and
    DeepSpeed then loads nothing)."""
    root = Path(load_dir)
    if tag is None:
        if not (root / LATEST_NAME).is_file():
            return None
        try:
            tag = read_latest(root)
        except CheckpointError:
            return None  # DeepSpeed reads it its own way; verify names what is wrong with it
        if tag is None:
            return None
    tag_dir = root / str(tag)
    return tag_dir if tag_dir.is_dir() else None


def check_files_match_engine(engine: "DeepSpeedEngine", load_dir: str | Path, tag: str | None = None) -> None:
    """Refuse, before DeepSpeed opens anything, a ZeRO checkpoint whose optimizer files are named for
    another precision than ``engine`` runs (``verify.precision_naming_problem``: DeepSpeed 0.19.8's
    ``load_checkpoint`` would stop with ``FileNotFoundError`` deep inside the load, with no word
    about the config), naming the key, both values and the fix; and one holding a symlink that
    leads out of its folder (``verify.refuse_links_leaving``)."""
    tag_dir = _tag_dir_deepspeed_loads(load_dir, tag)
    if tag_dir is None:
        return
    # DeepSpeed opens the rank files by name and follows any link: one leading out of the folder is
    # refused here, before it is read
    refuse_links_leaving(tag_dir, "load")
    problem = precision_naming_problem(tag_dir, bool(engine.bfloat16_enabled()))
    if problem is not None:
        message, fix = problem
        raise CheckpointError(f"{message}. Fix: {fix}")


class KernelNotRestoredWarning(UserWarning):
    """A plain ``load_checkpoint`` was followed, but DeepSpeed's CPU Adam kernel state could not be
    replayed: the next step may differ from an uninterrupted run in the last bit."""


def guard_plain_loads(engine: "DeepSpeedEngine") -> "DeepSpeedEngine":
    """Make every later ``engine.load_checkpoint(...)`` on this engine safe to resume from as is.

    Before DeepSpeed reads anything, a checkpoint whose optimizer files are named for another
    precision is refused with the fix (``check_files_match_engine``). After a load that restored
    optimizer state, the beta powers DeepSpeed's CPU Adam kernels keep outside every checkpoint are
    replayed (``restore_cpu_adam_kernel_state``), so the continuation is bit-exact with no call by
    hand; ``engine.shardkit_kernel_replays`` holds what was replayed. Where that cannot be done
    (ZeRO stage 1/2, NVMe-swapped optimizer state) a ``KernelNotRestoredWarning`` says so and what
    to do. Returns the engine; a second call does nothing. Only this engine object is changed
    (its ``load_checkpoint`` attribute), never DeepSpeed's class."""
    if getattr(engine, "_shardkit_guarded_loads", False):
        return engine
    original = engine.load_checkpoint
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        check_files_match_engine(engine, given["load_dir"], given.get("tag"))
        loaded = original(*args, **kwargs)
        path = loaded[0] if isinstance(loaded, tuple) else loaded
        optimizer_loaded = given.get("load_optimizer_states", True) and not given.get("load_module_only", False)
        if path is not None and optimizer_loaded:
            engine.shardkit_kernel_replays = restore_after_plain_load(engine)  # type: ignore[attr-defined]
        return loaded

    engine.load_checkpoint = load_checkpoint  # type: ignore[method-assign]
    engine._shardkit_guarded_loads = True  # type: ignore[attr-defined]
    return engine


def restore_after_plain_load(engine: Any) -> list[KernelReplay]:
    """``restore_cpu_adam_kernel_state(engine)`` after DeepSpeed's own load, or a
    ``KernelNotRestoredWarning`` naming why it cannot run and what to do instead."""
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None
    why = None
    if stage != 3 and not _steps_on_a_cpu_adam_kernel(engine):
        return []  # torch's optimizers and the CUDA FusedAdam keep no step state outside the checkpoint
    if stage != 3:
        why = (f"the engine runs ZeRO stage {stage}, whose CPU Adam call order shardkit does not replay; if its "
               "optimizer steps one tensor per param group, call shardkit.restore_cpu_adam_kernel_state("
               "engine.optimizer.optimizer) after the load")
    elif getattr(engine.optimizer, "swap_optimizer", False):
        why = ("zero_optimization.offload_optimizer.device is 'nvme': the optimizer state (and its step) is swapped "
               "out, so the step to replay is not in memory; resume with offload_optimizer 'cpu' for a bit-exact "
               "continuation")
    if why is not None:
        warnings.warn(f"DeepSpeed's CPU Adam kernel state (beta**step, kept outside the checkpoint) was not restored "
                      f"after load_checkpoint: {why}. Without it the first step after the resume can differ from an "
                      "uninterrupted run in the last bit of about half the fp32 masters", KernelNotRestoredWarning,
                      stacklevel=3)
        return []
    return restore_cpu_adam_kernel_state(engine)


def _steps_on_a_cpu_adam_kernel(engine: Any) -> bool:
    """Whether the engine's optimizer is one of DeepSpeed's CPU Adam kernels (``DeepSpeedCPUAdam``,
    or ``FusedAdam`` on the CPU accelerator): only those keep beta powers outside the checkpoint, so
    only they deserve the warning at a stage whose replay shardkit does not do."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    opt = getattr(engine, "optimizer", None)
    inner = getattr(opt, "optimizer", opt)  # ZeRO-1/2 wrap the torch-style optimizer; stage 0 does not
    if isinstance(inner, DeepSpeedCPUAdam):
        return True
    return isinstance(inner, FusedAdam) and get_accelerator().device_name() == "cpu"
