"""The reader of accelerate's ``SHARDED_STATE_DICT`` saved with ``use_dcp=False`` under FSDP1 and FSDP2
(``save_fsdp_model``/``save_fsdp_optimizer``, accelerate 1.15): one ``torch.save`` per rank,
``pytorch_model_fsdp_<i>_rank<R>.bin`` (the rank's sharded model state dict) and
``optimizer_<i>_rank<R>.bin`` (``FSDP.optim_state_dict`` or FSDP2's ``get_optimizer_state_dict``:
``state.<fqn>.{step,exp_avg,...}`` and ``param_groups`` with the FQNs), as the checkpoint model (kinds
``fsdp1-sharded-bins`` and ``fsdp2-sharded-bins``).

Under FSDP1 each value is a ``ShardedTensor`` (dim-0 chunks of the parameter in its own shape, whether
FSDP1 kept flat parameters or not; ``readers.sharded_tensor_pickle`` reads the pickles without torch),
under FSDP2 a ``DTensor`` placed ``Shard(0)`` on a 1-D mesh (``readers.dtensor_pickle``, which refuses
any other placement); either way each local shard becomes one ``Piece`` of the logical tensor: its rows
are contiguous elements of the row-major tensor. Only the pickles are read, one file at a time; tensor bytes are copied later by
the writer. accelerate and torch load these files only at the same world size with a process group
up; here every rank's file is read and the pieces are checked to cover each tensor exactly once.

FSDP1 and FSDP2 write the same file names; ``hf_trainer.fsdp_files.holds_sharded_tensors`` tells them apart.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.model.tensors import Piece, SourceTensor
from shardkit.checkpoint.readers.deepspeed_scalars import step_value
from shardkit.checkpoint.readers.dtensor_pickle import read_dtensor_file
from shardkit.checkpoint.readers.fsdp1 import finish_optimizer, refuse_ids, whole_tensor
from shardkit.checkpoint.readers.sharded_tensor_pickle import ShardedRef, read_sharded_file
from shardkit.core.errors import CheckpointError
from shardkit.storage.torch_load import TensorRef

_MODEL_RANK = re.compile(r"^pytorch_model_fsdp_(\d+)_rank(\d+)\.bin$")
_OPTIM_RANK = "optimizer_{index}_rank{rank}.bin"
_RESAVE = ("Restore the file from a copy of the checkpoint, or resume it with accelerate at the world size it was "
           "saved at and save again with fsdp_state_dict_type SHARDED_STATE_DICT")


@dataclass(frozen=True)
class _Engine:
    """What differs between FSDP1's and FSDP2's per-rank files."""

    kind: str
    name: str
    values: str
    """What the sharded values are ('ShardedTensor', 'DTensor')."""
    world_from: str
    """Where the world size is recorded, as said in a refusal."""
    read: Callable[[Path, int], Any]
    """The file's object (path, the rank that saved it), every sharded value a ``ShardedRef``."""


_FSDP1 = _Engine("fsdp1-sharded-bins", "FSDP1", "ShardedTensor", "the ShardedTensor metadata records",
                 lambda path, rank: read_sharded_file(path))
_FSDP2 = _Engine("fsdp2-sharded-bins", "FSDP2", "DTensor", "the DTensors' device mesh records", read_dtensor_file)


def read_fsdp1_bins(folder: Path) -> TrainingCheckpoint:
    """FSDP1's ``use_dcp=False`` SHARDED_STATE_DICT checkpoint ``folder`` (a Trainer/accelerate
    ``checkpoint-N`` holding ``pytorch_model_fsdp_0_rank<R>.bin`` of ShardedTensors)."""
    return _read_bins(folder, _FSDP1)


def read_fsdp2_bins(folder: Path) -> TrainingCheckpoint:
    """FSDP2's ``use_dcp=False`` SHARDED_STATE_DICT checkpoint ``folder`` (its rank files hold DTensors)."""
    return _read_bins(folder, _FSDP2)


def _read_bins(folder: Path, engine: _Engine) -> TrainingCheckpoint:
    index, model_files = _model_files(folder)
    low = min(model_files)
    first = _read(engine, model_files[low], low, "model")
    world = _world_size(engine, first, model_files[low])
    _require_ranks(engine, folder, {r: p.name for r, p in model_files.items()}, world,
                   lambda r: f"pytorch_model_fsdp_{index}_rank{r}.bin", "model")
    builder = _Merge()
    for rank in range(world):
        sd = first if rank == low else _read(engine, model_files[rank], rank, "model")
        for name, value in sd.items():
            builder.add(str(name), value, model_files[rank], rank)
    weights = builder.finish()
    ckpt = TrainingCheckpoint(engine.kind, folder, weights, world_size=world, notes=[
        f"accelerate {engine.name} checkpoint {folder} saved with SHARDED_STATE_DICT and use_dcp=False "
        f"(pytorch_model_fsdp_{index}_rank*.bin, {world} rank(s)), read without torch"])
    optim = {r: folder / _OPTIM_RANK.format(index=index, rank=r) for r in range(world)}
    named = re.compile(rf"^optimizer_{index}_rank(\d+)\.bin$")  # every rank's, so a stray one is named
    present = {int(m.group(1)): e.name for e in folder.iterdir() if (m := named.match(e.name))}  # a directory: named
    if not present:
        ckpt.notes.append(f"no optimizer_{index}_rank*.bin beside the model files: saved without optimizer state")
        return ckpt
    _require_ranks(engine, folder, present, world, lambda r: optim[r].name, "optimizer")
    _read_optimizer(engine, ckpt, optim)
    return ckpt


def _model_files(folder: Path) -> tuple[int, dict[int, Path]]:
    found: dict[int, dict[int, Path]] = {}
    for entry in folder.iterdir():
        m = _MODEL_RANK.match(entry.name)
        if m:
            found.setdefault(int(m.group(1)), {})[int(m.group(2))] = entry
    if not found:
        raise CheckpointError(f"{folder}: holds no pytorch_model_fsdp_<i>_rank<R>.bin; not accelerate's SHARDED_STATE_DICT "
                              "save with use_dcp=False")
    index = min(found)  # the Trainer saves model_index 0 only
    return index, found[index]


def _read(engine: _Engine, path: Path, rank: int, what: str) -> dict[Any, Any]:
    obj = engine.read(path, rank)
    if not isinstance(obj, dict) or not obj:
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}{' (empty)' if isinstance(obj, dict) else ''}, not "
                              f"the {what} state dict accelerate's save_fsdp_{'model' if what == 'model' else 'optimizer'} "
                              "writes with use_dcp=False")
    return obj


def _world_size(engine: _Engine, sd: dict[Any, Any], path: Path) -> int:
    sizes = {v.world_size for v in sd.values() if isinstance(v, ShardedRef) and v.world_size}
    if len(sizes) != 1:
        raise CheckpointError(f"{path}: its {engine.values}s record {sorted(sizes) or 'no'} world size(s); an "
                              f"{engine.name} SHARDED_STATE_DICT save records one")
    return sizes.pop()


def _require_ranks(engine: _Engine, folder: Path, present: dict[int, str], world: int, name: Any, what: str) -> None:
    missing = [name(r) for r in range(world) if r not in present]
    extra = sorted(n for r, n in present.items() if r >= world)
    if missing:
        raise CheckpointError(f"{folder}: {', '.join(missing)} missing: the {what} was saved by {world} ranks ("
                              f"{engine.world_from} world size {world}) and every rank's file holds its own "
                              f"shards, so without it those rows are lost. {_RESAVE}. Nothing was written")
    if extra:
        raise CheckpointError(f"{folder}: {', '.join(extra)} beyond the {world} ranks {engine.world_from}: "
                              "files of two saves at different world sizes are mixed in one folder. Keep one save's "
                              "files. Nothing was written")


class _Merge:
    """Every rank's shards of each tensor, as pieces of the logical tensor, in the order first seen."""

    def __init__(self) -> None:
        self.tensors: dict[str, SourceTensor] = {}

    def add(self, name: str, value: Any, path: Path, rank: int) -> None:
        if isinstance(value, TensorRef):  # not sharded (a buffer, a scalar): every rank holds it whole
            if name not in self.tensors:
                self.tensors[name] = whole_tensor(name, value)
            return
        if not isinstance(value, ShardedRef):
            raise CheckpointError(f"{path}: entry {name!r} is a {type(value).__name__}, not a tensor or ShardedTensor; "
                                  "not a state dict FSDP writes under SHARDED_STATE_DICT")
        t = self.tensors.setdefault(name, SourceTensor(name, value.dtype, value.shape))
        if (t.dtype, t.shape) != (value.dtype, value.shape):
            raise CheckpointError(f"{path}: {name!r} is {value.dtype}{list(value.shape)} on rank {rank}, "
                                  f"{t.dtype}{list(t.shape)} on the ranks before: files of different saves are mixed")
        inner = math.prod(value.shape[1:])
        for shard in value.local:
            ref = shard.tensor
            if any(shard.offsets[1:]) or tuple(shard.sizes[1:]) != tuple(value.shape[1:]) \
                    or tuple(ref.shape) != tuple(shard.sizes) or not ref.is_contiguous() or ref.file_offset is None:
                raise CheckpointError(f"{path}: {name!r} shard at offsets {list(shard.offsets)} sizes {list(shard.sizes)} "
                                      f"({ref!r}) is not whole rows stored contiguously; FSDP shards dim 0 only")
            if ref.dtype != value.dtype:
                raise CheckpointError(f"{path}: {name!r} shard holds {ref.dtype}, the tensor {value.dtype}: the file is "
                                      "damaged")
            if ref.numel:  # a rank past the last row holds an empty shard
                t.add(Piece(Path(str(ref.path)), ref.file_offset, shard.offsets[0] * inner, ref.numel))

    def finish(self) -> dict[str, SourceTensor]:
        for t in self.tensors.values():
            if not t.covered():
                starts = sorted((p.start, p.numel) for p in t.pieces)
                raise CheckpointError(f"{t.name!r}: the ranks' shards (start, elements) {starts[:6]} do not cover its "
                                      f"{t.numel} elements exactly once: files of different saves are mixed. {_RESAVE}")
        return self.tensors


def _read_optimizer(engine: _Engine, ckpt: TrainingCheckpoint, files: dict[int, Path]) -> None:
    states: dict[str, _Merge] = {}
    steps: dict[str, float] = {}
    groups: list[dict[str, Any]] | None = None
    for rank, path in sorted(files.items()):
        osd = _read(engine, path, rank, "optimizer")
        state, param_groups = osd.get("state"), osd.get("param_groups")
        if not isinstance(state, dict) or not isinstance(param_groups, list):
            raise CheckpointError(f"{path}: holds no 'state' and 'param_groups' (keys seen: {sorted(map(str, osd))}); "
                                  "not an optimizer state dict accelerate's save_fsdp_optimizer writes")
        refuse_ids(path, [*state, *(p for g in param_groups if isinstance(g, dict) for p in g.get("params") or [])],
                    f"The weights alone are the pytorch_model_fsdp_*_rank*.bin files of {ckpt.folder}")
        named = [list(g.get("params") or []) for g in param_groups if isinstance(g, dict)]
        if groups is None:
            groups = [dict(g) for g in param_groups]
        elif named != [list(g.get("params") or []) for g in groups]:
            raise CheckpointError(f"{path}: its param_groups name other parameters than rank 0's: files of different "
                                  f"saves are mixed. {_RESAVE}")
        for name, entry in state.items():
            for key, value in (entry or {}).items():
                if key == "step":  # every rank steps every parameter: a step that differs is another save's file
                    seen = step_value(value, f"{path}: state of {name!r}")
                    if steps.setdefault(str(name), seen) != seen:
                        raise CheckpointError(f"{path}: state of {name!r}: step {seen:g}, but rank 0's file records "
                                              f"{steps[str(name)]:g}: files of different saves are mixed. {_RESAVE}")
                elif isinstance(value, (ShardedRef, TensorRef)):
                    states.setdefault(str(name), _Merge()).add(str(key), value, path, rank)
    order = {n: i for i, n in enumerate(ckpt.weights)}  # model order, as the other readers give it
    for name, merged in sorted(states.items(), key=lambda kv: order.get(kv[0], len(order))):
        ckpt.optimizer[name] = {key: SourceTensor(f"{name}.{key}", t.dtype, t.shape, t.pieces)
                                for key, t in merged.finish().items()}
    finish_optimizer(ckpt, files[0].parent, steps, groups or [])

