"""The DCP reader: an FSDP2 / torch.distributed.checkpoint checkpoint's model tensors as ``Piece``s.

The ``.metadata`` is read with the restricted, torch-free unpickler (``dcp.plain_metadata``), and each
tensor's stored chunks are located with ``dcp.slices.DcpSlices`` (dim-0 slabs in plain zip
records: one byte range each). Model tensors are the keys under ``model.`` (shardkit's
``save_fsdp_checkpoint`` saves ``{"model": ..., "optim": ...}``, accelerate's FSDP save of the
Trainer ``{"model": ...}``); the optimizer's are ignored. A tensor whose chunks cannot be read as
byte ranges is read whole through ``load_dcp_state`` (that tensor alone in memory).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkit.checkpoint.dcp.plain_metadata import read_plain_metadata
from shardkit.checkpoint.dcp.reader import METADATA_NAME, load_dcp_state
from shardkit.checkpoint.dcp.slices import DcpSlices
from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.model.tensors import Piece, SourceTensor
from shardkit.core.errors import CheckpointError

if TYPE_CHECKING:
    import torch

MODEL_PREFIX = "model."


def read_dcp(tag_dir: Path) -> TrainingCheckpoint:
    """The DCP folder ``tag_dir`` as the checkpoint model (weights only, for now)."""
    return TrainingCheckpoint("dcp", tag_dir, dcp_tensors(tag_dir), notes=[f"FSDP2/DCP checkpoint {tag_dir}"])


def dcp_tensors(tag_dir: Path) -> dict[str, SourceTensor]:
    """The model tensors of the DCP folder ``tag_dir`` (holding ``.metadata``), by name under ``model.``."""
    md = read_plain_metadata(tag_dir / METADATA_NAME)
    slices = DcpSlices(tag_dir, md)
    out: dict[str, SourceTensor] = {}
    try:
        for key, meta in md.tensors.items():
            if not key.startswith(MODEL_PREFIX):
                continue
            name = key[len(MODEL_PREFIX):]
            dtype, shape = meta.dtype, meta.size
            chunks = slices.chunks(key) if math.prod(shape) > 0 else []
            if chunks is None:
                out[name] = SourceTensor(name, dtype, shape, load=_loader(tag_dir, key, shape, dtype))
            else:
                out[name] = SourceTensor(name, dtype, shape, [Piece(c.file, c.data_offset, c.start, c.numel) for c in chunks])
    finally:
        slices.close()
    if not out:
        keys = sorted(md.keys)[:5]
        raise CheckpointError(f"{tag_dir}: a DCP checkpoint without model tensors (no key under '{MODEL_PREFIX}'; it "
                              f"holds {keys}): not a model checkpoint shardkit or the Trainer wrote (an optimizer-only "
                              "folder such as optimizer_0/?). Pass the model's folder")
    return out


def _loader(tag_dir: Path, key: str, shape: tuple[int, ...], dtype: str) -> Any:
    def load() -> "torch.Tensor":
        import torch

        holder = {key: torch.empty(shape, dtype=getattr(torch, dtype))}
        load_dcp_state(holder, tag_dir)
        return holder[key]

    return load
