"""A ZeRO-3 checkpoint ``factor`` times the size of a real one, generated at disk speed.

Every parameter's first dimension is multiplied by ``factor``; each rank's flat fp32 partitions and
optimizer moments are the source rank's own bytes repeated (byte ranges of the source files,
written through shardkit's torch-free writer: no tensor in memory, no torch import). The pickles
are the source's own (``read_structure`` -> ``pickle_structure``) with the new ``param_shapes``,
so DeepSpeed's layout rules hold: per rank ``ceil(numel / world)`` elements per parameter, the
sub-groups of the source kept. The values are not a trained model's; the files are a checkpoint
``shardkit reshard``/``verify``/``consolidate`` and DeepSpeed read like any other.

Used by benchmarks/bench_resume.py (the 10x case) and by tests that need a checkpoint big enough
to interrupt mid-write.
"""

from __future__ import annotations

import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

from shardkit.checkpoint.readers.zero3_open import open_zero3_layout
from shardkit.checkpoint.zero3.layout import partition_numel
from shardkit.storage.manifest import seal
from shardkit.storage.torch_load import ITEMSIZE, TensorRef, TorchSize, read_structure
from shardkit.storage.torch_pickle import NewTensor, pickle_structure
from shardkit.storage.torch_zip import Segment, write_torch_zip


def _repeat(ref: TensorRef, numel: int) -> NewTensor:
    """``numel`` elements: ``ref``'s bytes over and over."""
    assert ref.path is not None and ref.file_offset is not None
    unit, want = ref.numel * ref.itemsize, numel * ITEMSIZE[ref.dtype]
    segs, done = [], 0
    while done < want:
        n = min(unit, want - done)
        segs.append(Segment(ref.path, ref.file_offset, n))
        done += n
    return NewTensor(ref.dtype, numel, segs)


def scale_checkpoint(src: str | Path, dst: str | Path, factor: int, *, manifest: bool = True) -> Path:
    """Write ``src`` (a ZeRO-3 root or tag folder) scaled ``factor``x as ``dst/<tag>`` + ``dst/latest``."""
    ckpt = open_zero3_layout(src)
    if ckpt.frozen_param_shapes:
        raise ValueError(f"{src}: has frozen parameters; scaling them is not implemented")
    world = ckpt.world_size
    shapes = [OrderedDict((s.name, TorchSize((s.shape[0] * factor, *s.shape[1:]) if s.shape else (factor,)))
                          for s in ckpt.slots if s.sub_group == j) for j in range(len(ckpt.sub_group_numel))]
    sub_numel = [sum(partition_numel(_numel(shape), world) for shape in group.values()) for group in shapes]
    out = Path(dst) / ckpt.tag
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for r in range(world):
        sd: dict[str, Any] = read_structure(ckpt.optim_files[r])
        osd = sd["optimizer_state_dict"]
        osd["fp32_flat_groups"] = [_repeat(t, sub_numel[j]) for j, t in enumerate(osd["fp32_flat_groups"])]
        for j, entry in (osd["optimizer_state_dict"].get("state") or {}).items():
            for k, v in entry.items():
                if isinstance(v, TensorRef) and k in ckpt.state_keys:
                    entry[k] = _repeat(v, sub_numel[j])
        write_torch_zip(out / ckpt.optim_files[r].name, *pickle_structure(sd))
        model = read_structure(ckpt.model_files[r])
        model["param_shapes"] = shapes
        write_torch_zip(out / ckpt.model_files[r].name, *pickle_structure(model))
    (Path(dst) / "latest").write_text(ckpt.tag)
    if manifest:
        seal(out, engine="deepspeed", world_size=world, zero_stage=3, dtype=ckpt.precision)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
