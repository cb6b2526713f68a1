"""DeepSpeed ZeRO-3 -> a DCP checkpoint shardkit's FSDP2 resume (``load_fsdp_checkpoint``) loads at
any world size, with or without CPU offload, optimizer state included.

What is written is what ``save_fsdp_checkpoint`` writes: ``dcp.save({"model": model_sd, "optim":
optim_sd})`` with the keys ``get_state_dict`` produces (``model.<fqn>``, ``optim.state.<fqn>.
{step,exp_avg,exp_avg_sq}``, ``optim.param_groups.<i>.<key>``) inside ``atomic_checkpoint(engine=
"fsdp2")``. The tensors are plain, unsharded ones written by one process (``no_dist=True``): DCP
records each as one chunk, and ``dcp.load`` into a run's DTensor shards reads just the slice each
rank owns, so any world size loads it (checked at 1 and 3 ranks in tests/test_convert_zero3_to_fsdp.py).

Values: the model state holds the fp32 *masters* (not the bf16/fp16 module weights), bit for bit;
``exp_avg``/``exp_avg_sq`` bit for bit; ``step`` (per ZeRO-3 sub-group) as torch's float32 scalar;
each ZeRO-3 param group becomes one torch param group with its ``lr``/``betas``/``eps``/
``weight_decay`` and ``decoupled_weight_decay`` (DeepSpeed's ``Adam`` is AdamW unless
``adam_w_mode: false``, runtime/engine.py ``_configure_basic_optimizer``).

Speed and memory: torch's writer ``torch.save``s every tensor from memory, so each would first be
gathered from the rank partitions. Here every big tensor (masters, moments, frozen parameters, tied
aliases) is written by ``stream.stream_save`` into its own ``.distcp`` file as a ``_ShapedLazyTensor``
whose record is the parameter's byte ranges in the rank optim files, padding left out: copied
through one 1 MiB buffer per thread, crc'd for the zip and sha256'd for the manifest as written,
fsynced by the thread that wrote it, several files at once (``_TensorFiles``: ``stream.write_parallel``
started before ``dcp.save``, so its ~0.9 s import overlaps the copying). ``dcp.save`` still plans and writes
``.metadata`` (``FileSystemWriter.finish``); ``_streaming_writer`` only answers each tensor item
with its file (offset 0, whole file) and writes the small items (param-group values, ``step``,
buffers) with torch's own ``_write_item``. ``dcp.load``, shardkit's restricted reader and
``dcp_slices`` read the result like any DCP checkpoint (tested). Measured on the 162M benchmark
checkpoint (1.95 GB, 2 ranks, bf16): see the README's convert section.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, SupportsIndex

from shardkit.checkpoint.io.atomic import LATEST_NAME, check_tag, disk_full_named, os_errors_named
from shardkit.checkpoint.io.manifest import FileEntry
from shardkit.checkpoint.io.pipeline import (
    check_output_root,
    default_workers,
    source_tag_as_new_tag,
    verify_before_reading,
    warn_unverified,
)
from shardkit.checkpoint.io.staged_save import atomic_checkpoint
from shardkit.checkpoint.io.stream import FileJob, LazyTensor, Segment, WrittenFile, stream_save, write_parallel
from shardkit.checkpoint.io.torch_load import safe_torch_load
from shardkit.checkpoint.ops.convert.names import (
    ADAM_STATE_KEYS,
    ADAM_TYPES,
    MODEL_KEY,
    OPTIM_KEY,
    NameMap,
    Uncarried,
    build_name_map,
    dcp_model_key,
    dcp_optim_key,
    not_carried_lines,
    refuse_if_any,
)
from shardkit.checkpoint.ops.convert.result import ConvertResult
from shardkit.checkpoint.zero3.layout import client_state_keys
from shardkit.checkpoint.zero3.reader import (
    FP32,
    ParamSlot,
    RankPartitions,
    Zero3Checkpoint,
    open_zero3_checkpoint,
    resolve_tag_dir,
)
from shardkit.config.loading import config_digest

if TYPE_CHECKING:
    import torch

_GROUP_KEYS_WITHOUT_TORCH_MEANING = {
    "step": "the optimizer's group-level step counter (FusedAdam/CPUAdam); torch keeps step per parameter, "
            "carried from the sub-group state",
    "bias_correction": "True is torch Adam's only behaviour",
}
# Param-group keys of non-Adam DeepSpeed optimizers: a client optimizer with these is not Adam even
# when its state keys look like it (FusedLamb keeps exp_avg/exp_avg_sq too).
_NON_ADAM_GROUP_KEYS = ("max_coeff", "min_coeff", "max_grad_norm", "freeze_step", "cuda_aware", "comm_backend_name")


@dataclass
class _Plan:
    """Everything decided before a byte is written."""

    names: NameMap
    groups: list[dict[str, Any]]
    """torch param groups (``params``: FQNs)."""
    steps: list[float]
    """``step`` of each ZeRO-3 sub-group."""
    uncarried: list[Uncarried] = field(default_factory=list)
    carried: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    user: dict[str, Any] = field(default_factory=dict)
    """JSON client state -> manifest ``extra.user`` (what ``load_fsdp_checkpoint`` hands back)."""
    deepspeed: dict[str, Any] = field(default_factory=dict)
    """DeepSpeed facts with no FSDP2 slot, kept in manifest ``extra.converted_from``."""


@os_errors_named("converting the checkpoint")
def convert_zero3_to_dcp(
    source: str | Path,
    output: str | Path,
    *,
    tag: str | None = None,
    force: bool = False,
    verify: bool = True,
    warn: Callable[[str], None] | None = None,
    adam_w_mode: bool | None = None,
) -> ConvertResult:
    """Write the ZeRO-3 checkpoint ``source`` (root or tag folder) as a DCP checkpoint under
    ``output/<tag>`` + ``output/latest`` for ``load_fsdp_checkpoint``.

    The source is checked against its manifest first (sha256 unless ``verify=False``); ``output``
    follows reshard's rules (new, empty or a shardkit checkpoint folder; an existing tag only with
    ``force``). What cannot be carried is refused (CheckpointError naming each item) or listed in
    ``ConvertResult.not_carried``. ``adam_w_mode`` decides decoupled weight decay for a client
    optimizer the checkpoint does not name (only needed when a group's weight_decay is not 0).
    """
    warn = warn or warn_unverified
    source_dir, source_tag = resolve_tag_dir(source)
    refuse_if_any(_layout_refusals(source_dir), source_dir, "fsdp2")
    tag = check_tag(tag) if tag is not None else source_tag_as_new_tag(source, source_dir, source_tag)
    root = Path(output)
    check_output_root(root, tag, source_dir, force=force)
    checked = verify_before_reading(source_dir, checksums=verify)
    for note in checked.warnings:
        warn(note)
    ckpt = open_zero3_checkpoint(source_dir)
    optim0 = safe_torch_load(ckpt.optim_files[0], mmap=True)["optimizer_state_dict"]
    plan = _plan(ckpt, optim0, adam_w_mode)
    refuse_if_any(plan.uncarried, ckpt.tag_dir, "fsdp2")

    extra = {"format": "torch.distributed.checkpoint", "keys": [MODEL_KEY, OPTIM_KEY], "user": plan.user,
             "converted_from": {"engine": "deepspeed", "zero_stage": 3, "path": str(ckpt.tag_dir),
                                "world_size": ckpt.world_size, "ds_version": ckpt.ds_version,
                                "precision": ckpt.precision, "verified": checked.level,
                                # which model keys are buffers: a frozen parameter written by one
                                # process looks like a buffer otherwise (--to zero3 reads this)
                                "buffer_names": [plan.names.fsdp_name(b) for b in ckpt.buffers()],
                                **plan.deepspeed}}
    step = ckpt.model_state.get("global_steps")
    outcome = f"nothing written: the staging folder was removed, {root / LATEST_NAME} is unchanged"
    with ExitStack() as stack:
        parts = [stack.enter_context(ckpt.open_rank(r)) for r in range(ckpt.world_size)]
        state, lazy = _state_template(ckpt, plan, parts)
        # world_size=1: one process wrote it (one chunk per tensor); loading at N ranks is a reshard
        with atomic_checkpoint(root, tag, engine="fsdp2", world_size=1, step=step, dtype="float32",
                               config_digest=config_digest(ckpt.ds_config or None), extra=extra) as save:
            # the tensor files are written from here on, while the main thread imports DCP (~0.9 s)
            # and plans; dcp.save's writer then only waits for them
            with _TensorFiles(save.path, lazy, outcome) as files:
                import torch.distributed.checkpoint as dcp
                from torch.distributed.checkpoint.api import CheckpointException

                try:
                    with warnings.catch_warnings():
                        # no_dist=True is the intent here (one offline writer), not a missing process group
                        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                        dcp.save(state, storage_writer=_streaming_writer(save.path, files), no_dist=True)
                except CheckpointException as exc:
                    # DCP wraps every failure in a BaseException: raise the failure itself (a full disk
                    # is already the CheckpointError naming the file), so atomic_checkpoint sees it,
                    # removes the staging folder and leaves 'latest' alone
                    failure = next(iter(exc.failures.values()), (None, None))[0]
                    if isinstance(failure, Exception):
                        raise failure from None
                    raise
                save.known_files = files.entries()  # .metadata is hashed by atomic_checkpoint
    final = root / tag
    return ConvertResult(
        output=root, tag=tag, source_engine="zero3", target_engine="fsdp2", world_size=ckpt.world_size,
        source_world_size=ckpt.world_size, params=len(ckpt.slots) + len(ckpt.frozen_param_shapes),
        bytes=sum(f.stat().st_size for f in final.iterdir() if f.is_file()),
        carried=plan.carried, not_carried=not_carried_lines(plan.uncarried), notes=plan.notes,
        verified=checked.level,
    )


# --- refusals and reports ----------------------------------------------------------------------


def _layout_refusals(tag_dir: Path) -> list[Uncarried]:
    """Tensor-parallel and MoE checkpoints, told apart by their file names (nothing unpickled yet)."""
    names = sorted(f.name for f in tag_dir.iterdir())
    out = []
    tp = [n for n in names if "_mp_rank_" in n and "_mp_rank_00_" not in n]
    if tp:
        out.append(Uncarried("mp_world_size", f"files {tp[:3]}", "this is a tensor/model-parallel checkpoint (mp_rank "
                             "> 0 files): its partitions are split along model dimensions, which neither FSDP2 "
                             "resume nor this converter reassembles", "convert it with DeepSpeed's ds_to_universal "
                             "first, or save from a data-parallel-only run", refused=True))
    moe = [n for n in names if n.startswith("expp_rank_") or ("_expert_" in n and n.endswith("_model_states.pt"))]
    if moe:
        out.append(Uncarried("moe.experts", f"files {moe[:3]}", "MoE expert parameters and their optimizer state are "
                             "saved per expert outside the ZeRO-3 partitions and are not converted", "load the "
                             "checkpoint with DeepSpeed (same world size), or use shardkit reshard for the "
                             "ZeRO-3 part", refused=True))
    return out


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _optimizer_checks(ckpt: Zero3Checkpoint, plan: _Plan) -> None:
    cfg = ckpt.ds_config.get("optimizer") or {}
    kind = str(cfg.get("type") or "")
    if kind and kind.lower() not in ADAM_TYPES:
        plan.uncarried.append(Uncarried("optimizer.type", repr(kind), "only Adam/AdamW state (exp_avg, exp_avg_sq, "
                                        "step) means the same to FSDP2's torch.optim.AdamW", "train with "
                                        "optimizer.type Adam or AdamW, or resume with DeepSpeed", refused=True))
        return
    keys = set(ckpt.state_keys)
    if keys != set(ADAM_STATE_KEYS):
        seen = sorted(keys) or "none (the optimizer never stepped)"
        plan.uncarried.append(Uncarried("optimizer.state", f"per-element keys {seen}", f"Adam/AdamW keeps exactly "
                                        f"{list(ADAM_STATE_KEYS)}", "convert a checkpoint saved after at least one "
                                        "step of an Adam/AdamW optimizer (for weights only: shardkit consolidate)",
                                        refused=True))
    marks = sorted({k for g in ckpt.param_groups for k in _NON_ADAM_GROUP_KEYS if k in g})
    if not kind and marks:
        plan.uncarried.append(Uncarried("optimizer.type", f"client optimizer with param-group keys {marks}",
                                        "those keys belong to LAMB/1-bit optimizers, whose state means something "
                                        "else than AdamW's", "resume with DeepSpeed", refused=True))
    elif not kind:
        plan.notes.append("the optimizer is not named in ds_config (a client optimizer); its state holds exactly "
                          "exp_avg/exp_avg_sq, so it is read as Adam/AdamW")
    for i, g in enumerate(ckpt.param_groups):
        if g.get("amsgrad"):
            plan.uncarried.append(Uncarried(f"param_groups[{i}].amsgrad", "True", "the checkpoint has no "
                                            "max_exp_avg_sq state to carry", "convert a run with amsgrad off",
                                            refused=True))
        if g.get("bias_correction", True) is False:
            plan.uncarried.append(Uncarried(f"param_groups[{i}].bias_correction", "False", "torch's Adam/AdamW "
                                            "always corrects the moments' bias, so the run would step differently",
                                            "resume with DeepSpeed", refused=True))


def _decoupled(ckpt: Zero3Checkpoint, group: dict[str, Any], index: int, adam_w_mode: bool | None, plan: _Plan) -> bool:
    """Whether group ``index`` decays weights AdamW-style: the group's own flag (torch optimizers),
    then ds_config (DeepSpeed's Adam is AdamW unless ``adam_w_mode: false``), then ``adam_w_mode``."""
    if "decoupled_weight_decay" in group:
        return bool(group["decoupled_weight_decay"])
    cfg = ckpt.ds_config.get("optimizer") or {}
    kind = str(cfg.get("type") or "").lower()
    if kind == "adamw":
        return True
    if kind == "adam":
        return bool((cfg.get("params") or {}).get("adam_w_mode", True))
    if adam_w_mode is not None:
        return adam_w_mode
    if float(group.get("weight_decay") or 0.0) != 0.0:
        plan.uncarried.append(Uncarried(f"param_groups[{index}].weight_decay", repr(group["weight_decay"]),
                                        "the client optimizer is not named in ds_config, so whether it decays "
                                        "weights AdamW-style (decoupled) or Adam-style (L2) is unknown",
                                        "pass --adam-w-mode on (AdamW) or off (Adam) (adam_w_mode=True/False)",
                                        refused=True))
    return True


def _torch_group_defaults() -> dict[str, Any]:
    """torch.optim.AdamW's param-group keys and defaults: DCP load needs every key the resuming
    optimizer's groups hold (``optim.param_groups.<i>.<key>``).

    Read from the constructors' signatures (AdamW's over Adam's, which has every key), not from an
    instance: ``Optimizer.__init__`` imports torch._dynamo, 1.5 s of a 5 s conversion. The test
    module checks the two agree."""
    import inspect

    import torch

    out: dict[str, Any] = {}
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        for key, p in inspect.signature(cls.__init__).parameters.items():
            if key not in ("self", "params") and p.default is not inspect.Parameter.empty:
                out[key] = p.default
    out["decoupled_weight_decay"] = True  # what AdamW passes to Adam.__init__
    return out


def _plan(ckpt: Zero3Checkpoint, optim0: dict[str, Any], adam_w_mode: bool | None) -> _Plan:
    buffers = list(ckpt.buffers())
    names = build_name_map([*(s.name for s in ckpt.slots), *ckpt.frozen_param_shapes, *buffers], ckpt.shared_params)
    state = optim0["optimizer_state_dict"].get("state") or {}
    steps = [float((state.get(j) or {}).get("step", 0)) for j in range(len(ckpt.sub_group_numel))]
    plan = _Plan(names=names, groups=[], steps=steps, notes=names.notes())
    _optimizer_checks(ckpt, plan)
    defaults = _torch_group_defaults()
    dropped_by_value: dict[str, list[int]] = {}
    for i, g in enumerate(ckpt.param_groups):
        group = dict(defaults)
        dropped = []
        for k, v in g.items():
            if k in _GROUP_KEYS_WITHOUT_TORCH_MEANING:
                dropped.append(f"{k}={v!r}")
            elif k in defaults or _jsonable(v):
                group[k] = tuple(v) if k == "betas" else v
            else:
                plan.uncarried.append(Uncarried(f"param_groups[{i}].{k}", type(v).__name__, "not a value torch can "
                                                "keep in a param group's JSON", "set it again after loading",
                                                refused=False))
        group["decoupled_weight_decay"] = _decoupled(ckpt, g, i, adam_w_mode, plan)
        group["params"] = [names.fsdp_name(s.name) for s in ckpt.slots if s.param_group == i]
        plan.groups.append(group)
        if dropped:
            dropped_by_value.setdefault(", ".join(dropped), []).append(i)
    for dropped_keys, indices in dropped_by_value.items():
        plan.notes.append(f"param_groups {indices}: {dropped_keys} not written (DeepSpeed optimizer keys with no "
                          f"torch counterpart: {'; '.join(f'{k}: {v}' for k, v in _GROUP_KEYS_WITHOUT_TORCH_MEANING.items())})")
    layout = "; ".join(f"[{i}] {len(g['params'])} params, lr={g['lr']}, weight_decay={g['weight_decay']}"
                       for i, g in enumerate(plan.groups))
    plan.notes.append(f"param groups written: {layout}. Build the resuming optimizer with the same groups over "
                      "the same (trainable) parameters: torch's load_state_dict refuses groups of other sizes")
    hyper = sorted({k for g in ckpt.param_groups for k in g if k not in _GROUP_KEYS_WITHOUT_TORCH_MEANING})
    plan.carried = [f"fp32 masters ({len(ckpt.slots)} trainable)", *ADAM_STATE_KEYS, "step",
                    f"param_groups x{len(plan.groups)} ({', '.join(hyper)})"]
    if ckpt.frozen_param_shapes:
        plan.carried.append(f"frozen parameters ({len(ckpt.frozen_param_shapes)}, no optimizer state)")
    if buffers:
        plan.carried.append(f"buffers ({len(buffers)})")
    if names.aliases:
        plan.carried.append(f"tied names ({', '.join(sorted(names.aliases))})")
    plan.notes.append("fused/foreach/capturable are written as torch's defaults (DeepSpeed has none): they override "
                      "the resuming optimizer's own at load; set them again after load_fsdp_checkpoint if you use them")
    _loss_scaler(ckpt, optim0, plan)
    _scheduler_and_client_state(ckpt, plan)
    return plan


def _loss_scaler(ckpt: Zero3Checkpoint, optim0: dict[str, Any], plan: _Plan) -> None:
    scaler = optim0.get("loss_scaler")
    dynamic = bool(optim0.get("dynamic_loss_scale"))
    cur = getattr(scaler, "cur_scale", 1.0)
    if not dynamic and cur == 1.0 and ckpt.precision != "fp16":
        return  # a static scale of 1 (bf16/fp32): there is no state to lose
    kept = {k: v for k, v in vars(scaler).items() if k != "args" and _jsonable(v)} if scaler is not None else {}
    kept["dynamic"] = dynamic
    plan.deepspeed["loss_scaler"] = kept
    plan.uncarried.append(Uncarried("loss_scaler", f"cur_scale={cur}, dynamic={dynamic}", "shardkit's FSDP2 "
                                    "checkpoint holds no loss scaler (torch.amp.GradScaler is the training "
                                    "script's)", "its state is in the manifest's extra.converted_from.loss_scaler: "
                                    f"start torch.amp.GradScaler(init_scale={cur}) to continue at the same scale",
                                    refused=False))


def _scheduler_and_client_state(ckpt: Zero3Checkpoint, plan: _Plan) -> None:
    ms = ckpt.model_state
    for key in ("global_steps", "global_samples", "skipped_steps"):
        if isinstance(ms.get(key), int):
            plan.deepspeed[key] = ms[key]
    sched = ms.get("lr_scheduler")
    if sched:
        # Decision: the scheduler's state is kept (JSON) in the manifest and reported, not refused:
        # the current lr is already in every param group, so training continues at the lr it had; a
        # schedule continues only once the script rebuilds its scheduler from this state.
        where = "kept in the manifest's extra.converted_from.lr_scheduler" if _jsonable(sched) else "not kept (not JSON)"
        if _jsonable(sched):
            plan.deepspeed["lr_scheduler"] = sched
        plan.uncarried.append(Uncarried("lr_scheduler", f"{len(sched)} keys" if isinstance(sched, dict) else
                                        type(sched).__name__, "shardkit's FSDP2 checkpoint has no scheduler; the "
                                        "param groups' lr is carried, so training resumes at the current lr",
                                        f"its state_dict is {where}: load it into the script's scheduler",
                                        refused=False))
    for key in client_state_keys(ms):
        if _jsonable(ms[key]):
            plan.user[key] = ms[key]
        else:
            plan.uncarried.append(Uncarried(f"client_state.{key}", type(ms[key]).__name__, "not JSON, and the "
                                            "FSDP2 checkpoint keeps the script's state in the manifest's extra.user",
                                            "save it in the training script's own file", refused=False))
    if plan.user:
        plan.carried.append(f"client_state ({', '.join(sorted(plan.user))}) -> manifest extra.user")
        if ckpt.world_size > 1:
            plan.notes.append(f"client_state comes from rank 0's file (saved at {ckpt.world_size} ranks); per-rank "
                              "values (data-loader positions, RNG) must be rebuilt by the training script")


# --- the lazy state dict -----------------------------------------------------------------------


def _gather(parts: list[RankPartitions], slot: ParamSlot, key: str) -> "torch.Tensor":
    """The full, unpadded ``key`` tensor of ``slot``, read rank by rank straight into the output
    (the fallback when a rank file's byte offsets are unknown)."""
    import torch

    out = torch.empty(slot.numel, dtype=parts[0].flat(key, slot.sub_group).dtype)
    for part in parts:
        start, stop = slot.rank_range(part.rank)
        if stop > start:
            part.read_into(key, slot.sub_group, slot.offset, out.narrow(0, start, stop - start))
    return out.view(slot.shape)


def _segments(parts: list[RankPartitions], slot: ParamSlot, key: str) -> list[Segment] | None:
    """``slot``'s ``key`` tensor as byte ranges of the rank files, in element order and without
    the zero padding (each rank's piece is contiguous in its flat partition), or None when a
    rank file's data offset is unknown."""
    dtype = parts[0].flat(key, slot.sub_group).dtype
    segments = []
    for part in parts:
        start, stop = slot.rank_range(part.rank)
        if stop <= start:
            continue
        at = part.byte_offset(slot, key)
        if at is None or part.flat(key, slot.sub_group).dtype != dtype:
            return None
        segments.append(Segment(str(part.path), at, (stop - start) * dtype.itemsize))
    return segments


class _ShapedLazyTensor(LazyTensor):
    """A LazyTensor pickled with its real shape and contiguous strides: DCP's reader (and
    dcp_slices) check that each stored item rebuilds a tensor of the item's shape."""

    def __init__(self, shape: tuple[int, ...], dtype: "torch.dtype", produce: Callable[[], "torch.Tensor"],
                 segments: list[Segment] | None):
        super().__init__(math.prod(shape), dtype, produce, (lambda: segments) if segments is not None else None)
        self.shape = tuple(shape)

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        import torch

        stride, acc = [], 1
        for d in reversed(self.shape):
            stride.append(acc)
            acc *= d
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, self.shape, tuple(reversed(stride)), False, OrderedDict()))


def _frozen_producer(fragments: list[dict[str, Any]], name: str, shape: tuple[int, ...]) -> Callable[[], Any]:
    def make() -> Any:
        import torch

        # clone: the record is the tensor's whole storage, which must not include the padding
        return torch.cat([f[name].reshape(-1) for f in fragments])[: math.prod(shape)].clone().view(shape)

    return make


def _state_template(ckpt: Zero3Checkpoint, plan: _Plan, parts: list[RankPartitions]) -> tuple[dict[str, Any], dict[str, LazyTensor]]:
    """``{"model": ..., "optim": ...}`` with meta tensors (shape and dtype only) where the data is
    big, and the lazy tensors ``_streaming_writer`` writes in their place (keyed by flattened DCP key)."""
    import torch

    names = plan.names
    model: dict[str, Any] = {}
    optim_state: dict[str, Any] = {}
    lazy: dict[str, LazyTensor] = {}
    by_fqn: dict[str, LazyTensor] = {}

    def lazy_slot(slot: ParamSlot, key: str) -> _ShapedLazyTensor:
        dtype = parts[0].flat(key, slot.sub_group).dtype
        return _ShapedLazyTensor(slot.shape, dtype, partial(_gather, parts, slot, key), _segments(parts, slot, key))

    for slot in ckpt.slots:
        fqn = names.fsdp_name(slot.name)
        dtype = parts[0].flat(FP32, slot.sub_group).dtype
        model[fqn] = torch.empty(slot.shape, dtype=dtype, device="meta")
        by_fqn[fqn] = lazy[dcp_model_key(fqn)] = lazy_slot(slot, FP32)
        entry: dict[str, Any] = {"step": torch.tensor(plan.steps[slot.sub_group], dtype=torch.float32)}
        for key in ADAM_STATE_KEYS:
            entry[key] = torch.empty(slot.shape, dtype=parts[0].flat(key, slot.sub_group).dtype, device="meta")
            lazy[dcp_optim_key(fqn, key)] = lazy_slot(slot, key)
        optim_state[fqn] = entry
    if ckpt.frozen_param_shapes:
        fragments = [ckpt.frozen_fragments(r) for r in range(ckpt.world_size)]
        for name, shape in ckpt.frozen_param_shapes.items():
            fqn = names.fsdp_name(name)
            dtype = fragments[0][name].dtype
            model[fqn] = torch.empty(shape, dtype=dtype, device="meta")
            by_fqn[fqn] = lazy[dcp_model_key(fqn)] = _ShapedLazyTensor(
                tuple(shape), dtype, _frozen_producer(fragments, name, shape), None)
    for name, tensor in ckpt.buffers().items():
        model[names.fsdp_name(name)] = tensor.detach().clone()
    for alias, owner in names.aliases.items():
        model[alias] = torch.empty(model[owner].shape, dtype=model[owner].dtype, device="meta")
        lazy[dcp_model_key(alias)] = by_fqn[owner]
    return {MODEL_KEY: model, OPTIM_KEY: {"state": optim_state, "param_groups": plan.groups}}, lazy


class _TensorFiles:
    """Each lazy tensor written to its own ``.distcp`` file by ``stream_save``, through
    ``stream.write_parallel`` (its threads, fsync by the writing thread, the first failure cancels
    the files not started) run on a background thread from before ``dcp.save`` plans: the bytes
    are copied from the rank files through one 1 MiB buffer per thread, crc'd and hashed as
    written, while the main thread imports DCP. preadv, crc32, sha256, write and fsync release the GIL."""

    def __init__(self, path: Path, lazy: dict[str, LazyTensor], outcome: str):
        import threading

        self.lazy, self.outcome = lazy, outcome
        # "__0_0.distcp" is the small items' file (the names DCP's writer would give rank 0's files)
        self.names = {key: f"__0_{n + 1}.distcp" for n, key in enumerate(lazy)}
        # largest first, so the last files to finish are small ones and no thread idles long
        self._order = sorted(lazy, key=lambda k: -lazy[k].nbytes)
        jobs: list[FileJob] = [(path / self.names[k], partial(stream_save, lazy[k])) for k in self._order]
        self._digests: dict[str, WrittenFile] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(jobs,), name="shardkit-convert", daemon=True)
        self._thread.start()

    def _run(self, jobs: list[FileJob]) -> None:
        try:
            written = write_parallel(jobs, default_workers(len(jobs)), outcome=self.outcome, thread_name="shardkit-convert")
            self._digests = dict(zip(self._order, written, strict=True))
        except BaseException as exc:  # noqa: BLE001 - raised in the main thread by written()
            self._error = exc

    def written(self, key: str) -> tuple[str, WrittenFile]:
        """The file holding ``key`` and what was written to it, once every file is complete."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.names[key], self._digests[key]

    def entries(self) -> list[FileEntry]:
        out = []
        for key in self._order:
            name, digest = self.written(key)
            out.append(FileEntry(name, digest.size, digest.sha256))
        return out

    def __enter__(self) -> "_TensorFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        # every writer stopped before atomic_checkpoint removes the staging folder on failure
        self._thread.join()


def _streaming_writer(path: Path, files: _TensorFiles) -> Any:
    """A FileSystemWriter whose tensor items are ``files``' (each its own file, whole: offset 0,
    the file's size), and whose other items go into one file through torch's own ``_write_item``.

    torch's writer ``torch.save``s every tensor from memory, so each one would be gathered from the
    ZeRO-3 partitions first, and computes its crc32 holding the GIL: one core. Everything else is
    DCP's own: the plan and ``.metadata`` come from ``dcp.save`` and ``FileSystemWriter.finish``,
    and ``FileSystemReader`` reads these items like any other.
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StorageInfo, _write_item
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class StreamingWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            results = []
            small = [i for i in plan.items if i.index.fqn not in files.lazy]
            first = "__0_0.distcp"
            with disk_full_named(path / first, files.outcome), open(path / first, "wb") as stream:
                for item in small:
                    data = planner.resolve_data(item)
                    if item.type != WriteItemType.BYTE_IO:
                        data = data.detach().cpu()
                    results.append(_write_item(self.transforms, stream, data, item, first, self.serialization_format))
                stream.flush()
                os.fsync(stream.fileno())
            planned = [i for i in plan.items if i.index.fqn in files.lazy]
            if sorted(i.index.fqn for i in planned) != sorted(files.lazy):
                raise RuntimeError("dcp.save planned other tensor items than the converter wrote: "
                                   f"{sorted({i.index.fqn for i in planned} ^ set(files.lazy))[:4]}")
            for item in planned:
                chunk = item.tensor_data.chunk
                if any(chunk.offsets) or tuple(chunk.sizes) != tuple(item.tensor_data.size):
                    raise RuntimeError(f"dcp.save split {item.index.fqn} into chunks; the converter wrote it whole")
                name, done = files.written(item.index.fqn)
                results.append(WriteResult(index=item.index, size_in_bytes=done.size,
                                           storage_data=_StorageInfo(name, 0, done.size)))
            fut: Future[list[Any]] = Future()
            fut.set_result(results)
            return fut

    return StreamingWriter(str(path), single_file_per_rank=True, sync_files=True)
