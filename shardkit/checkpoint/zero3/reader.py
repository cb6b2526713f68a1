"""Read a DeepSpeed ZeRO-3 checkpoint: find its files, describe its layout, and copy partitions out.

Layout (DeepSpeed 0.19.8; checked against ``deepspeed/utils/zero_to_fp32.py``
``_zero3_merge_trainable_params`` and ``deepspeed/checkpoint/ds_to_universal.py``
``extract_zero_shards_stage3``):

- ``<root>/latest`` holds the tag; ``<root>/<tag>/`` holds, for each data-parallel rank ``r``,
  ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` (``param_shapes``, ``dp_world_size``,
  ``ds_version``, buffers, client state) and ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt``
  (``optimizer_state_dict``: ``partition_count``, ``fp32_flat_groups`` and the inner torch
  optimizer's ``state``/``param_groups``).
- ``param_shapes`` is a list with one ordered dict per optimizer *sub-group* (``sub_group_size``
  splits a param group), and sub-group ``i`` is ``fp32_flat_groups[i]`` and inner state ``i``.
- Inside a sub-group's flat tensor each parameter takes ``ceil(numel / world_size)`` elements on
  every rank, in ``param_shapes`` order; rank ``r`` holds elements ``[r*p, (r+1)*p)`` of the
  flattened parameter and the last rank's tail is zero padding.

Reading is streaming: rank files are opened with ``torch.load(mmap=True, weights_only=True)`` and
slices are read with ``os.preadv`` straight into the destination tensor (the mapping's pages are
never touched), so memory stays near the tensors being produced. ``open_zero3_checkpoint(...,
torch_free=True)`` parses the files with ``read_structure`` instead and never imports torch.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkit.checkpoint.io.torch_load import TensorRef, iter_leaves, read_structure, safe_torch_load
from shardkit.checkpoint.zero3.layout import partition_numel, rank_range
from shardkit.config.view import deepspeed_view
from shardkit.core.errors import CheckpointError

if TYPE_CHECKING:
    import torch

MODEL_FILE = "zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
OPTIM_FILE = "{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
FP32 = "fp32"
"""Pseudo state key for the fp32 master partitions (``fp32_flat_groups``)."""

_RANK_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(model|optim)_states\.pt$")


@dataclass(frozen=True)
class ParamSlot:
    """Where one trainable parameter lives in the checkpoint's per-rank flat partitions."""

    name: str
    shape: tuple[int, ...]
    numel: int
    param_group: int
    """Index of the optimizer param group (``param_groups[i]``) the parameter belongs to."""
    sub_group: int
    """Index of the sub-group: ``fp32_flat_groups[i]`` and inner optimizer state ``i``."""
    offset: int
    """Start of this parameter's partition inside every rank's sub-group flat tensor."""
    partition_numel: int
    """``ceil(numel / world_size)``: elements per rank, the last rank zero-padded."""

    def rank_range(self, rank: int) -> tuple[int, int]:
        """Elements ``[start, stop)`` of the flattened parameter that ``rank`` holds (without padding)."""
        return rank_range(rank, self.partition_numel, self.numel)


@dataclass
class Zero3Checkpoint:
    """A ZeRO-3 checkpoint's files and layout (read from rank 0's files; tensors stay on disk)."""

    tag_dir: Path
    tag: str
    world_size: int
    model_files: list[Path]
    optim_files: list[Path]
    slots: list[ParamSlot]
    sub_group_numel: list[int]
    """Per-rank flat length of each sub-group."""
    sub_group_param_group: list[int]
    param_groups: list[dict[str, Any]]
    """The inner optimizer's param groups (hyperparameters; ``params`` dropped)."""
    state_keys: list[str]
    """Per-element optimizer state keys found (e.g. ``exp_avg``, ``exp_avg_sq``)."""
    precision: str
    """``bf16``, ``fp16`` or ``fp32``: the training precision the checkpoint was written with."""
    ds_version: str | None
    ds_config: dict[str, Any]
    model_state: dict[str, Any] = field(repr=False)
    """Rank 0's model_states dict (parameter placeholders, buffers, counters, client state)."""
    torch_free: bool = False
    """Opened with ``read_structure``: tensors are ``TensorRef``s, ``open_rank`` is unavailable."""

    @property
    def root(self) -> Path:
        return self.tag_dir.parent

    @property
    def num_params(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def frozen_param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = self.model_state.get("frozen_param_shapes") or {}
        return {k: tuple(v) for k, v in shapes.items()}

    @property
    def shared_params(self) -> dict[str, str]:
        """Aliases: ``{name not stored: name that holds the data}`` (tied weights)."""
        return dict(self.model_state.get("shared_params") or {})

    def buffers(self) -> dict[str, "torch.Tensor"]:
        names = self.model_state.get("buffer_names") or []
        module = self.model_state.get("module") or {}
        return {n: module[n] for n in names if n in module}

    @contextmanager
    def open_rank(self, rank: int) -> Iterator["RankPartitions"]:
        """Map one rank's optim file; its pages are released when the block ends."""
        if self.torch_free:
            raise RuntimeError("open_rank needs torch: open the checkpoint without torch_free=True")
        sd = safe_torch_load(self.optim_files[rank], mmap=True)
        part = RankPartitions(self, rank, _optimizer_sd(sd, self.optim_files[rank]), _FileOffsets(self.optim_files[rank], sd))
        try:
            yield part
        finally:
            # Drop every reference to the mapping so it is unmapped now, not when the caller's
            # `as` variable is rebound: holding two rank files at once doubles resident pages.
            part.release()
            del sd, part

    def frozen_fragments(self, rank: int) -> dict[str, "torch.Tensor"]:
        """Rank ``rank``'s partitions of parameters the optimizer does not own (frozen ones)."""
        if not self.frozen_param_shapes:
            return {}
        sd = self.model_state if rank == 0 else safe_torch_load(self.model_files[rank], mmap=True)
        return dict(sd.get("frozen_param_fragments") or {})


class RankPartitions:
    """One rank's flat partitions, memory-mapped: ``flat(key, sub_group)`` -> 1-D tensor."""

    def __init__(self, ckpt: Zero3Checkpoint, rank: int, optim_sd: dict[str, Any], offsets: "_FileOffsets | None" = None):
        self.ckpt, self.rank, self._sd = ckpt, rank, optim_sd
        self._state = optim_sd["optimizer_state_dict"].get("state", {})
        self._offsets = offsets
        self._fd: int | None = None

    @property
    def path(self) -> Path:
        return self.ckpt.optim_files[self.rank]

    def release(self) -> None:
        self._sd, self._state, self._offsets = {}, {}, None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def byte_offset(self, slot: ParamSlot, key: str) -> int | None:
        """Where this rank's piece of ``slot`` starts in the rank *file*, or None when unknown.

        Lets callers copy the bytes file-to-file (``os.copy_file_range``) without paging them in.
        """
        t = self.flat(key, slot.sub_group)
        base = self._offsets.of(t) if self._offsets is not None else None
        return None if base is None else base + slot.offset * t.element_size()

    def read_into(self, key: str, sub_group: int, start: int, out: "torch.Tensor") -> None:
        """Copy elements ``[start, start + out.numel())`` of a flat tensor into ``out`` (1-D, contiguous).

        Reads with ``os.preadv`` straight into ``out`` when the file offset is known: one syscall,
        no page faults on the mapping (which on a busy VM made mmap copies ~4x slower).
        """
        src = self.flat(key, sub_group)
        base = self._offsets.of(src) if self._offsets is not None and src.dtype == out.dtype else None
        if base is not None and hasattr(os, "preadv") and out.is_contiguous() and out.device.type == "cpu":
            view = memoryview(out.view(_uint8()).numpy())
            done, want, at = 0, view.nbytes, base + start * src.element_size()
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
            while done < want:
                n = os.preadv(self._fd, [view[done:]], at + done)
                if n <= 0:
                    break
                done += n
            if done == want:
                return
        out.copy_(src.narrow(0, start, out.numel()))

    def flat(self, key: str, sub_group: int) -> "torch.Tensor":
        if key == FP32:
            t = self._sd["fp32_flat_groups"][sub_group]
        else:
            entry = self._state.get(sub_group)
            if entry is None or key not in entry:
                raise CheckpointError(
                    f"{self.ckpt.optim_files[self.rank]}: optimizer state {key!r} of sub-group {sub_group} "
                    "is missing (the optimizer never stepped, or it is not an Adam-style optimizer)"
                )
            t = entry[key]
        want = self.ckpt.sub_group_numel[sub_group]
        if t.numel() != want:
            raise CheckpointError(
                f"{self.ckpt.optim_files[self.rank]}: {key} of sub-group {sub_group} has {t.numel()} "
                f"elements, expected {want} from param_shapes at world size {self.ckpt.world_size}. "
                "The rank files come from different saves or the file is damaged."
            )
        return t.reshape(-1)

    def scalar_state(self, sub_group: int) -> dict[str, Any]:
        """Non-partitioned optimizer state of a sub-group (``step``), identical on every rank."""
        entry = self._state.get(sub_group) or {}
        return {k: v for k, v in entry.items() if k not in self.ckpt.state_keys}

    def param_slice(self, slot: ParamSlot, key: str) -> "torch.Tensor":
        """This rank's unpadded piece of ``slot``: full-parameter elements ``slot.rank_range(rank)``."""
        start, stop = slot.rank_range(self.rank)
        return self.flat(key, slot.sub_group).narrow(0, slot.offset, stop - start)


class _FileOffsets:
    """Byte offsets of memory-mapped tensors inside their torch zip file.

    ``torch.load(mmap=True)`` maps the whole file once and every storage is a slice of that
    mapping at its record's offset, so ``data_ptr`` differences are file-offset differences. The
    anchor is the data record with the lowest offset (found in the zip's local headers), which is
    the non-empty storage with the lowest address. Each offset is checked by reading the first
    bytes back from the file; anything unexpected disables the shortcut (callers then copy from
    memory).
    """

    def __init__(self, path: Path, loaded: Any):
        import torch

        self.path = path
        self._base: int | None = None
        try:
            ptrs = [t.untyped_storage().data_ptr() for t in iter_leaves(loaded, torch.Tensor) if t.untyped_storage().nbytes() > 0]
            starts = _zip_data_offsets(path)
            if ptrs and starts:
                self._base = min(starts) - min(ptrs)
        except Exception:  # noqa: BLE001 - an optimisation only; never a reason to fail
            self._base = None

    def of(self, t: "torch.Tensor") -> int | None:
        if self._base is None or t.numel() == 0:
            return None
        offset = self._base + t.data_ptr()
        probe = min(16, t.numel() * t.element_size())
        with open(self.path, "rb") as fh:
            fh.seek(offset)
            on_disk = fh.read(probe)
        if on_disk != t.reshape(-1)[: max(1, probe // t.element_size())].contiguous().view(_uint8()).numpy().tobytes()[:probe]:
            self._base = None
            return None
        return offset


def _uint8():
    import torch

    return torch.uint8


def _zip_data_offsets(path: Path) -> list[int]:
    """File offsets where the bytes of each non-empty ``.../data/<key>`` record of a torch zip start."""
    import struct
    import zipfile

    out = []
    with zipfile.ZipFile(path) as z, open(path, "rb") as fh:
        for info in z.infolist():
            if "/data/" not in info.filename or info.file_size == 0 or info.compress_type != zipfile.ZIP_STORED:
                continue
            fh.seek(info.header_offset)
            header = fh.read(30)
            if header[:4] != b"PK\x03\x04":
                return []
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            out.append(info.header_offset + 30 + name_len + extra_len)
    return out


def _optimizer_sd(sd: Any, path: Path) -> dict[str, Any]:
    osd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
    if not isinstance(osd, dict) or "fp32_flat_groups" not in osd:
        raise CheckpointError(
            f"{path}: not a ZeRO-3 optimizer file (no optimizer_state_dict.fp32_flat_groups). "
            "ZeRO-1/2 checkpoints keep single_partition_of_fp32_groups instead; use DeepSpeed's zero_to_fp32.py for those."
        )
    return osd


def resolve_tag_dir(path: str | Path) -> tuple[Path, str]:
    """Checkpoint root (with ``latest``), tag folder, or one rank file -> (tag folder, tag)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: checkpoint path does not exist")
    if p.is_file():
        if _RANK_FILE.match(p.name):
            return p.parent, p.parent.name
        if p.name == "latest":
            return resolve_tag_dir(p.parent)
        raise CheckpointError(
            f"{p}: is a file, expected a DeepSpeed checkpoint folder (the one holding 'latest') or a tag folder"
        )
    from shardkit.checkpoint.io.atomic import LATEST_NAME, REPLACED_MARK, STAGING_PREFIX, latest_tag

    if p.name.startswith(STAGING_PREFIX):
        # the same rule as verify.resolve_checkpoint: a staging folder is never loaded
        raise CheckpointError(
            f"{p}: is the staging directory of a save that never completed (killed or failed before it was "
            f"renamed into place). Resume from the checkpoint named in {p.parent / LATEST_NAME}"
        )
    if any(_RANK_FILE.match(f.name) for f in p.iterdir() if f.is_file()):
        return p, p.name
    latest = p / LATEST_NAME
    tag = latest_tag(p)  # one folder name inside p, or a CheckpointError naming the pointer file
    if tag is not None:
        tag_dir = p / tag
        if not tag_dir.is_dir():
            raise CheckpointError(
                f"{latest}: points to tag {tag!r} but {tag_dir} does not exist (a save interrupted before "
                "its files were written, or a partial copy). Pass an existing tag folder instead."
            )
        return tag_dir, tag
    tags = sorted(d.name for d in p.iterdir() if d.is_dir() and not d.name.startswith(STAGING_PREFIX)
                  and REPLACED_MARK not in d.name and any(_RANK_FILE.match(f.name) for f in d.iterdir()))
    if tags:
        raise CheckpointError(
            f"{p}: has no 'latest' file, so the tag to read is ambiguous; found tags {tags}. "
            f"Pass the tag folder, e.g. {p / tags[-1]}"
        )
    if (p / "mp_rank_00_model_states.pt").exists():
        raise CheckpointError(
            f"{p}: is a ZeRO-0/1/2 checkpoint (mp_rank_00_model_states.pt, no per-rank zero_pp_rank files); "
            "shardkit's reader handles ZeRO-3. Use DeepSpeed's zero_to_fp32.py for this one."
        )
    raise CheckpointError(f"{p}: no DeepSpeed ZeRO-3 checkpoint here (no 'latest' file, no zero_pp_rank_* files)")


def _numel(t: Any) -> int:
    return t.numel if isinstance(t, TensorRef) else int(t.numel())


def open_zero3_checkpoint(path: str | Path, *, torch_free: bool = False) -> Zero3Checkpoint:
    """Describe the ZeRO-3 checkpoint at ``path`` (root, tag folder or a rank file) without reading tensors.

    ``torch_free=True`` parses the files with ``read_structure`` (tensors become ``TensorRef``s
    holding file offsets) and never imports torch; ``open_rank`` is then unavailable.
    """
    if torch_free:
        load = read_structure
    else:
        def load(f: Path) -> Any:
            return safe_torch_load(f, mmap=True)
    tag_dir, tag = resolve_tag_dir(path)
    model0 = tag_dir / MODEL_FILE.format(rank=0)
    if not model0.exists():
        others = sorted(f.name for f in tag_dir.iterdir())
        raise CheckpointError(f"{model0}: missing (rank 0's model states); the folder holds {others[:8]}")
    model_state = load(model0)
    if not isinstance(model_state, dict) or "param_shapes" not in model_state:
        raise CheckpointError(f"{model0}: has no param_shapes: not a DeepSpeed ZeRO-3 model-states file")
    world = int(model_state.get("dp_world_size") or 0)
    if world < 1:
        raise CheckpointError(f"{model0}: dp_world_size is {model_state.get('dp_world_size')!r}, expected a positive int")
    if int(model_state.get("mp_world_size") or 1) != 1:
        raise CheckpointError(
            f"{model0}: mp_world_size is {model_state['mp_world_size']}; tensor/model-parallel ZeRO-3 "
            "checkpoints are not supported (only data-parallel ranks). Use ds_to_universal for those."
        )
    prefix = "bf16_" if (tag_dir / OPTIM_FILE.format(prefix="bf16_", rank=0)).exists() else ""
    model_files = [tag_dir / MODEL_FILE.format(rank=r) for r in range(world)]
    optim_files = [tag_dir / OPTIM_FILE.format(prefix=prefix, rank=r) for r in range(world)]
    for f in [*model_files, *optim_files]:
        if not f.exists():
            raise CheckpointError(
                f"{f}: missing, but dp_world_size is {world} so every rank 0..{world - 1} must have saved one. "
                "A rank died during the save or the copy is partial; resume from the previous checkpoint."
            )
    extra = sorted(
        f.name for f in tag_dir.iterdir()
        if (m := _RANK_FILE.match(f.name)) and int(m.group(2)) >= world
    )
    if extra:
        raise CheckpointError(
            f"{tag_dir}: holds rank files beyond dp_world_size={world} ({extra[:4]}): two saves at "
            "different world sizes were written into the same tag folder. Save each run to its own tag."
        )

    osd = _optimizer_sd(load(optim_files[0]), optim_files[0])
    stage = osd.get("zero_stage")
    stage_value = getattr(stage, "value", stage)
    if stage_value is not None and int(stage_value) != 3:
        raise CheckpointError(f"{optim_files[0]}: zero_stage is {stage_value}, expected 3")
    pc = osd.get("partition_count")
    if isinstance(pc, list):
        pc = max(pc)
    if pc is not None and int(pc) != world:
        raise CheckpointError(
            f"{optim_files[0]}: partition_count is {pc} but {model0.name} says dp_world_size={world}: "
            "the model and optimizer files come from different saves."
        )
    inner = osd["optimizer_state_dict"]
    param_groups = inner.get("param_groups") or []
    flats = osd["fp32_flat_groups"]
    shapes = model_state["param_shapes"]
    if len(shapes) != len(flats):
        raise CheckpointError(
            f"{tag_dir}: param_shapes has {len(shapes)} sub-groups but fp32_flat_groups has {len(flats)}"
        )
    sub_group_param_group = _sub_group_param_groups(param_groups, len(flats), optim_files[0])
    slots: list[ParamSlot] = []
    sub_group_numel: list[int] = []
    for j, group_shapes in enumerate(shapes):
        offset = 0
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            pn = partition_numel(numel, world)
            slots.append(ParamSlot(name, tuple(shape), numel, sub_group_param_group[j], j, offset, pn))
            offset += pn
        if _numel(flats[j]) != offset:
            raise CheckpointError(
                f"{optim_files[0]}: fp32 partition of sub-group {j} has {_numel(flats[j])} elements, but "
                f"param_shapes at world size {world} need {offset} (sum of ceil(numel/{world})). "
                "Unknown layout: was this written by a DeepSpeed with a different ZeRO-3 padding rule?"
            )
        sub_group_numel.append(offset)
    state = inner.get("state") or {}
    state_keys = sorted(
        {k for j, entry in state.items() for k, v in entry.items()
         if hasattr(v, "numel") and _numel(v) == sub_group_numel[j] and _numel(v) > 1}
    )
    cfg = model_state.get("ds_config")
    view = deepspeed_view(cfg if isinstance(cfg, dict) else {})
    precision = "bf16" if prefix or view.bf16 else ("fp16" if view.fp16 else "fp32")
    return Zero3Checkpoint(
        tag_dir=tag_dir,
        tag=tag,
        world_size=world,
        model_files=model_files,
        optim_files=optim_files,
        slots=slots,
        sub_group_numel=sub_group_numel,
        sub_group_param_group=sub_group_param_group,
        param_groups=[{k: v for k, v in g.items() if k != "params"} for g in param_groups],
        state_keys=state_keys,
        precision=precision,
        ds_version=model_state.get("ds_version"),
        ds_config=cfg if isinstance(cfg, dict) else {},
        model_state=model_state,
        torch_free=torch_free,
    )


def _sub_group_param_groups(param_groups: list[dict[str, Any]], n_sub: int, path: Path) -> list[int]:
    """Sub-group -> param group, from the inner optimizer's ``params`` index lists.

    DeepSpeed appends each sub-group's fp32 flat tensor to its param group in sub-group order
    (``_set_fp32_optimizer_param_groups``), so the state index of sub-group ``i`` is ``i`` only when
    the groups' index lists, concatenated, are ``0..n-1``; anything else is a layout we do not know.
    """
    if not param_groups:
        return [0] * n_sub
    owner: list[int] = []
    for g, group in enumerate(param_groups):
        owner.extend([g] * len(group.get("params", [])))
    flat_ids = [i for group in param_groups for i in group.get("params", [])]
    if flat_ids != list(range(n_sub)):
        raise CheckpointError(
            f"{path}: optimizer param groups index the sub-groups as {flat_ids}, expected 0..{n_sub - 1} in order; "
            "unknown ZeRO-3 layout"
        )
    return owner


def iter_params(
    ckpt: Zero3Checkpoint, keys: tuple[str, ...] = (FP32,), slots: list[ParamSlot] | None = None
) -> Iterator[tuple[ParamSlot, dict[str, "torch.Tensor"]]]:
    """Yield ``(slot, {key: full unpadded tensor})`` parameter by parameter, in checkpoint order.

    Every rank file is mapped once but read with ``preadv`` into the output tensor, so the pages
    of the mappings are never touched: memory stays near one parameter's tensors, whatever the
    model size. ``keys``: ``"fp32"`` (the masters) and/or optimizer state keys (``exp_avg``...).
    """
    from contextlib import ExitStack

    import torch

    with ExitStack() as stack:
        parts = [stack.enter_context(ckpt.open_rank(r)) for r in range(ckpt.world_size)]
        for slot in slots if slots is not None else ckpt.slots:
            out = {}
            for key in keys:
                full = torch.empty(slot.numel, dtype=parts[0].flat(key, slot.sub_group).dtype)
                for part in parts:
                    start, stop = slot.rank_range(part.rank)
                    if stop > start:
                        part.read_into(key, slot.sub_group, slot.offset, full.narrow(0, start, stop - start))
                out[key] = full.view(slot.shape)
            yield slot, out


def gather_param(ckpt: Zero3Checkpoint, slot: ParamSlot, key: str = FP32) -> "torch.Tensor":
    """The full, unpadded ``key`` tensor of one parameter (``iter_params`` for many)."""
    for _, tensors in iter_params(ckpt, (key,), [slot]):
        return tensors[key]
    raise AssertionError("unreachable")


def full_frozen_params(ckpt: Zero3Checkpoint) -> dict[str, "torch.Tensor"]:
    """Frozen (not optimized) parameters, reassembled from every rank's fragments."""
    import torch

    shapes = ckpt.frozen_param_shapes
    if not shapes:
        return {}
    frags = [ckpt.frozen_fragments(r) for r in range(ckpt.world_size)]
    out = {}
    for name, shape in shapes.items():
        numel = math.prod(shape)
        parts = [f[name].reshape(-1) for f in frags]
        out[name] = torch.cat(parts)[:numel].view(shape)
    return out
