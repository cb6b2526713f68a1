"""The universal reader: a DeepSpeed universal checkpoint (``python -m deepspeed.checkpoint.ds_to_universal``
output, what OpenRLHF and open-instruct produce) as the checkpoint model, without torch.

What DeepSpeed 0.19.8's ``ds_to_universal`` writes into ``<out>/`` (and ``latest_universal`` beside it):

- ``zero/<parameter>/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt`` (``step.pt`` from ZeRO-1/2): one whole,
  unpadded tensor per trainable parameter and state. From ZeRO-1/2 each file is ``{"param": tensor,
  "cat_dim": 0}`` in the parameter's shape (``merge_tp_slices``); from ZeRO-3 the bare flat tensor
  (``merge_zero3_slices``), whose shape is the model states' ``param_shapes``.
- ``zero/optimizer_state.pt``: rank 0's optimizer dict without the partitions: ``param_groups``
  (``params`` index the model states' ``param_shapes`` groups, ZeRO-3's sub-groups), the loss scaler;
  from ZeRO-3 also the per-sub-group ``step``.
- The source's model states, copied: ``mp_rank_00_model_states.pt`` from ZeRO-1/2 (the whole 16-bit
  module: frozen parameters and buffers are read there, in their saved dtype, as zero_to_fp32 does),
  ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` per rank from ZeRO-3 (frozen parameters as each
  rank's ``frozen_param_fragments``). ``shared_params`` names tied aliases (``{alias: holder}``).

ZeRO-1/2's conversion also writes an fp32-only ``zero/<name>/fp32.pt`` for every other entry of the
module (frozen parameters, buffers, tied aliases, upcast from 16 bits): those folders are known and
skipped. A trainable parameter without its ``fp32.pt``, or without a state file the others have, and a
folder the model states do not name are refused by name (a partial copy, or the wrong model states).
A checkpoint converted from a tensor-parallel run is refused: its files hold merges of TP slices
(``cat_dim``, ``sub_param_shape``, vocabulary padding stripped) in Megatron's layout, not the module's.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from shardkit.checkpoint.layout.deepspeed_files import UNIVERSAL_FOLDER, UNIVERSAL_FP32
from shardkit.checkpoint.layout.detect import LATEST_UNIVERSAL
from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.model.tensors import Piece, SourceTensor
from shardkit.checkpoint.readers.deepspeed_scalars import (
    as_dict,
    per_parameter_steps,
    run_scalars,
    step_value,
    training_precision,
)
from shardkit.checkpoint.readers.zero3 import contiguous_offset, frozen_fragments
from shardkit.core.errors import CheckpointError
from shardkit.storage.listing import list_folder
from shardkit.storage.tags import LATEST_NAME, read_latest
from shardkit.storage.torch_load import TensorRef, read_structure

#: The optimizer dict ds_to_universal writes beside the parameter folders.
OPTIMIZER_FILE = "optimizer_state.pt"
_MP_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
#: Keys of a ZeRO-1/2 atom dict for a plain data-parallel tensor; any other key (``vocab_tensor``,
#: ``sub_param_shape``, ``ep_is_expert_param``, ...) is a re-layout this reader does not undo.
_PLAIN_ATOM_KEYS = frozenset({"param", "cat_dim"})
_FP32 = Path(UNIVERSAL_FP32).stem
_STEP = "step"


def universal_tag_dir(path: Path) -> Path | None:
    """The universal checkpoint folder ``path`` designates: itself (``zero/`` beside model states), or
    the tag its ``latest_universal`` names when it has no ``latest`` (which would name the ZeRO tag) or
    ``latest`` names that tag too (``convert --to universal`` output: a sealed shardkit checkpoint)."""
    if _is_universal(path):
        return path
    if (path / LATEST_UNIVERSAL).is_file():
        tag = read_latest(path, LATEST_UNIVERSAL)
        latest = read_latest(path, LATEST_NAME) if (path / LATEST_NAME).exists() else tag
        if tag is not None and latest == tag and _is_universal(path / tag):
            return path / tag
    return None


def _is_universal(folder: Path) -> bool:
    return (folder / UNIVERSAL_FOLDER).is_dir() and any(
        _MP_MODEL.match(n) or _ZERO3_MODEL.match(n) for n in list_folder(folder).names)


def read_universal(folder: Path) -> TrainingCheckpoint:
    """Describe the universal checkpoint at ``folder`` (weights, Adam moments, scalars); nothing is written."""
    zero = folder / UNIVERSAL_FOLDER
    model_files, stage3 = _model_files(folder)
    model_state = as_dict(read_structure(model_files[0]))
    _refuse_tensor_parallel(folder, model_files, model_state)
    shapes = _param_shapes(model_files[0], model_state)
    trainable = {name: shape for group in shapes for name, shape in group.items()}
    aliases = {str(a): str(h) for a, h in as_dict(model_state.get("shared_params")).items()}
    module = as_dict(model_state.get("module"))
    buffer_names = [str(n) for n in model_state.get("buffer_names") or []]
    frozen_shapes = _frozen_shapes(model_state, module, trainable, aliases, buffer_names, stage3)
    atoms = _atoms(zero, trainable, aliases, [*frozen_shapes, *buffer_names])

    weights: dict[str, SourceTensor] = {}
    optimizer: dict[str, dict[str, SourceTensor]] = {}
    step_files: dict[str, Any] = {}
    for name, shape in trainable.items():
        weights[name] = _atom(zero / name / UNIVERSAL_FP32, name, shape, "float32")
        states = {key: _atom(zero / name / f"{key}.pt", name, shape, None) for key in atoms if key != _STEP}
        optimizer[name] = states
        if _STEP in atoms:
            step_files[name] = read_structure(zero / name / f"{_STEP}.pt")
    if stage3:
        _add_frozen_zero3(model_files, frozen_shapes, weights)
    else:
        for name in frozen_shapes:
            weights[name] = _module_tensor(model_files[0], module, name)
    buffers = set()
    for name in buffer_names:
        if isinstance(module.get(name), TensorRef):
            weights[name] = _module_tensor(model_files[0], module, name)
            buffers.add(name)

    optim = as_dict(read_structure(zero / OPTIMIZER_FILE)) if (zero / OPTIMIZER_FILE).is_file() else {}
    if not optim:
        raise CheckpointError(f"{zero / OPTIMIZER_FILE}: missing or not an optimizer dict: ds_to_universal writes it "
                              "last of the tensors, so the conversion did not finish or the copy is partial. Rerun "
                              "python -m deepspeed.checkpoint.ds_to_universal into an empty folder")
    precision = training_precision(as_dict(model_state.get("ds_config")))
    stage = _stage(optim, stage3)
    world = model_state.get("dp_world_size")
    scalars = _scalars(zero, model_state, optim, shapes, step_files, stage=stage, precision=precision)
    return TrainingCheckpoint(
        "universal", folder, weights, world_size=None, tag=folder.name, precision=precision, aliases=aliases,
        frozen=set(frozen_shapes), buffers=buffers, optimizer={n: s for n, s in optimizer.items() if s},
        optimizer_described=True, scalars=scalars,
        notes=[f"DeepSpeed universal checkpoint {folder} (ds_to_universal of a ZeRO-{stage} save at {world} rank(s), "
               f"{precision} training): fp32 masters exported"])


def _model_files(folder: Path) -> tuple[list[Path], bool]:
    """The model-states files ds_to_universal copied (ZeRO-3: one per data-parallel rank, in rank order)."""
    names = list_folder(folder).names  # the command's one listing of it (storage.listing)
    zero3 = sorted((int(m.group(1)), int(m.group(2)), n) for n in names if (m := _ZERO3_MODEL.match(n)))
    mp = sorted((int(m.group(1)), n) for n in names if (m := _MP_MODEL.match(n)))
    if mp:  # ZeRO-1/2's conversion, or shardkit's writer (which links the ZeRO-3 name to it for ZeRO-3 engines)
        return [folder / n for _, n in mp], False
    if zero3:
        ranks = sorted({r for r, _, _ in zero3})
        if ranks != list(range(len(ranks))):
            raise CheckpointError(f"{folder}: the ZeRO-3 model-states files cover data-parallel ranks {ranks}, not "
                                  f"0..{len(ranks) - 1}: a file is missing (a partial copy). Copy the whole folder "
                                  "ds_to_universal wrote")
        return [folder / n for r, mp_rank, n in zero3 if mp_rank == 0], True
    raise CheckpointError(f"{folder}: a universal checkpoint's zero/ without the model-states files ds_to_universal "
                          "copies beside it (mp_rank_00_model_states.pt or zero_pp_rank_*_model_states.pt): they name "
                          "the parameters and their shapes. Copy the whole folder ds_to_universal wrote")


def _refuse_tensor_parallel(folder: Path, model_files: list[Path], model_state: dict[str, Any]) -> None:
    """A conversion of a tensor-parallel run: its atoms are TP merges in the training code's layout."""
    dims = as_dict(model_state.get("checkpoint_parallel_dimensions"))
    tp = max(_int(model_state.get("mp_world_size")), _int(dims.get("tp_degree")))
    mp_ranks = sorted(n for n in list_folder(folder).names if _mp_rank(n) > 0)
    if tp <= 1 and not mp_ranks:
        return
    zero = folder / UNIVERSAL_FOLDER
    merged = []
    for d in sorted(p for p in zero.iterdir() if p.is_dir()):
        atom = as_dict(read_structure(d / UNIVERSAL_FP32)) if (d / UNIVERSAL_FP32).is_file() else {}
        keys = sorted(set(atom) - {"param"})
        if keys:
            merged.append(f"{d.name} ({', '.join(keys)})")
    raise CheckpointError(
        f"{folder}: converted from a tensor-parallel run (tp_degree {max(tp, len(mp_ranks) + 1)} in "
        f"{model_files[0].name}{'; also ' + ', '.join(mp_ranks[:2]) if mp_ranks else ''}): its parameters hold "
        f"merges of tensor-parallel slices{': ' + '; '.join(merged[:3]) if merged else ''}, in the training code's "
        "layout rather than the module's. shardkit reads universal checkpoints of data-parallel runs only; resume it "
        "with DeepSpeed (checkpoint.load_universal: true) at the tensor-parallel size you want")


def _param_shapes(path: Path, model_state: dict[str, Any]) -> list[dict[str, tuple[int, ...]]]:
    groups = model_state.get("param_shapes")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups) or not groups:
        raise CheckpointError(f"{path}: has no param_shapes (the trainable parameters' names and shapes DeepSpeed "
                              "saves): not the model states of a ZeRO save. Copy the model states of the run that was "
                              "converted")
    out = []
    for group in groups:
        shapes = {}
        for name, shape in group.items():
            dims = tuple(shape) if isinstance(shape, (list, tuple)) else None
            if dims is None or not all(type(d) is int and d >= 0 for d in dims):
                raise CheckpointError(f"{path}: param_shapes gives {name!r} the shape {shape!r}, expected "
                                      "non-negative ints: the file is corrupted or was edited")
            shapes[str(name)] = dims
        out.append(shapes)
    return out


def _frozen_shapes(model_state: dict[str, Any], module: dict[str, Any], trainable: dict[str, Any],
                   aliases: dict[str, str], buffers: list[str], stage3: bool) -> dict[str, tuple[int, ...]]:
    """Frozen parameters: ZeRO-3's ``frozen_param_shapes``; ZeRO-1/2's module entries that are neither
    trainable, tied aliases nor buffers (ZeRO-1 records no frozen_param_shapes; the module holds them whole)."""
    if stage3:
        return {str(n): tuple(s) for n, s in as_dict(model_state.get("frozen_param_shapes")).items()}
    return {n: tuple(t.shape) for n, t in module.items() if isinstance(t, TensorRef)
            and n not in trainable and n not in aliases and n not in buffers}


def _atoms(zero: Path, trainable: dict[str, Any], aliases: dict[str, str], others: list[str]) -> list[str]:
    """The state files every trainable parameter has (``exp_avg``, ``exp_avg_sq``, ``step``), after
    refusing a parameter without ``fp32.pt``, one lacking a file the others have, and a stray folder."""
    if not zero.is_dir():
        raise CheckpointError(f"{zero}: missing; a universal checkpoint keeps its tensors there")
    missing = [n for n in trainable if not (zero / n / UNIVERSAL_FP32).is_file()]
    if missing:
        raise CheckpointError(
            f"{zero}: no {UNIVERSAL_FP32} for {len(missing)} trainable parameter(s) the model states name: "
            f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}: the conversion did not finish or the "
            "copy is partial, and a model without them would load random weights. Rerun "
            "python -m deepspeed.checkpoint.ds_to_universal into an empty folder; nothing was written")
    files = {n: {f.stem for f in (zero / n).iterdir() if f.suffix == ".pt"} for n in trainable}
    keys = sorted(set().union(*files.values()) - {_FP32}) if files else []
    lacking = [f"{n} (no {', '.join(sorted(set(keys) - have))})" for n, have in files.items() if set(keys) - have]
    if lacking:
        raise CheckpointError(
            f"{zero}: {len(lacking)} parameter(s) lack optimizer state the others have: {'; '.join(lacking[:5])}"
            f"{' ...' if len(lacking) > 5 else ''}: a partial copy, or a conversion interrupted mid-way. Copy the "
            "whole folder or rerun ds_to_universal; nothing was written")
    known = {*trainable, *aliases, *others}
    stray = sorted(d.name for d in zero.iterdir() if d.is_dir() and d.name not in known)
    if stray:
        raise CheckpointError(
            f"{zero}: holds parameter folder(s) the model states do not name: {', '.join(stray[:5])}"
            f"{' ...' if len(stray) > 5 else ''}: the model-states files beside zero/ come from another run or "
            "model. Copy the model states of the run that was converted; nothing was written")
    return keys


def _atom(path: Path, name: str, shape: tuple[int, ...], dtype: str | None) -> SourceTensor:
    """One tensor file of ``zero/<name>/`` as a single piece, checked against the parameter's shape."""
    obj = read_structure(path)
    if isinstance(obj, dict):
        extra = sorted(set(obj) - _PLAIN_ATOM_KEYS)
        if extra:
            raise CheckpointError(
                f"{path}: parameter {name!r} carries {', '.join(map(str, extra))}: ds_to_universal re-laid it out "
                "(a padded vocabulary, fused sub-parameters, expert or tensor-parallel metadata), and the module "
                "holds it otherwise. shardkit reads plain data-parallel universal checkpoints; resume it with "
                "DeepSpeed (checkpoint.load_universal: true)")
        obj = obj.get("param")
    numel = math.prod(shape)
    if not isinstance(obj, TensorRef) or obj.numel != numel or (len(obj.shape) > 1 and obj.shape != shape):
        raise CheckpointError(f"{path}: parameter {name!r} is {obj!r} here but {list(shape)} in the model states: the "
                              "files come from different runs or the file is damaged; nothing was written")
    if dtype is not None and obj.dtype != dtype:
        raise CheckpointError(f"{path}: parameter {name!r} is {obj.dtype}, expected {dtype} (universal checkpoints "
                              "hold fp32 masters); not a file ds_to_universal wrote")
    if obj.file_offset is None or not obj.is_contiguous():
        raise CheckpointError(f"{path}: parameter {name!r} is not stored contiguously; not a file ds_to_universal wrote")
    return SourceTensor(name, obj.dtype, shape, [Piece(path, obj.file_offset, 0, numel)] if numel else [])


def _module_tensor(path: Path, module: dict[str, Any], name: str) -> SourceTensor:
    ref = module.get(name)
    if not isinstance(ref, TensorRef) or ref.file_offset is None or not ref.is_contiguous():
        raise CheckpointError(f"{path}: module entry {name!r} is not one contiguous tensor ({ref!r}); the file is "
                              "damaged or not DeepSpeed's")
    return SourceTensor(name, ref.dtype, tuple(ref.shape), [Piece(path, ref.file_offset, 0, ref.numel)] if ref.numel else [])


def _add_frozen_zero3(model_files: list[Path], shapes: dict[str, tuple[int, ...]], weights: dict[str, SourceTensor]) -> None:
    """ZeRO-3 frozen parameters: each rank's fragment (``ceil(numel / world)``, the tail padded)."""
    for rank, path in enumerate(model_files):
        dtypes = {n: weights[n].dtype for n in shapes if n in weights}
        found = frozen_fragments(path, read_structure(path) if shapes else {}, shapes, rank, len(model_files), dtypes)
        for name, (ref, start, stop) in found.items():
            t = weights.setdefault(name, SourceTensor(name, ref.dtype, shapes[name]))
            if stop > start:
                t.add(Piece(path, contiguous_offset(ref), start, stop - start))


def _stage(optim: dict[str, Any], stage3: bool) -> int:
    value = optim.get("zero_stage")
    value = getattr(value, "value", value)
    return value if isinstance(value, int) and not isinstance(value, bool) else (3 if stage3 else 2)


def _scalars(zero: Path, model_state: dict[str, Any], optim: dict[str, Any], shapes: list[dict[str, Any]],
             step_files: dict[str, Any], *, stage: int, precision: str) -> dict[str, Any]:
    """Steps per parameter, param groups with their parameters' names, and the run's values."""
    where = zero / OPTIMIZER_FILE
    inner = as_dict(optim.get("optimizer_state_dict"))
    groups = optim.get("param_groups") or inner.get("param_groups") or []
    named_groups = []
    for g, group in enumerate(groups if isinstance(groups, list) else []):
        index = group.get("params") if isinstance(group, dict) else None
        if not isinstance(index, list) or not all(isinstance(i, int) and 0 <= i < len(shapes) for i in index):
            raise CheckpointError(f"{where}: param group {g} indexes {index!r}, not groups of the model states' "
                                  f"{len(shapes)} param_shapes; the files come from different runs")
        named_groups.append({**{k: v for k, v in group.items() if k != "params"},
                             "params": [n for i in index for n in shapes[i]]})
    if step_files:
        steps = {n: step_value(v, str(zero / n / f"{_STEP}.pt")) for n, v in step_files.items()}
    else:  # ZeRO-3: one step per sub-group, in the optimizer dict
        state: dict[Any, Any] = as_dict(inner.get("state"))  # keyed by sub-group index
        per_group = [step_value(as_dict(state.get(j)).get(_STEP, 0), f"{where}: sub-group {j}") for j in range(len(shapes))]
        steps = per_parameter_steps([list(g) for g in shapes], per_group)
    cfg = as_dict(model_state.get("ds_config"))
    ds_version = model_state.get("ds_version")
    out = run_scalars(model_state, cfg, optim, zero_stage=stage, precision=precision, step=steps, param_groups=named_groups,
                      ds_version=ds_version if isinstance(ds_version, str) else None)
    out["source"]["format"] = "universal"
    out["source"]["dp_world_size"] = model_state.get("dp_world_size")
    return out


def _mp_rank(name: str) -> int:
    """The tensor-parallel rank of a model-states file name (-1 for other files)."""
    if m := _MP_MODEL.match(name):
        return int(m.group(1))
    if m := _ZERO3_MODEL.match(name):
        return int(m.group(2))
    return -1


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
