"""Resume a DeepSpeed ZeRO-1 or ZeRO-2 engine from a ZeRO-1/2 checkpoint saved at any world size.

``load_checkpoint_resharded(engine, path)`` hands a stage 1 or 2 engine to ``load_zero12_checkpoint``
here: ``engine.load_checkpoint(path)`` without the refusal DeepSpeed 0.16-0.19 gives at another
data-parallel size ("Automatic adjustment of ZeRO's optimizer state partitioning with a new world
size is not currently supported", ``engine._load_zero_checkpoint``) and without an offline reshard.

How: the checkpoint is described by its reader (``readers.zero12``: every parameter's fp32 master
and Adam moments as byte ranges of the rank files, no tensor bytes read). Each rank builds *its own*
flat partition of every param group as the engine laid it out at the current world size
(``round_robin_bit16_offsets``: parameters in flat order, their alignment padding, the tail padding
DeepSpeed adds to a multiple of ``2 * world``), reading only the byte ranges of the parameters that
fall into it. That partition goes to DeepSpeed's own loader for one rank's state, written as a
DeepSpeed save at this world size would hold it (``_load_legacy_checkpoint``'s rigid route: loss
scaler, torch's ``Optimizer.load_state_dict``, which casts the state to each partition's device,
then the fp32 copy), and the 16-bit weights are rebuilt from the loaded masters by DeepSpeed's
``update_lp_params`` (an all-gather of the partitions). Frozen parameters and buffers are read
whole (every rank holds them under ZeRO-1/2). A rank parses only the model-states file, rank 0's
optimizer file (which places every parameter in the source's partitions: ``readers.zero12.Zero12Layout``)
and the 1-3 files its partition overlaps, each checked against rank 0's; a rank that fails to read its
share stops every rank, with its message, before the engine is touched.

Run state follows ``load_checkpoint_resharded``: counters, LR scheduler, client state from the
model-states file; the param groups, ``step``, loss scaler and ``clip_grad`` from this rank's file
at the saved world size, from rank 0's at another (DeepSpeed keeps them equal on every rank); the
beta powers DeepSpeed's CPU Adam kernels keep outside the checkpoint are replayed
(``cpu_adam_kernel``: one flat tensor per param group, stepped group after group).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkit.checkpoint.model.checkpoint import FP32, TrainingCheckpoint
from shardkit.checkpoint.model.tensors import SourceTensor, read_slice
from shardkit.checkpoint.ops.cpu_adam_kernel import restore_cpu_adam_kernel_state
from shardkit.checkpoint.ops.resume_state import (
    Zero3LoadResult,
    engine_precision,
    fit_to_current_optimizer,
    loaded_result,
    restore_run_state,
    run_preflight,
    verify_manifest,
)
from shardkit.checkpoint.readers.zero12 import Zero12Layout, few, read_zero12, zero12_layout
from shardkit.checkpoint.readers.zero12_run_state import base_optimizer_state, model_states, optim_states
from shardkit.checkpoint.zero3.files import RANK_FILE, resolve_listed
from shardkit.checkpoint.zero3.layout import client_state_keys
from shardkit.checkpoint.zero12.files import MODEL_FILE, is_zero12_folder
from shardkit.core.errors import CheckpointError
from shardkit.placement.replace import replace_optimizer_state, summarize_moves
from shardkit.storage.listing import FolderListing
from shardkit.storage.verify import refuse_links_leaving

if TYPE_CHECKING:
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

#: Where each trainable parameter sits in the engine's flat buffer of one param group.
_Placed = tuple[str, int, int]  # (name, offset in the group's flat buffer, numel)


@dataclass(frozen=True)
class _Share:
    """This rank's partition of one param group: flat elements ``[start, start + size)``."""

    group: int
    start: int
    size: int
    padding: int
    """Tail padding inside this partition (``groups_padding``): cut from the fp32 slice DeepSpeed saves."""
    params: list[_Placed]


def is_zero12_engine(engine: Any) -> bool:
    """True for a DeepSpeed engine running ZeRO stage 1 or 2 (whatever its optimizer)."""
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None
    return stage in (1, 2)


def refuse_zero12_source(path: str | Path, stage: int) -> FolderListing:
    """Refuse a ZeRO-1/2 checkpoint given to an engine of ``stage`` (3), before anything is read; else the one
    listing of the tag folder ``path`` designates, for the resume to go on with."""
    tag_dir, listing = resolve_listed(path)
    if is_zero12_folder(tag_dir, listing):
        raise CheckpointError(
            f"{tag_dir}: a ZeRO-1/2 checkpoint (one {MODEL_FILE}, per-rank optimizer files), but this engine runs ZeRO "
            f"stage {stage}, whose partitions are per parameter. Nothing was loaded. Resume it with a ZeRO-1 or ZeRO-2 "
            "config (zero_optimization.stage), or convert it first: shardkit convert SRC --to zero3 -o OUT")
    return listing


def load_zero12_checkpoint(
    engine: "DeepSpeedEngine",
    path: str | Path,
    *,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_strict: bool = True,
    verify: bool = True,
    preflight: bool = True,
) -> Zero3LoadResult:
    """Load the ZeRO-1/2 checkpoint at ``path`` into the ZeRO-1/2 ``engine`` at the engine's world size.

    Collective: call on every rank. Same arguments and result as ``load_checkpoint_resharded`` (which calls
    this for stage 1/2 engines). Refused before the engine is touched: a ZeRO-3 checkpoint, DeepSpeed's
    BF16_Optimizer (ZeRO-1 + bf16 without offload), NVMe offload, and a model whose trainable parameters,
    param groups or shapes differ from the checkpoint's (the parameter named).
    """
    import torch.distributed as dist

    opt = _zero12_optimizer(engine)
    # the tag folder listed once, for every step below (at 1,024 ranks each listing is a metadata storm)
    tag_dir, listing = _tag_dir(path, engine)
    refuse_links_leaving(tag_dir, "load", listing)
    world = dist.get_world_size(group=opt.dp_process_group)
    rank = dist.get_rank(group=opt.dp_process_group)
    if verify:
        verify_manifest(tag_dir, world)
    precision = engine_precision(engine)
    failure: BaseException | None = None
    try:
        ckpt, module_values, model_sd, rank_sd = _read_share(engine, opt, listing, rank, world, load_module_strict)
    except Exception as exc:  # noqa: BLE001 - re-raised on this rank after every rank has said whether it failed
        failure = exc
    # each rank parses its own files: one that failed must stop all, or the others wait in update_lp_params
    _agree(engine, opt, tag_dir, failure)

    # --- from here on the engine is changed -------------------------------------------------------
    if engine._optimizer_has_ckpt_event_prologue():
        opt.checkpoint_event_prologue()
    if module_values:
        engine.module.load_state_dict(module_values, strict=False)
    restore_run_state(engine, model_sd, ckpt.world_size, load_lr_scheduler_states)

    state_list: list[Any] = [None] * world
    state_list[rank] = rank_sd
    # DeepSpeed's loader for one rank's state (rigid route): loss scaler and clip_grad, torch's
    # Optimizer.load_state_dict (casts the state to the partition's device), fp32 copy, hp links
    opt.load_state_dict(state_list, load_optimizer_states=load_optimizer_states, load_from_fp32_weights=True)
    del rank_sd, state_list
    # the 16-bit weights the next forward uses, from the masters just loaded (collective)
    opt.update_lp_params()
    # DeepSpeed's CPU Adam kernels keep beta**step outside the state: replayed, or the first step after the
    # resume differs from an uninterrupted run in the last bit (cpu_adam_kernel); [] for torch's optimizers
    kernels = restore_cpu_adam_kernel_state(opt.optimizer) if load_optimizer_states else []
    if engine._optimizer_has_ckpt_event_epilogue():
        opt.checkpoint_event_epilogue()

    result = loaded_result(opt, opt.single_partition_of_fp32_groups, tag_dir, ckpt.world_size or 0, world, model_sd,
                           kernels, _notes(ckpt, model_sd, engine, world, precision))
    # a client optimizer's param_group tensors stay where torch.load put them (load_checkpoint_resharded's reason)
    result.moves = replace_optimizer_state(engine.optimizer)
    if result.moves:
        result.notes.append(summarize_moves(result.moves))
    if preflight:
        result.placement_checked = run_preflight(engine)
    return result


def _read_share(engine: Any, opt: Any, listing: FolderListing, rank: int, world: int, strict: bool) -> tuple[
        TrainingCheckpoint, dict[str, "torch.Tensor"], dict[str, Any], dict[str, Any]]:
    """The checkpoint as this rank needs it, the module's frozen values, the model-states dict and this rank's
    optimizer dict at the engine's world size; nothing of the engine changed."""
    # the model-states file and rank 0's optimizer file place every parameter in the source's partitions; then
    # only the files holding this rank's partition are parsed: every file on every rank cost 0.75 ms x source
    # ranks per rank (1.9 s at 2,048) and ranks x ranks opens of a shared filesystem
    tag_dir = listing.folder
    head = read_zero12(tag_dir, ranks=(), listing=listing)
    shares = _engine_shares(engine, opt, head, rank, world)
    same_ranks = world == head.world_size  # the reader records it (one optimizer file per rank)
    needed = _source_ranks(zero12_layout(head), shares) | ({rank} if same_ranks else set())
    ckpt = read_zero12(tag_dir, ranks=needed, listing=listing) if needed - {0} else head
    module_values = _module_values(engine, ckpt, strict)
    model_sd = model_states(ckpt)
    optim_src = optim_states(ckpt, rank if same_ranks else 0)
    rank_sd = _rank_state(opt, ckpt, shares, optim_src, carry_scaler=ckpt.precision == engine_precision(engine))
    return ckpt, module_values, model_sd, rank_sd


def _source_ranks(layout: Zero12Layout, shares: list[_Share]) -> set[int]:
    """The source ranks whose files hold the parts of parameters in this rank's partitions."""
    needed: set[int] = set()
    for share in shares:
        end = share.start + share.size
        for name, offset, numel in share.params:
            lo, hi = max(share.start, offset), min(end, offset + numel)
            if lo < hi:
                needed.update(layout.ranks_holding(name, lo - offset, hi - offset))
    return needed


def _agree(engine: Any, opt: Any, tag_dir: Path, failure: BaseException | None) -> None:
    """Raise on every rank when any rank failed to read its share (its own error there, the first failing
    rank's message elsewhere): one flag summed, the messages gathered only when a rank failed."""
    import torch
    import torch.distributed as dist

    group = opt.dp_process_group
    flag = torch.tensor([0 if failure is None else 1], device=engine.device)
    dist.all_reduce(flag, group=group)
    if not int(flag.item()):
        return
    said: list[Any] = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(said, None if failure is None else f"{type(failure).__name__}: {failure}", group=group)
    if failure is not None:
        raise failure
    first = next(r for r, m in enumerate(said) if m is not None)
    raise CheckpointError(f"{tag_dir}: rank {first} of {len(said)} could not read its share of the checkpoint "
                          f"({int(flag.item())} rank(s) failed): {said[first]}. Nothing was loaded on any rank")


def _zero12_optimizer(engine: Any) -> Any:
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None
    opt = getattr(engine, "optimizer", None)
    if stage not in (1, 2):
        raise CheckpointError(f"load_zero12_checkpoint needs a ZeRO stage 1 or 2 engine; this engine runs stage {stage}. "
                              "Call shardkit.load_checkpoint_resharded, which picks the loader by the engine's stage")
    if not hasattr(opt, "single_partition_of_fp32_groups"):
        raise CheckpointError(
            f"the engine's optimizer is {type(opt).__name__}, not DeepSpeed's ZeRO-1/2 optimizer "
            "(DeepSpeedZeroOptimizer): DeepSpeed picks its BF16_Optimizer for ZeRO-1 with bf16 and no offload, whose "
            "flat groups shardkit does not fill. Resume with zero_optimization.stage 2 (same memory for the optimizer "
            "state), or convert the checkpoint with DeepSpeed's ds_to_universal and use checkpoint.load_universal")
    if not hasattr(opt, "round_robin_bit16_offsets"):
        import deepspeed

        raise CheckpointError(
            f"DeepSpeed {deepspeed.__version__}'s ZeRO-1/2 optimizer does not record where each parameter sits in its "
            "flat group (round_robin_bit16_offsets; 0.19.8 does), which the in-process resume places by. Install the "
            "release shardkit is tested with (pip install 'deepspeed==0.19.8'), or reshard offline: shardkit reshard "
            "SRC --world-size N, then engine.load_checkpoint")
    if getattr(opt, "swap_optimizer", False) or getattr(opt, "partial_offload", 0):
        raise CheckpointError(
            "zero_optimization.offload_optimizer: NVMe-swapped or partially offloaded optimizer state is not "
            "supported by the in-process ZeRO-1/2 resume. Resume with offload_optimizer 'cpu' or 'none'")
    if any(getattr(opt, "is_moe_param_group", []) or []):
        raise CheckpointError("the engine trains DeepSpeed MoE param groups (expert-parallel partitions), which the "
                              "ZeRO-1/2 resume does not place. Use engine.load_checkpoint at the saved world size")
    return opt


def _tag_dir(path: str | Path, engine: Any) -> tuple[Path, FolderListing]:
    tag_dir, listing = resolve_listed(path)
    if is_zero12_folder(tag_dir, listing):
        return tag_dir, listing
    stage = engine.zero_optimization_stage()
    if any(RANK_FILE.match(name) and name.endswith("_model_states.pt") for name in listing.names):
        # refused rather than read: the ZeRO-3 reader describes the same tensors, but the run state this resume
        # hands DeepSpeed (param groups, steps, loss scaler) is taken from a ZeRO-1/2 rank file
        raise CheckpointError(
            f"{tag_dir}: a ZeRO-3 checkpoint (per-rank zero_pp_rank_*_model_states.pt files), but this engine runs "
            f"ZeRO stage {stage}, whose optimizer keeps flat partitions of whole param groups. Nothing was loaded. "
            f"Convert it first: shardkit convert SRC --to zero{stage} -o OUT (then load OUT), or resume with "
            "zero_optimization.stage 3")
    raise CheckpointError(
        f"{tag_dir}: not a DeepSpeed ZeRO checkpoint (no {MODEL_FILE} beside per-rank optimizer files, no ZeRO-3 rank "
        f"files), and this engine runs ZeRO stage {stage}. Nothing was loaded. Pass the tag folder (or its parent with "
        "a latest file) that engine.save_checkpoint wrote; `shardkit inspect SRC` says what the folder holds")


def _engine_shares(engine: Any, opt: Any, ckpt: TrainingCheckpoint, rank: int, world: int) -> list[_Share]:
    """This rank's partition of each param group, each parameter matched by name to the checkpoint's."""
    saved_groups: list[dict[str, Any]] = ckpt.scalars.get("param_groups") or []
    if len(opt.round_robin_bit16_groups) != len(saved_groups):
        raise CheckpointError(
            f"{ckpt.folder}: the checkpoint has {len(saved_groups)} optimizer param group(s), this engine "
            f"{len(opt.round_robin_bit16_groups)}: the model's parameters are grouped differently (weight decay "
            "groups?). Build the optimizer's param groups as the saving run did")
    shares = []
    for g, (params, offsets) in enumerate(zip(opt.round_robin_bit16_groups, opt.round_robin_bit16_offsets)):
        saved = list(saved_groups[g]["params"])
        placed: list[_Placed] = []
        for p, offset in zip(params, offsets):
            name = engine.param_names.get(p)
            if name is None or name not in ckpt.weights:
                raise CheckpointError(
                    f"parameter {name or tuple(p.shape)} (param group {g}) is trained by this engine but not in the "
                    f"checkpoint {ckpt.folder} (its group {g} holds {few(saved, 3)}): not the same model. Nothing was "
                    "loaded; resume with the model that was saved")
            if name not in saved:
                raise CheckpointError(
                    f"parameter {name} is in param group {g} of this engine but not in group {g} of the checkpoint "
                    f"{ckpt.folder}, or is frozen there: the optimizer is built differently. Nothing was loaded")
            shape = ckpt.weights[name].shape
            if tuple(p.shape) != shape:
                raise CheckpointError(f"{ckpt.folder}: parameter {name} has shape {tuple(p.shape)} in the model but "
                                      f"{shape} in the checkpoint: not the same model. Nothing was loaded")
            placed.append((name, int(offset), math.prod(shape)))
        missing = sorted(set(saved) - {n for n, _, _ in placed})
        if missing:
            raise CheckpointError(
                f"parameter {missing[0]} is trained in param group {g} of the checkpoint {ckpt.folder} but not by this "
                f"engine ({len(missing)} such): the model is not the saved one, or it was frozen since. Nothing was loaded")
        size = int(opt.partition_size[g])
        if size * world != opt.bit16_groups_flat[g].numel() or opt.single_partition_of_fp32_groups[g].numel() != size:
            raise CheckpointError(f"param group {g}: the engine's flat buffer ({opt.bit16_groups_flat[g].numel()}) is not "
                                  f"{world} partitions of {size}: a ZeRO-1/2 layout shardkit does not know")
        shares.append(_Share(g, rank * size, size, int(opt.groups_padding[g]), placed))
    return shares


def _module_values(engine: Any, ckpt: TrainingCheckpoint, strict: bool) -> dict[str, "torch.Tensor"]:
    """The frozen parameters and persistent buffers the module needs from the checkpoint, read whole."""
    module = engine.module
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    wanted = [n for n in module.state_dict(keep_vars=True) if n not in trainable and n not in ckpt.aliases]
    kept = ckpt.frozen | ckpt.buffers
    if strict:
        missing = [n for n in wanted if n not in ckpt.weights]
        unexpected = sorted(kept - set(wanted) - trainable)
        if missing or unexpected:
            which = (f"{missing[0]} is in the model but not in the checkpoint" if missing
                     else f"{unexpected[0]} is in the checkpoint but not in the model")
            raise CheckpointError(f"{ckpt.folder}: frozen parameter or buffer {which}: not the same model. Nothing was "
                                  "loaded; pass load_module_strict=False to load what matches")
    out = {}
    for name in wanted:
        t = ckpt.weights.get(name)
        if t is not None and name not in trainable:
            out[name] = read_slice(t, 0, t.numel).reshape(t.shape)
    return out


def _rank_state(opt: Any, ckpt: TrainingCheckpoint, shares: list[_Share], src: dict[str, Any],
                carry_scaler: bool) -> dict[str, Any]:
    """This rank's optimizer dict as DeepSpeed saves it at the engine's world size (``state_dict()``)."""
    import torch

    src_base = base_optimizer_state(src)
    state: dict[int, dict[str, Any]] = {}
    fp32 = []
    for share in shares:
        saved = src_base["state"].get(src_base["param_groups"][share.group]["params"][0], {})
        entry: dict[str, Any] = {}
        for key, value in saved.items():
            described = all(key in ckpt.optimizer.get(n, {}) for n, _, _ in share.params)
            # partition-sized tensors (exp_avg, exp_avg_sq ...) are rebuilt for this rank, the rest kept (step)
            entry[key] = _flat(ckpt, share, key, value.dtype) if described and torch.is_tensor(value) else value
        state[share.group] = entry
        fp32.append(_flat(ckpt, share, FP32, torch.float32)[:share.size - share.padding])
    groups = [{**group, "params": [g]} for g, group in enumerate(src_base["param_groups"])]
    base = {"state": state, "param_groups": groups}
    fit_to_current_optimizer({"optimizer_state_dict": base}, opt)
    out: dict[str, Any] = {
        "clip_grad": src.get("clip_grad", opt.clip_grad),
        "base_optimizer_state": base,
        "single_partition_of_fp32_groups": fp32,
        "zero_stage": src.get("zero_stage"),
        "group_paddings": [s.padding for s in shares],
        "param_alignment_paddings": [list(p) for p in opt.round_robin_bit16_padding],
        "partition_count": list(opt.partition_count),
        "ds_version": src.get("ds_version"),
    }
    if carry_scaler:  # another precision keeps the engine's own scaler (a bf16 save's static 1 is no fp16 scale)
        out.update({k: src[k] for k in ("loss_scaler", "dynamic_loss_scale", "overflow") if k in src})
    return out


def _flat(ckpt: TrainingCheckpoint, share: _Share, key: str, dtype: "torch.dtype") -> "torch.Tensor":
    """``key`` (``FP32`` for the masters) of this rank's partition: the byte ranges of the parameters in it,
    zeros in the padding."""
    import torch

    out = torch.zeros(share.size, dtype=dtype)
    end = share.start + share.size
    for name, offset, numel in share.params:
        lo, hi = max(share.start, offset), min(end, offset + numel)
        if lo >= hi:
            continue
        source = ckpt.tensor(name, key)
        if source.load is None and _held(source, lo - offset, hi - offset) != hi - lo:
            # elements in a file this rank did not parse (_source_ranks missed it): named with the files parsed
            raise CheckpointError(f"{ckpt.folder}: elements [{lo - offset}, {hi - offset}) of {key} of {name} are not "
                                  f"all in the rank files this rank parsed ({ckpt.notes[0]}): an internal error; "
                                  "please report it with the folder's listing")
        out[lo - share.start:hi - share.start] = read_slice(source, lo - offset, hi - offset)
    return out


def _held(t: SourceTensor, lo: int, hi: int) -> int:
    return sum(max(0, min(hi, p.start + p.numel) - max(lo, p.start)) for p in t.pieces)


def _notes(ckpt: TrainingCheckpoint, model_sd: dict[str, Any], engine: Any, world: int, precision: str) -> list[str]:
    notes = []
    keys = client_state_keys(model_sd)
    if keys and world != ckpt.world_size:
        notes.append(f"client_state {keys} comes from the one model-states file for every one of the {world} rank(s) "
                     f"(saved at {ckpt.world_size}); per-rank values (data-loader positions, RNG) must be rebuilt "
                     "by the training script")
    if ckpt.precision != precision:
        notes.append(f"{ckpt.folder} was written by a {ckpt.precision} run, this engine runs {precision}: the fp32 "
                     f"masters and Adam moments were loaded as they are, the {precision} weights rebuilt from them, and "
                     "the engine keeps its own loss scaler")
    stage = engine.zero_optimization_stage()
    if ckpt.format != f"zero{stage}":
        notes.append(f"{ckpt.folder} was saved by a {ckpt.format} run, this engine runs ZeRO-{stage}: both keep the "
                     "same flat partitions of the optimizer state, so it was loaded as is")
    return notes
