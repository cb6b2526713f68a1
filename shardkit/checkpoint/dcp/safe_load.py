"""Load a ``torch.distributed.checkpoint`` (DCP) directory without running code from it.

Plain ``dcp.load(state, checkpoint_id=path)`` unpickles two things with no restriction:

- ``FileSystemReader.read_metadata`` does ``pickle.load`` of ``<path>/.metadata``
  (torch/distributed/checkpoint/filesystem.py, torch 2.13), so a crafted ``.metadata`` runs
  arbitrary code on every rank the moment a run resumes;
- ``DefaultLoadPlanner.load_bytes`` does ``torch.load(value, weights_only=False)`` for every
  non-tensor item (optimizer hyperparameters, user objects; default_planner.py).

``load_dcp_state`` reads the same files through ``SafeFileSystemReader`` (a restricted unpickler
that resolves only the globals real DCP metadata holds, refusing any other *before* calling it) and
``SafeLoadPlanner`` (``weights_only=True`` for bytes items). Tensor items are already read by torch
with ``weights_only=True``.

The allow-list is what the ``.metadata`` of real FSDP2 model + AdamW saves (torch 2.13) contains,
found by recording every ``find_class`` call: the dataclasses of
``torch.distributed.checkpoint.metadata``, ``filesystem._StorageInfo``, ``torch.Size``, dtypes,
``torch.serialization._get_layout`` (looks a layout up by name) and ``pathlib`` paths
(``StorageMeta.checkpoint_id``). ``collections.OrderedDict`` is allowed for older writers.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from pathlib import Path
from typing import Any, Iterator

from shardkit.checkpoint.dcp.plain_metadata import (
    METADATA_CLASSES,
    METADATA_NAME,
    READ_ERRORS,
    not_metadata,
    plain_global,
    refused_global,
    unreadable,
)
from shardkit.core.errors import CheckpointError
from shardkit.core.files import open_regular
from shardkit.platform.dist import rank_world


def _allowed_global(module: str, name: str) -> Any | None:
    """The object ``module.name`` resolves to when it is allowed in DCP metadata, else None."""
    import torch

    if module == "torch.distributed.checkpoint.metadata" and name in METADATA_CLASSES:
        import torch.distributed.checkpoint.metadata as md

        return getattr(md, name, None)
    if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        return _StorageInfo
    if module == "torch" and name == "Size":
        return torch.Size
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    if module == "torch.serialization" and name == "_get_layout":
        return torch.serialization._get_layout
    return plain_global(module, name)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, fh: Any, source: str):
        super().__init__(fh)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed_global(module, name)
        if obj is None:
            raise refused_global(self._source, module, name)
        return obj


def read_dcp_metadata(path: str | os.PathLike[str]) -> Any:
    """Unpickle ``path`` (a DCP ``.metadata`` file) with the allow-list; CheckpointError naming the
    file and the global for anything outside it, or for a damaged file."""
    p = Path(path)
    try:
        with open_regular(p) as fh:
            md = _MetadataUnpickler(fh, str(p)).load()
    except CheckpointError:
        raise
    except READ_ERRORS as exc:
        raise unreadable(p, exc) from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(md, Metadata):
        raise not_metadata(p, md)
    return md


def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.metadata import StorageMeta

    class RegularFiles(FileSystem):
        """torch's FileSystem whose reads open through core.files.open_regular: a FIFO or device in place of
        a .distcp file is named, never waited on (torch's own ``path.open`` would block on a FIFO for ever)."""

        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            if "r" in mode and "+" not in mode:
                with open_regular(path) as stream:
                    yield stream
            else:
                with super().create_stream(path, mode) as stream:
                    yield stream

    class SafeFileSystemReader(FileSystemReader):
        """FileSystemReader whose ``read_metadata`` uses the restricted unpickler and whose files are opened by
        ``RegularFiles``; ``reading`` is the storage item (file, offset, length) it read last, so a failure
        names the file it came from."""

        reading: Any = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.fs = RegularFiles()

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            # torch's read_data names no file when an item's bytes fail to load (a zeroed range gives
            # an UnpicklingError from torch.load): remember which one is being read
            self.reading = sinfo
            return super()._slice_file(file, sinfo)

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            # torch 2.6's reader has no _get_metadata_path (nor per-rank metadata): its file is .metadata
            has_rank_paths = hasattr(self, "_get_metadata_path")
            path = self._get_metadata_path(kwargs.get("rank")) if has_rank_paths else self.fs.concat_path(self.path, ".metadata")
            md = read_dcp_metadata(path)
            # what FileSystemReader.read_metadata does after unpickling
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeFileSystemReader


def _planner_class() -> type:
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DefaultLoadPlanner whose ``load_bytes`` uses ``torch.load(weights_only=True)``."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise CheckpointError(
                    f"DCP item {fqn!r}: refused to load: it holds objects outside torch's weights_only "
                    f"allow-list ({detail}). Save only tensors and plain data, or load it yourself if you "
                    "trust its source") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafeLoadPlanner


def load_dcp_state(state: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """``dcp.load(state, checkpoint_id=path)`` with nothing in the checkpoint able to run code:
    fills ``state`` (this run's shards, any world size) in place. Collective when a process group
    exists. Raises CheckpointError naming ``.metadata`` and the global for a poisoned pickle."""
    import torch.distributed.checkpoint as dcp

    p = Path(path)
    if not (p / METADATA_NAME).is_file():
        raise CheckpointError(f"{p / METADATA_NAME}: missing; {p} is not a complete DCP checkpoint directory "
                              "(the save did not complete, or the path is a parent folder). Pass the tag folder "
                              "holding .metadata")
    # Every rank reads the metadata itself first (small): a poisoned file is refused on all ranks
    # with the same CheckpointError, before dcp.load's collectives (which would wrap rank 0's error).
    read_dcp_metadata(p / METADATA_NAME)
    from torch.distributed.checkpoint.api import CheckpointException

    reader = _reader_class()(str(p))
    try:
        dcp.load(state, storage_reader=reader, planner=_planner_class()())
    except CheckpointException as exc:
        # DCP gathers every rank's failure and raises them, wrapped, on all ranks: surface ours
        # (the lowest rank's) as the one CheckpointError every rank raises.
        ours = [(r, e) for r, (e, _tb) in sorted(exc.failures.items()) if isinstance(e, CheckpointError)]
        if ours:
            raise CheckpointError(f"rank {ours[0][0]}: {ours[0][1]}") from None
        rank, (first, _tb) = sorted(exc.failures.items())[0]
        if isinstance(first, Exception):  # an interrupt or exit inside a rank goes on as itself
            raise _load_failure(p, rank, first, reader.reading if rank == rank_world()[0] else None) from None
        raise


def _load_failure(p: Path, rank: int, first: Exception, reading: Any) -> CheckpointError:
    """What a failed ``dcp.load`` says: the ``.distcp`` item it was reading when it failed (a zeroed or
    flipped item makes torch.load raise, a bare UnpicklingError or RuntimeError wrapped in DCP's
    CheckpointException, a BaseException), else ``.metadata`` (its chunks, sizes or storage entries do
    not fit together: DCP's planner trusts them)."""
    text = str(first)
    # torch.load's weights-only refusal opens with a paragraph on its default; what failed follows this tag
    text = text.split("WeightsUnpickler error:", 1)[-1]
    detail = [line for line in text.strip().splitlines() if line.strip()]
    seen = f"{type(first).__name__}: {detail[0].strip()[:300] if detail else 'no detail'}"
    if reading is not None:
        at, length = getattr(reading, "offset", None), getattr(reading, "length", None)
        return CheckpointError(
            f"{p / str(reading.relative_path)}: rank {rank}: torch's DCP load failed on the item at bytes {at}.."
            f"{None if at is None or length is None else at + length} that .metadata places there ({seen}): the "
            "file is damaged there (a truncated, zeroed or flipped copy), or .metadata describes another save. "
            "Re-copy the checkpoint, or resume from the previous one")
    # DCP's planner and reader trusting a .metadata whose chunks, sizes or storage entries do not fit
    # together (an edited or bit-flipped file the manifest vouched for): named, not a wrapped traceback
    return CheckpointError(
        f"{p / METADATA_NAME}: rank {rank}: torch's DCP load failed on it ({seen}): its chunks, sizes or storage "
        "entries do not describe the files beside it. The checkpoint is corrupted or was edited; re-copy it or "
        "resume from the previous one")
