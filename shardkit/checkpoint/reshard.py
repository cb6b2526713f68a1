"""Repartition a ZeRO-3 checkpoint for a new data-parallel world size, in DeepSpeed's own format.

DeepSpeed's ``engine.load_checkpoint`` refuses a checkpoint saved at another world size
("Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is not
currently supported", ``engine._load_zero_checkpoint``); its answer is an offline
``ds_to_universal`` conversion into one folder per parameter plus ``load_universal: true``.
``reshard_zero3`` instead writes the per-rank files a run at the new world size would itself have
saved, so the plain ``load_checkpoint`` takes them unchanged:

- parameters are regrouped into sub-groups exactly as ZeRO-3 builds them at the new size
  (``DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups``: split a param group whenever the
  running sum of ``partition_numel()`` reaches ``sub_group_size``);
- each parameter gets ``ceil(numel / M)`` elements per rank, the last rank zero-padded, and the
  fp32 masters and every per-element optimizer state (``exp_avg``, ``exp_avg_sq``) are copied
  bit for bit; ``step`` and the param-group hyperparameters are kept;
- ``dp_world_size``/``partition_count`` become M, ``param_shapes`` follow the new sub-groups, and
  frozen parameter fragments are repartitioned too.

Memory stays near one output tensor: each rank file is written with torch's own zip writer, and
every tensor record is produced (from memory-mapped source rank files, one at a time) only when
it is written.
"""

from __future__ import annotations

import copy
import pickle
import sys
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from shardkit.checkpoint.atomic import os_errors_named
from shardkit.checkpoint.manifest import MANIFEST_NAME, config_digest
from shardkit.checkpoint.safe_load import safe_torch_load
from shardkit.checkpoint.zero3 import (
    FP32,
    MODEL_FILE,
    OPTIM_FILE,
    ParamSlot,
    Zero3Checkpoint,
    full_frozen_params,
    open_zero3_checkpoint,
    partition_numel,
)
from shardkit.errors import CheckpointError, UsageError

if TYPE_CHECKING:
    import torch

#: DeepSpeed's default ``zero_optimization.sub_group_size`` (runtime/zero/config.py).
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000


@dataclass(frozen=True)
class TargetParam:
    """One parameter in the new layout: where it comes from and where it goes."""

    source: ParamSlot
    offset: int
    """Start of its partition in each new rank's sub-group flat tensor."""
    partition_numel: int
    """``ceil(numel / new_world_size)``."""

    def rank_range(self, rank: int) -> tuple[int, int]:
        start = min(rank * self.partition_numel, self.source.numel)
        return start, min(start + self.partition_numel, self.source.numel)


@dataclass
class TargetLayout:
    """Sub-groups and partition offsets a ZeRO-3 run at ``world_size`` ranks uses."""

    world_size: int
    sub_groups: list[list[TargetParam]]
    sub_group_param_group: list[int]

    def sub_group_numel(self, sub_group: int) -> int:
        return sum(p.partition_numel for p in self.sub_groups[sub_group])


def plan_layout(ckpt: Zero3Checkpoint, world_size: int, sub_group_size: int | None = None) -> TargetLayout:
    """The layout DeepSpeed builds at ``world_size`` for the checkpoint's parameters, in their order."""
    if world_size < 1:
        raise UsageError(f"--world-size {world_size}: must be at least 1")
    if sub_group_size is None:
        sub_group_size = saved_sub_group_size(ckpt)
    by_group: dict[int, list[ParamSlot]] = {}
    for slot in ckpt.slots:
        by_group.setdefault(slot.param_group, []).append(slot)
    groups: list[list[ParamSlot]] = []
    owners: list[int] = []
    for g in sorted(by_group):
        for sub in _split_sub_groups(by_group[g], world_size, sub_group_size):
            groups.append(sub)
            owners.append(g)
    return _assign_offsets(groups, owners, world_size)


def saved_sub_group_size(ckpt: Zero3Checkpoint) -> int:
    """``zero_optimization.sub_group_size`` of the saved config, as DeepSpeed read it."""
    value = (ckpt.ds_config.get("zero_optimization") or {}).get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)
    if value == "auto":
        # DeepSpeed's config base drops "auto" keys, so the run that saved used the default
        warnings.warn(f"{ckpt.tag_dir}: the saved zero_optimization.sub_group_size is 'auto', which DeepSpeed "
                      f"treats as its default {DEFAULT_SUB_GROUP_SIZE:.0e}; using that. Pass --sub-group-size N "
                      "if the resuming run sets another value", stacklevel=3)
        return DEFAULT_SUB_GROUP_SIZE
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = 0
    if size < 1 or (isinstance(value, float) and value != size):
        raise UsageError(f"{ckpt.tag_dir}: the saved zero_optimization.sub_group_size is {value!r}, not a positive "
                         "integer; pass the resuming run's value with --sub-group-size N (DeepSpeed's default is 1e9)")
    return size


def _split_sub_groups(params: list[ParamSlot], world_size: int, sub_group_size: int) -> list[list[ParamSlot]]:
    # Mirrors DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups (0.19.8) on partition numels.
    total = sum(partition_numel(p.numel, world_size) for p in params)
    if sub_group_size is None or sub_group_size >= total:
        return [params]
    out, cur, size = [], [], 0
    for i, p in enumerate(params):
        cur.append(p)
        size += partition_numel(p.numel, world_size)
        if size >= sub_group_size or i == len(params) - 1:
            out.append(cur)
            cur, size = [], 0
    return out


def _assign_offsets(groups: list[list[ParamSlot]], owners: list[int], world_size: int) -> TargetLayout:
    sub_groups = []
    for params in groups:
        offset, placed = 0, []
        for slot in params:
            pn = partition_numel(slot.numel, world_size)
            placed.append(TargetParam(slot, offset, pn))
            offset += pn
        sub_groups.append(placed)
    return TargetLayout(world_size, sub_groups, owners)


def layout_from_names(ckpt: Zero3Checkpoint, world_size: int, sub_groups: list[list[str]], owners: list[int]) -> TargetLayout:
    """A layout given as parameter names per sub-group (a live engine's), checked against the checkpoint."""
    by_name = {s.name: s for s in ckpt.slots}
    missing = [n for names in sub_groups for n in names if n not in by_name]
    wanted = {n for names in sub_groups for n in names}
    unused = [s.name for s in ckpt.slots if s.name not in wanted]
    if missing or unused:
        raise CheckpointError(
            f"{ckpt.tag_dir}: the model's trainable parameters do not match the checkpoint's: "
            f"not in the checkpoint {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"in the checkpoint but not trained by this engine {unused[:5]}{'...' if len(unused) > 5 else ''}. "
            "Build the same model (same requires_grad flags) as the run that saved it."
        )
    groups = [[by_name[n] for n in names] for names in sub_groups]
    return _assign_offsets(groups, owners, world_size)


def build_partition(
    ckpt: Zero3Checkpoint, layout: TargetLayout, rank: int, sub_group: int, key: str, dtype: "torch.dtype | None" = None
) -> "torch.Tensor":
    """New rank ``rank``'s flat ``key`` tensor of ``sub_group`` (fp32 masters or a moment), padding zeroed.

    Source rank files are mapped one at a time and only the ranges this partition needs are read.
    """
    import torch

    params = layout.sub_groups[sub_group]
    numel = layout.sub_group_numel(sub_group)
    if dtype is None:
        with ckpt.open_rank(0) as part:
            dtype = part.flat(key, params[0].source.sub_group).dtype if params else torch.float32
    # empty, not zeros: every element is either copied below or padding zeroed here, and
    # zero-filling gigabytes first costs a page-faulting pass of its own
    out = torch.empty(numel, dtype=dtype)
    for tp in params:
        lo, hi = tp.rank_range(rank)
        out.narrow(0, tp.offset + (hi - lo), tp.partition_numel - (hi - lo)).zero_()
    for src_rank in range(ckpt.world_size):
        pieces = []
        for tp in params:
            lo, hi = tp.rank_range(rank)
            s_lo, s_hi = tp.source.rank_range(src_rank)
            a, b = max(lo, s_lo), min(hi, s_hi)
            if b > a:
                pieces.append((tp, a, b, lo, s_lo))
        if not pieces:
            continue
        with ckpt.open_rank(src_rank) as part:
            for tp, a, b, lo, s_lo in pieces:
                part.read_into(key, tp.source.sub_group, tp.source.offset + (a - s_lo), out.narrow(0, tp.offset + (a - lo), b - a))
    return out


def repartition_frozen(full: "torch.Tensor", world_size: int, rank: int) -> "torch.Tensor":
    """Rank ``rank``'s ZeRO-3 fragment of a whole (frozen) parameter at ``world_size`` ranks."""
    import torch

    flat = full.reshape(-1)
    pn = partition_numel(flat.numel(), world_size)
    out = torch.zeros(pn, dtype=flat.dtype)
    start = min(rank * pn, flat.numel())
    stop = min(start + pn, flat.numel())
    out[: stop - start].copy_(flat[start:stop])
    return out


@dataclass
class ReshardResult:
    """What ``reshard_zero3`` wrote."""

    output: Path
    """The new checkpoint root (holds ``latest``)."""
    tag: str
    world_size: int
    source_world_size: int
    files: list[Path]
    bytes: int
    manifest: Path | None
    notes: list[str] = field(default_factory=list)
    """Things the user should know (client_state taken from rank 0 ...)."""
    verified: str = "sha256"
    """How the source was checked before it was read: 'sha256', 'sizes' (--no-verify) or 'none' (no manifest)."""


@os_errors_named("resharding the checkpoint")
def reshard_zero3(
    checkpoint: str | Path,
    output: str | Path,
    world_size: int,
    *,
    tag: str | None = None,
    sub_group_size: int | None = None,
    manifest: bool = True,
    force: bool = False,
    verify: bool = True,
    warn: Callable[[str], None] | None = None,
) -> ReshardResult:
    """Write ``checkpoint`` repartitioned for ``world_size`` ranks under ``output/<tag>`` + ``output/latest``.

    ``sub_group_size`` must match the ``zero_optimization.sub_group_size`` the resuming run uses
    (default: the one saved in the checkpoint's config, else DeepSpeed's default 1e9). The new tag
    folder is staged and renamed into place, ``latest`` moves last, and a shardkit manifest is
    written unless ``manifest=False``.

    Before anything is read the source is checked against its manifest (sizes, and sha256 unless
    ``verify=False``): a corrupted source is refused, since the new manifest would vouch for the
    corruption. ``output`` must be new, empty, or a shardkit checkpoint folder; an existing
    ``output/<tag>`` is replaced only with ``force=True``. ``warn`` receives what the user should
    know before trusting the result (default: ``warnings.warn``).
    """
    from shardkit.checkpoint.atomic import LATEST_NAME, atomic_checkpoint, check_tag, disk_full_named
    from shardkit.checkpoint.verify import verify_before_reading, warn_unverified
    from shardkit.checkpoint.zero3 import resolve_tag_dir

    warn = warn or warn_unverified
    source_dir, source_tag = resolve_tag_dir(checkpoint)
    tag = check_tag(tag) if tag is not None else _source_tag_as_new_tag(checkpoint, source_dir, source_tag)
    root = Path(output)
    final = root / tag
    check_output_root(root, tag, source_dir, force=force)
    checked = verify_before_reading(source_dir, checksums=verify)
    for note in checked.warnings:
        warn(note)
    verified = checked.level
    # the tag folder that was verified, not ``checkpoint`` again: a save in between could move
    # 'latest' to a tag nobody verified, and the new manifest would say "verified": "sha256"
    ckpt = open_zero3_checkpoint(source_dir)
    layout = plan_layout(ckpt, world_size, sub_group_size)

    # Real DeepSpeed objects (loss scaler, ZeroStageEnum) are re-saved, so resolve them for real.
    optim0 = safe_torch_load(ckpt.optim_files[0], mmap=True, real_deepspeed_objects=True)
    frozen = full_frozen_params(ckpt)
    prefix = "bf16_" if ckpt.optim_files[0].name.startswith("bf16_") else ""
    written = []
    facts = dict(
        world_size=world_size, step=ckpt.model_state.get("global_steps"), zero_stage=3, dtype=ckpt.precision,
        config_digest=config_digest(ckpt.ds_config or None),
        extra={"resharded_from": {"path": str(ckpt.tag_dir), "world_size": ckpt.world_size,
                                  "ds_version": ckpt.ds_version, "verified": verified}},
    )
    outcome = f"nothing written: the staging folder was removed, {root / LATEST_NAME} is unchanged"
    with atomic_checkpoint(root, tag, engine="deepspeed", manifest=manifest, **facts) as save:
        staged = save.path
        hasher = _BackgroundHasher(staged) if manifest else None
        try:
            for rank in range(world_size):
                model_path = staged / MODEL_FILE.format(rank=rank)
                with disk_full_named(model_path, outcome):
                    _save_small(model_state_for_rank(ckpt, layout, rank, frozen), model_path)
                optim_path = staged / OPTIM_FILE.format(prefix=prefix, rank=rank)
                with disk_full_named(optim_path, outcome):
                    stream_save(optim_state_for_rank(ckpt, layout, rank, optim0), optim_path)
                written += [model_path, optim_path]
                if hasher:
                    hasher.add(model_path, optim_path)
            if hasher:
                save.known_files = hasher.entries()
        finally:
            if hasher:
                hasher.close()  # before the staging folder is removed on failure
    files = [final / p.name for p in written]
    return ReshardResult(
        output=root,
        tag=tag,
        world_size=world_size,
        source_world_size=ckpt.world_size,
        files=files,
        bytes=sum(f.stat().st_size for f in files),
        manifest=final / MANIFEST_NAME if manifest else None,
        notes=[n for n in (client_state_note(ckpt, world_size),) if n],
        verified=verified,
    )


def _source_tag_as_new_tag(checkpoint: str | Path, source_dir: Path, source_tag: str) -> str:
    """The source's tag, reused for the output when no ``--tag`` was given, or a UsageError that
    names where that tag came from (the user never typed it) and says to pass ``--tag``."""
    from shardkit.checkpoint.atomic import LATEST_NAME, tag_problem

    why = tag_problem(source_tag)
    if why is None:
        return source_tag
    given = Path(checkpoint).resolve()
    # a root or its 'latest' file: the tag was read from 'latest'; a tag folder or a rank file: its folder name
    if given != source_dir.resolve() and given.parent != source_dir.resolve():
        origin = f"read from {source_dir.parent / LATEST_NAME}"
    else:
        origin = f"the name of the source folder {source_dir}"
    raise UsageError(f"source tag {source_tag!r} ({origin}) cannot name the new checkpoint ({why}); no --tag was "
                     "given, so the source's tag would be reused. Pass --tag NAME, e.g. --tag global_step100")


def check_output_root(root: Path, tag: str, source_dir: Path, *, force: bool = False) -> None:
    """Refuse an output folder where writing ``<tag>/`` and ``latest`` would destroy something.

    Accepted: a path that does not exist, an empty folder, or a shardkit checkpoint folder (one
    holding at least one tag folder with a manifest). Refused: the source checkpoint's own folder
    or anything inside it; a non-empty folder of other files (the save sequence removes leftovers
    of interrupted saves there and points ``latest`` at the new tag); a ``<tag>`` or ``latest``
    that is not a shardkit checkpoint / a regular file; an existing ``<tag>`` checkpoint unless
    ``force``.
    """
    from shardkit.checkpoint.atomic import LATEST_NAME, REPLACED_MARK, STAGING_PREFIX

    src, src_root = source_dir.resolve(), source_dir.parent.resolve()
    final = root / tag
    if final.resolve() == src:
        raise UsageError(
            f"-o {root} with tag {tag!r} would overwrite the checkpoint being read ({source_dir}); "
            "write to another folder or pass --tag NEW_TAG"
        )
    if root.resolve() == src_root:
        raise UsageError(
            f"-o {root} is the folder of the checkpoint being read: the resharded copy would move its 'latest' "
            f"pointer away from {source_dir.name!r} and the source run could no longer resume from it. Write to "
            f"another folder, e.g. -o {root.resolve().name}_resharded/"
        )
    if root.resolve().is_relative_to(src):
        raise UsageError(f"-o {root} is inside the checkpoint being read ({source_dir}); write to another folder")
    if not root.exists() and not root.is_symlink():
        return
    if not root.is_dir():
        raise UsageError(f"-o {root}: exists and is not a folder; pass a new or empty folder (the resharded "
                         f"checkpoint is written as OUT/{tag}/ and OUT/{LATEST_NAME})")
    entries = sorted(root.iterdir())
    if not entries:
        return
    checkpoints = [e for e in entries if e.is_dir() and not e.name.startswith(STAGING_PREFIX)
                   and REPLACED_MARK not in e.name and (e / MANIFEST_NAME).is_file()]
    if not checkpoints:
        shown = [e.name for e in entries[:5]] + (["..."] if len(entries) > 5 else [])
        raise UsageError(
            f"-o {root}: folder is not empty and is not a shardkit checkpoint folder (it holds {shown}); writing "
            f"there would point its '{LATEST_NAME}' at the new tag and remove files named like leftovers of "
            "interrupted saves. Pass a new or empty folder"
        )
    latest = root / LATEST_NAME
    if (latest.exists() or latest.is_symlink()) and not latest.is_file():
        raise UsageError(f"-o {root}: {latest} is not a regular file (a folder, device or dangling link), so it "
                         "cannot be the checkpoint pointer; pass another folder")
    if final.exists() or final.is_symlink():
        if final.is_symlink() or not final.is_dir() or not (final / MANIFEST_NAME).is_file():
            raise UsageError(f"-o {root}: {final} exists and is not a shardkit checkpoint (no {MANIFEST_NAME}, or "
                             "not a plain folder); it is never replaced. Pass --tag NEW_TAG or another folder")
        if not force:
            raise UsageError(f"-o {root}: already holds checkpoint {tag!r} ({final}); pass --force to replace it, "
                             "or --tag NEW_TAG to write beside it")


def model_state_for_rank(
    ckpt: Zero3Checkpoint, layout: TargetLayout, rank: int, frozen: dict[str, "torch.Tensor"] | None = None
) -> dict[str, Any]:
    """Rank ``rank``'s model_states dict at the new world size (rank 0's, with sizes and fragments updated)."""
    import torch

    if layout.world_size == ckpt.world_size and rank > 0:
        # the same partitioning: this rank's own file, so its own client_state entries survive
        sd = dict(safe_torch_load(ckpt.model_files[rank], mmap=True, real_deepspeed_objects=True))
    else:
        sd = dict(ckpt.model_state)
    sd["dp_world_size"] = layout.world_size
    sd["param_shapes"] = [
        OrderedDict((tp.source.name, torch.Size(tp.source.shape)) for tp in params) for params in layout.sub_groups
    ]
    if frozen is None:
        frozen = full_frozen_params(ckpt)
    if frozen:
        sd["frozen_param_fragments"] = OrderedDict(
            (name, repartition_frozen(t, layout.world_size, rank)) for name, t in frozen.items()
        )
    return sd


#: Entries DeepSpeed itself writes into each ``*_model_states.pt`` (``DeepSpeedEngine.
#: _common_checkpoint_state``, 0.19.8); everything else there is the caller's ``client_state``.
DEEPSPEED_MODEL_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version", "sparse_tensor_module_names",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info",
})


def client_state_note(ckpt: Zero3Checkpoint, world_size: int) -> str | None:
    """Say where client_state comes from when ranks cannot keep their own (another world size)."""
    keys = sorted(k for k in ckpt.model_state if k not in DEEPSPEED_MODEL_KEYS)
    if world_size == ckpt.world_size or not keys:
        return None
    return (f"client_state {keys} comes from rank 0's file for every one of the {world_size} rank(s) (saved at "
            f"{ckpt.world_size}: there is no one-to-one mapping of ranks); per-rank values (data-loader "
            "positions, RNG) must be rebuilt by the training script")


def optim_state_for_rank(ckpt: Zero3Checkpoint, layout: TargetLayout, rank: int, optim0: dict[str, Any]) -> dict[str, Any]:
    """Rank ``rank``'s optim_states dict with lazy tensors (produced when written or materialized)."""
    import torch

    src = optim0["optimizer_state_dict"]
    src_inner = src["optimizer_state_dict"]
    src_state = src_inner.get("state") or {}
    state: dict[int, dict[str, Any]] = {}
    for j, params in enumerate(layout.sub_groups):
        first = params[0].source.sub_group if params else 0
        entry = src_state.get(first)
        if entry is None:
            continue  # the optimizer never stepped: no state to carry
        new_entry: dict[str, Any] = {}
        for k, v in entry.items():
            if k in ckpt.state_keys:
                new_entry[k] = LazyTensor(layout.sub_group_numel(j), v.dtype, _producer(ckpt, layout, rank, j, k, v.dtype))
            else:
                new_entry[k] = copy.deepcopy(v)
        state[j] = new_entry
    param_groups = []
    for g, group in enumerate(src_inner.get("param_groups") or [{}]):
        new_group = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        new_group["params"] = [j for j, owner in enumerate(layout.sub_group_param_group) if owner == g]
        param_groups.append(new_group)
    fp32 = [
        LazyTensor(layout.sub_group_numel(j), torch.float32, _producer(ckpt, layout, rank, j, FP32, torch.float32))
        for j in range(len(layout.sub_groups))
    ]
    osd: dict[str, Any] = {}
    for k, v in src.items():
        if k == "optimizer_state_dict":
            osd[k] = {"state": state, "param_groups": param_groups}
        elif k == "fp32_flat_groups":
            osd[k] = fp32
        elif k == "partition_count":
            osd[k] = layout.world_size
        elif k == "ds_zero_partition_groups":
            continue  # AutoEP placement metadata is topology-specific
        else:
            osd[k] = v
    out = {k: v for k, v in optim0.items() if k != "optimizer_state_dict"}
    return {"optimizer_state_dict": osd, **out}


def _producer(ckpt: Zero3Checkpoint, layout: TargetLayout, rank: int, j: int, key: str, dtype: "torch.dtype") -> Callable[[], "torch.Tensor"]:
    return lambda: build_partition(ckpt, layout, rank, j, key, dtype)


def _save_small(obj: Any, path: Path) -> None:
    import torch

    torch.save(obj, path)


class _BackgroundHasher:
    """sha256 of each finished file on a worker thread while the next file is produced.

    hashlib releases the GIL on large buffers, so on a 2-core machine hashing overlaps writing
    instead of re-reading all files at the end (what ``manifest.seal`` would do).
    """

    def __init__(self, tag_dir: Path):
        from concurrent.futures import ThreadPoolExecutor

        self.tag_dir = tag_dir
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardkit-sha256")
        self._futures: dict[str, Any] = {}

    def add(self, *paths: Path) -> None:
        from shardkit.checkpoint.manifest import describe_files

        for p in paths:
            rel = p.relative_to(self.tag_dir).as_posix()
            self._futures[rel] = self._pool.submit(describe_files, self.tag_dir, [rel])

    def entries(self) -> list[Any]:
        out = [e for f in self._futures.values() for e in f.result()]
        self._pool.shutdown()
        return sorted(out, key=lambda e: e.path)

    def close(self) -> None:
        """Stop hashing (queued files are dropped); waits for the file being hashed."""
        self._pool.shutdown(wait=True, cancel_futures=True)


# --- streaming torch.save ------------------------------------------------------------------------


class LazyTensor:
    """A 1-D CPU tensor that pickles exactly like ``torch.save`` pickles one, but whose bytes are
    produced only when ``stream_save`` writes its record (or when ``materialize()`` is called)."""

    def __init__(self, numel: int, dtype: "torch.dtype", produce: Callable[[], "torch.Tensor"]):
        self.numel, self.dtype, self.produce = numel, dtype, produce
        self.storage = _LazyStorage(self)

    def materialize(self) -> "torch.Tensor":
        t = self.produce()
        if t.numel() != self.numel or t.dtype != self.dtype:
            raise RuntimeError(f"lazy tensor produced {t.dtype}[{t.numel()}], expected {self.dtype}[{self.numel}]")
        return t

    def __reduce_ex__(self, protocol: int) -> Any:
        import torch

        return (torch._utils._rebuild_tensor_v2, (self.storage, 0, (self.numel,), (1,), False, OrderedDict()))


class _LazyStorage:
    def __init__(self, owner: LazyTensor):
        self.owner = owner


def materialize(obj: Any) -> Any:
    """``obj`` with every LazyTensor replaced by its produced tensor (for in-process loading)."""
    if isinstance(obj, LazyTensor):
        return obj.materialize()
    if isinstance(obj, dict):
        return type(obj)((k, materialize(v)) for k, v in obj.items()) if isinstance(obj, OrderedDict) else {k: materialize(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [materialize(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(materialize(v) for v in obj)
    return obj


def stream_save(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)`` where LazyTensor records are produced one at a time while writing.

    Mirrors ``torch.serialization._save`` (2.13): same pickle protocol, persistent ids, record
    names and order, through torch's own ``PyTorchFileWriter``; ``torch.load`` cannot tell the
    difference. Only one produced tensor is alive at a time.
    """
    import torch
    from torch.serialization import _get_storage_alignment, _open_zipfile_writer, location_tag

    storage_types = torch.storage._dtype_to_storage_type_map()
    keys: dict[int, str] = {}
    records: dict[str, Any] = {}

    class _Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, _LazyStorage):
                key = keys.setdefault(id(o), str(len(keys)))
                records[key] = o
                t = o.owner
                return ("storage", getattr(torch, storage_types[t.dtype]), key, "cpu", t.numel)
            if isinstance(o, torch.storage.TypedStorage):
                storage = o._untyped_storage
                key = keys.setdefault(storage._cdata, str(len(keys)))
                records[key] = storage
                return ("storage", getattr(torch, o._pickle_storage_type()), key, location_tag(storage), o._size())
            if torch.is_storage(o):
                key = keys.setdefault(o._cdata, str(len(keys)))
                records[key] = o
                return ("storage", torch.UntypedStorage, key, location_tag(o), o.nbytes())
            return None

    import io

    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    data = buf.getvalue()
    with _open_zipfile_writer(str(path)) as writer:
        writer.write_record("data.pkl", data, len(data))
        writer.write_record(".format_version", "1", 1)
        alignment = str(_get_storage_alignment())
        writer.write_record(".storage_alignment", alignment, len(alignment))
        writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for key, rec in records.items():
            if isinstance(rec, _LazyStorage):
                t = rec.owner.materialize()
                storage = t.contiguous().untyped_storage()
                writer.write_record(f"data/{key}", storage, storage.nbytes())
                del t, storage
            else:
                writer.write_record(f"data/{key}", rec.cpu(), rec.nbytes())
