"""``convert_zero3_to_dcp`` without torch: the DCP output's items as byte ranges of the ZeRO-3
rank files, and their files.

The rank files are parsed by ``read_structure`` (no ``import torch``, no tensor unpickled): each
parameter's fp32 master and Adam moments are, rank by rank, its unpadded piece of the rank's flat
partition (``ParamSlot.rank_range`` at ``slot.offset``), so each tensor item is a ``SegmentedRecord``
of those ranges, copied into its own ``.distcp`` file through one 1 MiB buffer per writer thread,
crc'd and hashed as written, fsynced by its writer (``dcp_format.write_tensor_file``,
``stream.write_parallel``); each file's ranges are built by the thread writing it, after every
rank's partitions were checked once (``_check_flats``), so nothing grows as ranks x tensors. Frozen parameters come from the model-states files' fragments the same
way; tied aliases get their owner's ranges. The small items (``step`` per parameter, buffers,
param-group values) go together into ``__0_0.distcp``, and ``.metadata`` is pickled without torch
(``dcp_format``). The values are those of the torch route (``zero3_to_dcp_source`` +
``zero3_to_dcp_write``), tensor for tensor (tests/test_convert_zero3_to_fsdp.py, tests/test_convert_dcp_format.py).

What the bytes alone cannot express is left to the torch route, named by ``dcp_items``'s answer:
a rank's flat partition that is not one contiguous run of the rank 0 dtype (a checkpoint whose
ranks disagree needs a cast), a ``step`` saved as a tensor, a non-contiguous buffer or fragment,
a param-group value that is not plain data.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, cast

from shardkit.checkpoint.dcp.reader import METADATA_NAME
from shardkit.checkpoint.ops.convert.dcp_format import (
    Stored,
    TensorItem,
    ValueItem,
    append_item,
    is_plain,
    metadata_pickle,
    write_tensor_file,
)
from shardkit.checkpoint.ops.convert.names import ADAM_STATE_KEYS, MODEL_KEY, OPTIM_KEY, dcp_model_key, dcp_optim_key
from shardkit.checkpoint.ops.convert.zero3_to_dcp_plan import DcpTarget
from shardkit.checkpoint.zero3.checkpoint import FP32, ParamSlot, Zero3Checkpoint, zero3_optimizer_sd
from shardkit.checkpoint.zero3.layout import partition_numel, rank_range
from shardkit.core import progress
from shardkit.storage.atomic import disk_full_named
from shardkit.storage.digest import default_algorithm, new_hasher
from shardkit.storage.manifest import FileEntry
from shardkit.storage.stream import FileJob, write_parallel
from shardkit.storage.torch_load import TensorRef, read_structure
from shardkit.storage.torch_zip import Segment, SegmentedRecord

#: The file holding the small items (the name DCP's writer gives rank 0's first file).
SMALL_FILE = "__0_0.distcp"


@dataclass
class DcpItems:
    """Everything the output holds, before a byte is written."""

    big: list[TensorItem] = field(default_factory=list)
    """Masters, moments, frozen parameters, aliases: one ``.distcp`` file each."""
    small: list[TensorItem | ValueItem] = field(default_factory=list)
    """``step``, buffers, param-group values: together in ``SMALL_FILE``."""



def steps_not_plain(optim0: dict[str, Any]) -> str | None:
    """Why the sub-groups' ``step`` cannot be read without torch (a tensor step), else None."""
    state = optim0["optimizer_state_dict"].get("state") or {}
    for j, entry in state.items():
        step = (entry or {}).get("step", 0)
        if type(step) not in (int, float):
            return f"sub-group {j}'s step is a {type(step).__name__}, not a number"
    return None


class _Flats:
    """Every rank's flat partitions as ``TensorRef``s (each optim file parsed once, without torch)."""

    def __init__(self, ckpt: Zero3Checkpoint, optim0: dict[str, Any]):
        self.ckpt = ckpt
        self._osd: dict[int, dict[str, Any]] = {0: optim0}

    def _rank(self, rank: int) -> dict[str, Any]:
        if rank not in self._osd:
            path = self.ckpt.optim_files[rank]
            self._osd[rank] = zero3_optimizer_sd(read_structure(path), path)
        return self._osd[rank]

    def flat(self, rank: int, key: str, sub_group: int) -> TensorRef | str:
        osd = self._rank(rank)
        if key == FP32:
            flats = osd.get("fp32_flat_groups") or []
            t = flats[sub_group] if sub_group < len(flats) else None
        else:
            t = ((osd["optimizer_state_dict"].get("state") or {}).get(sub_group) or {}).get(key)
        where = f"{self.ckpt.optim_files[rank].name}: {key} of sub-group {sub_group}"
        if not isinstance(t, TensorRef) or t.file_offset is None or t.path is None:
            return f"{where} is not a tensor stored in the file"
        if t.numel != self.ckpt.sub_group_numel[sub_group] or not t.is_contiguous():
            return f"{where} is not one contiguous run of {self.ckpt.sub_group_numel[sub_group]} elements"
        return t


def _check_flats(flats: _Flats, keys: tuple[str, ...]) -> dict[tuple[str, int], str] | str:
    """Every rank's ``keys`` partitions of every sub-group checked once (a tensor stored in its file,
    one contiguous run, rank 0's dtype): their dtypes, or why the bytes cannot be copied as they are.
    Checked per (rank, sub-group), so the byte ranges of each tensor can be built later by the
    thread writing it, never all at once: they grow as ranks x tensors."""
    ckpt = flats.ckpt
    dtypes: dict[tuple[str, int], str] = {}
    for j in range(len(ckpt.sub_group_numel)):
        for key in keys:
            for rank in range(ckpt.world_size):
                t = flats.flat(rank, key, j)
                if isinstance(t, str):
                    return t
                dtype = dtypes.setdefault((key, j), t.dtype)
                if t.dtype != dtype:
                    return f"{ckpt.optim_files[rank].name}: {key} of sub-group {j} is {t.dtype}, rank 0's is {dtype}"
    return dtypes


def _slot_record(flats: _Flats, slot: ParamSlot, key: str) -> SegmentedRecord:
    """``slot``'s ``key`` tensor as byte ranges of the rank files, in element order, padding left
    out (each rank's piece is contiguous in its flat partition; checked by ``_check_flats``)."""
    segments = []
    for rank in range(flats.ckpt.world_size):
        start, stop = slot.rank_range(rank)
        if stop > start:
            t = flats.flat(rank, key, slot.sub_group)
            assert isinstance(t, TensorRef) and t.path is not None and t.file_offset is not None
            segments.append(Segment(t.path, t.file_offset + slot.offset * t.itemsize, (stop - start) * t.itemsize))
    return SegmentedRecord(sum(s.nbytes for s in segments), segments)


def _check_frozen(ckpt: Zero3Checkpoint, models: list[dict[str, Any]], name: str, pn: int) -> str:
    """Every rank's fragment of frozen parameter ``name``: contiguous, ``pn`` elements, one dtype
    (returned), else why not (prefixed with ``!``)."""
    dtype = None
    for rank, sd in enumerate(models):
        frag = (sd.get("frozen_param_fragments") or {}).get(name)
        if not isinstance(frag, TensorRef) or not frag.is_contiguous() or frag.numel != pn or frag.file_offset is None:
            return f"!{ckpt.model_files[rank].name}: frozen_param_fragments[{name!r}] is not a contiguous tensor of {pn} elements"
        if dtype is not None and frag.dtype != dtype:
            return f"!{ckpt.model_files[rank].name}: frozen parameter {name} is {frag.dtype}, rank 0's is {dtype}"
        dtype = frag.dtype
    assert dtype is not None
    return dtype


def _frozen_record(models: list[dict[str, Any]], name: str, numel: int, pn: int) -> SegmentedRecord:
    """Frozen parameter ``name`` as each rank's fragment without its padding, in rank order."""
    segments = []
    for rank, sd in enumerate(models):
        frag = sd["frozen_param_fragments"][name]
        start, stop = rank_range(rank, pn, numel)
        if stop > start:
            segments.append(Segment(frag.path, frag.file_offset, (stop - start) * frag.itemsize))
    return SegmentedRecord(sum(s.nbytes for s in segments), segments)


def _whole(ref: Any) -> SegmentedRecord | None:
    """A contiguous tensor's own bytes in its file."""
    if not isinstance(ref, TensorRef) or not ref.is_contiguous() or ref.file_offset is None or ref.path is None:
        return None
    nbytes = ref.numel * ref.itemsize
    return SegmentedRecord(nbytes, [Segment(ref.path, ref.file_offset, nbytes)])


def dcp_items(ckpt: Zero3Checkpoint, optim0: dict[str, Any], plan: DcpTarget) -> DcpItems | str:
    """The items of the output (``ckpt`` opened with ``torch_free=True``; ``optim0``: rank 0's
    ``optimizer_state_dict`` read by ``read_structure``), or why the torch route must write them."""
    names = plan.names
    flats = _Flats(ckpt, optim0)
    out = DcpItems()
    by_fqn: dict[str, TensorItem] = {}
    keys = (FP32, *ADAM_STATE_KEYS)
    dtypes = _check_flats(flats, keys)
    if isinstance(dtypes, str):
        return dtypes
    for slot in ckpt.slots:
        fqn = names.fsdp_name(slot.name)
        for key in keys:
            # the ranges are built by the thread writing the file (partial): at 1,024 ranks a tensor
            # has 1,024 of them, and all tensors' at once would grow as ranks x tensors
            record = partial(_slot_record, flats, slot, key)
            dtype = dtypes[(key, slot.sub_group)]
            if key == FP32:
                item = by_fqn[fqn] = TensorItem(dcp_model_key(fqn), (MODEL_KEY, fqn), dtype, slot.shape, record)
            else:
                item = TensorItem(dcp_optim_key(fqn, key), (OPTIM_KEY, "state", fqn, key), dtype, slot.shape, record)
            out.big.append(item)
        # torch.tensor(step, dtype=torch.float32): the same rounding as struct's "f"
        out.small.append(TensorItem(dcp_optim_key(fqn, "step"), (OPTIM_KEY, "state", fqn, "step"), "float32", (),
                                    struct.pack("<f", plan.steps[slot.sub_group])))
    if ckpt.frozen_param_shapes:
        models = [ckpt.model_state if r == 0 else read_structure(ckpt.model_files[r]) for r in range(ckpt.world_size)]
        for name, shape in ckpt.frozen_param_shapes.items():
            numel = 1
            for d in shape:
                numel *= d
            pn = partition_numel(numel, ckpt.world_size)
            dtype = _check_frozen(ckpt, models, name, pn)
            if dtype.startswith("!"):
                return dtype[1:]
            fqn = names.fsdp_name(name)
            by_fqn[fqn] = TensorItem(dcp_model_key(fqn), (MODEL_KEY, fqn), dtype, tuple(shape),
                                     partial(_frozen_record, models, name, numel, pn))
            out.big.append(by_fqn[fqn])
    buffers: dict[str, Any] = dict(ckpt.buffers())  # TensorRefs (``ckpt`` opened torch-free)
    for name, ref in buffers.items():
        whole = _whole(ref)
        if whole is None:
            return f"buffer {name} is not a contiguous tensor stored in {ckpt.model_files[0].name}"
        fqn = names.fsdp_name(name)
        out.small.append(TensorItem(dcp_model_key(fqn), (MODEL_KEY, fqn), ref.dtype, tuple(ref.shape), whole))
    for alias, owner in names.aliases.items():
        src = by_fqn[owner]
        out.big.append(TensorItem(dcp_model_key(alias), (MODEL_KEY, alias), src.dtype, src.shape, src.data))
    for i, group in enumerate(plan.groups):
        for key, value in group.items():
            if not is_plain(value):
                return f"param_groups[{i}].{key} is a {type(value).__name__}, not plain data"
            out.small.append(ValueItem(f"{OPTIM_KEY}.param_groups.{i}.{key}", (OPTIM_KEY, "param_groups", i, key), value))
    return out


def file_names(items: DcpItems) -> dict[str, str]:
    """Each big tensor's file (the same in every process): ``__0_<n>.distcp`` in item order, as DCP's
    writer numbers rank 0's files (``SMALL_FILE`` is ``__0_0``)."""
    return {item.key: f"__0_{n + 1}.distcp" for n, item in enumerate(items.big)}


def write_tensor_files(path: Path, share: list[TensorItem], names: dict[str, str], outcome: str,
                       workers: int) -> list[FileEntry]:
    """This process's big tensors, each its own file in the staging folder ``path``, ``workers`` at
    a time (largest first, so the last files to finish are small ones and no thread idles long)."""
    order = sorted(share, key=lambda it: -it.nbytes)
    jobs: list[FileJob] = [(path / names[it.key], partial(_write_one, it)) for it in order]
    progress.expect(sum(it.nbytes for it in order))
    written = write_parallel(jobs, workers, outcome=outcome, thread_name="shardkit-convert")
    return [FileEntry.of(names[it.key], done.size, done.algorithm, done.digest)
            for it, done in zip(order, written, strict=True)]


def write_small_and_metadata(path: Path, items: DcpItems, names: dict[str, str], written: list[FileEntry],
                             outcome: str) -> list[FileEntry]:
    """Process 0, once every big file is written (``written``: their sizes, from every process):
    ``SMALL_FILE`` and ``.metadata``, fsynced, described for the manifest."""
    sizes = {e.path: e.size for e in written}
    stored = {item.key: Stored(names[item.key], 0, sizes[names[item.key]]) for item in items.big}
    out = []
    with disk_full_named(path / SMALL_FILE, outcome), open(path / SMALL_FILE, "wb") as raw:
        hashing = _Hashing(raw)
        for item in items.small:
            at = hashing.size
            stored[item.key] = Stored(SMALL_FILE, at, append_item(cast(BinaryIO, hashing), item))
        raw.flush()
        os.fsync(raw.fileno())
    out.append(FileEntry.of(SMALL_FILE, hashing.size, hashing.algorithm, hashing.sha.hexdigest()))
    tensors = [t for t in [*items.big, *items.small] if isinstance(t, TensorItem)]
    values = [v for v in items.small if isinstance(v, ValueItem)]
    body = metadata_pickle(tensors, values, stored, path)
    with disk_full_named(path / METADATA_NAME, outcome), open(path / METADATA_NAME, "wb") as fh:
        fh.write(body)
        fh.flush()
        os.fsync(fh.fileno())
    meta_hash = new_hasher(hashing.algorithm)
    meta_hash.update(body)
    out.append(FileEntry.of(METADATA_NAME, len(body), hashing.algorithm, meta_hash.hexdigest()))
    return out


class _Hashing:
    """The small file's bytes, hashed as they are appended (for the manifest)."""

    def __init__(self, raw: BinaryIO):
        self.algorithm = default_algorithm()
        self.raw, self.sha, self.size = raw, new_hasher(self.algorithm), 0

    def write(self, data: bytes | memoryview) -> int:
        self.sha.update(data)
        n = len(memoryview(data).cast("B"))
        done = self.raw.write(data)
        if done is not None and done != n:
            raise OSError(f"short write to {getattr(self.raw, 'name', SMALL_FILE)}")
        self.size += n
        return n


def _write_one(item: TensorItem, out: Path) -> Any:
    return write_tensor_file(out, item)
