"""The readers of the FSDP checkpoints the Hugging Face Trainer and Accelerate's FSDP plugin write
(``accelerate.utils.save_fsdp_model``/``save_fsdp_optimizer``; ``hf_trainer.fsdp_files`` tells the
layouts apart), as the checkpoint model:

- ``fsdp1-sharded`` (``SHARDED_STATE_DICT``, the default): the model DCP folder
  ``pytorch_model_fsdp_<i>/`` (``{"model": ...}``, read by ``readers.dcp.dcp_tensors``) and its
  sibling ``optimizer_<i>/``, ``dcp.save({"optimizer": FSDP.optim_state_dict(model, optim)})``:
  ``optimizer.state.<fqn>.{step,exp_avg,exp_avg_sq}`` as dim-0 chunks in the parameter's shape and
  ``optimizer.param_groups.<g>.<key>`` (``params``: the FQNs) as plain values. The same keys
  whether FSDP1 kept its flat parameters (``use_orig_params=False``) or not, and under FSDP2.
- ``fsdp1-full`` (``FULL_STATE_DICT``): ``pytorch_model_fsdp.bin`` (rank 0's ``torch.save`` of the
  full state dict) and ``optimizer.bin`` (the full optimizer state, keyed the same way), parsed
  with ``read_structure`` (no torch, no tensor bytes read): each tensor one byte range.

The optimizer must be keyed by parameter names, as ``FSDP.optim_state_dict`` keys it. torch's own
``optimizer.state_dict()`` keys by position among the parameters it was given, which under FSDP1
are flat parameters holding several original ones: which element belongs to which parameter is not
recorded, so such a file is refused by name. ``LOCAL_STATE_DICT`` (each rank's flat shard, without
the parameter names and shapes inside it) is refused where it is resolved (``export.sources``).

Scalars are in ``readers.deepspeed_scalars``' words: ``step`` per parameter, ``param_groups``
(``params`` as names), ``source``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from shardkit.checkpoint.dcp.plain_metadata import METADATA_NAME, DcpMetadata, read_plain_metadata
from shardkit.checkpoint.dcp.slices import DcpSlices
from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.model.tensors import Piece, SourceTensor, same_bytes
from shardkit.checkpoint.readers.dcp import dcp_tensor, dcp_tensors
from shardkit.checkpoint.readers.deepspeed_scalars import step_value
from shardkit.core.errors import CheckpointError
from shardkit.storage.torch_load import TensorRef, read_structure

#: accelerate's ``FSDP_MODEL_NAME``/``OPTIMIZER_NAME`` (``utils/constants.py``).
MODEL_FILE = "pytorch_model_fsdp.bin"
OPTIMIZER_FILE = "optimizer.bin"
_OPTIM_ROOT = "optimizer"
_MODEL_DIR = re.compile(r"^pytorch_model_fsdp_(\d+)$")
_IDS_FIX = ("save it with accelerate's save_fsdp_optimizer (Accelerator.save_state, the Trainer) or "
            "FSDP.optim_state_dict(model, optimizer), which key the state by parameter names")


def read_fsdp1_sharded(model_dir: Path) -> TrainingCheckpoint:
    """The SHARDED_STATE_DICT checkpoint whose model DCP folder is ``model_dir``
    (``.../checkpoint-N/pytorch_model_fsdp_0``), with the optimizer of its sibling ``optimizer_<i>/``."""
    weights = dcp_tensors(model_dir)
    ranks = sum(1 for f in model_dir.iterdir() if f.name.endswith(".distcp")) or None
    ckpt = TrainingCheckpoint("fsdp1-sharded", model_dir, weights, world_size=ranks, notes=[
        f"accelerate FSDP checkpoint {model_dir.parent} saved with SHARDED_STATE_DICT ({model_dir.name}/"
        f"{f', written by {ranks} rank(s)' if ranks else ''})"])
    m = _MODEL_DIR.match(model_dir.name)
    optim_dir = model_dir.parent / f"{_OPTIM_ROOT}_{m.group(1) if m else 0}"
    if (optim_dir / METADATA_NAME).exists():
        _read_dcp_optimizer(optim_dir, ckpt)
    else:
        ckpt.notes.append(f"no {optim_dir.name}/ beside {model_dir.name}/: saved without optimizer state")
    return ckpt


def read_fsdp1_full(folder: Path) -> TrainingCheckpoint:
    """The FULL_STATE_DICT checkpoint ``folder`` (holding ``pytorch_model_fsdp.bin``, and
    ``optimizer.bin`` unless saved without optimizer state)."""
    model_file = folder / MODEL_FILE
    sd = read_structure(model_file)
    if not isinstance(sd, dict) or not sd:
        raise CheckpointError(f"{model_file}: holds a {type(sd).__name__}, not the model's state dict "
                              "(torch.save(model.state_dict()) as accelerate's save_fsdp_model writes it)")
    weights: dict[str, SourceTensor] = {}
    for name, ref in sd.items():
        if not isinstance(ref, TensorRef):
            raise CheckpointError(f"{model_file}: entry {name!r} is a {type(ref).__name__}, not a tensor; not a "
                                  "state dict accelerate's save_fsdp_model writes")
        weights[str(name)] = whole_tensor(str(name), ref)
    ckpt = TrainingCheckpoint("fsdp1-full", folder, weights, notes=[
        f"accelerate FSDP checkpoint {folder} saved with FULL_STATE_DICT ({MODEL_FILE})"])
    optim_file = folder / OPTIMIZER_FILE
    if optim_file.is_file():
        _read_full_optimizer(optim_file, ckpt)
    else:
        ckpt.notes.append(f"no {OPTIMIZER_FILE} beside {MODEL_FILE}: saved without optimizer state")
    return ckpt


def tie_aliases(ckpt: TrainingCheckpoint) -> None:
    """Tied parameters: FSDP's state dict lists a tied parameter under each of its names while the
    optimizer holds it once, so a name without optimizer state whose tensor holds a trained parameter's
    bytes (``model.tensors.same_bytes``: FSDP's full state dict clones each parameter, so a tied one is two
    records) is its alias, not a frozen parameter."""
    trained = [n for n in ckpt.weights if n in ckpt.optimizer]
    for name in [n for n in ckpt.weights if n not in ckpt.optimizer]:
        w = ckpt.weights[name]
        holder = next((h for h in trained if (ckpt.weights[h].shape, ckpt.weights[h].dtype) == (w.shape, w.dtype)
                       and same_bytes(ckpt.weights[h], w)), None)
        if holder is not None:
            ckpt.aliases[name] = holder
            del ckpt.weights[name]
            ckpt.frozen.discard(name)


def whole_tensor(name: str, ref: TensorRef) -> SourceTensor:
    """A tensor stored whole in one torch.save record: one piece."""
    if ref.file_offset is None or not ref.is_contiguous():
        raise CheckpointError(f"{ref.path}: tensor {name!r} ({ref!r}, stride {ref.stride}) is not stored contiguously; "
                              "torch.save of a state dict accelerate writes never does that. Re-save it contiguous")
    pieces = [Piece(Path(str(ref.path)), ref.file_offset, 0, ref.numel)] if ref.numel else []
    return SourceTensor(name, ref.dtype, ref.shape, pieces)


def _read_full_optimizer(path: Path, ckpt: TrainingCheckpoint) -> None:
    osd = read_structure(path)
    state = osd.get("state") if isinstance(osd, dict) else None
    groups = osd.get("param_groups") if isinstance(osd, dict) else None
    if not isinstance(state, dict) or not isinstance(groups, list):
        raise CheckpointError(f"{path}: holds no 'state' and 'param_groups' (keys seen: "
                              f"{sorted(map(str, osd)) if isinstance(osd, dict) else type(osd).__name__}); not an "
                              "optimizer state dict accelerate's save_fsdp_optimizer writes")
    refuse_ids(path, [*state, *(p for g in groups if isinstance(g, dict) for p in g.get("params") or [])],
                f"The weights alone are {path.parent / MODEL_FILE}, a full state dict")
    steps: dict[str, float] = {}
    for name, entry in state.items():
        states: dict[str, SourceTensor] = {}
        for key, value in (entry or {}).items():
            if key == "step":
                steps[name] = step_value(value, f"{path}: state of {name!r}")
            elif isinstance(value, TensorRef):
                states[key] = whole_tensor(f"{name}.{key}", value)
        ckpt.optimizer[name] = states
    finish_optimizer(ckpt, path, steps, [dict(g) for g in groups])


def _read_dcp_optimizer(optim_dir: Path, ckpt: TrainingCheckpoint) -> None:
    md = read_plain_metadata(optim_dir / METADATA_NAME)
    slices = DcpSlices(optim_dir, md)
    groups: dict[int, dict[str, Any]] = {}
    steps: dict[str, float] = {}
    try:
        paths = {k: md.planner_data.get(k) or tuple(k.split(".")) for k in md.keys}
        refuse_ids(optim_dir, [p[2] for p in paths.values() if len(p) >= 4 and p[:2] == (_OPTIM_ROOT, "state")]
                    + [v for k, p in paths.items() if p[1:2] == ("param_groups",) and p[-1] == "params"
                       for v in (slices.value(k)[1] or [])],
                    f"For the weights alone, pass {ckpt.folder} itself (read as a plain DCP checkpoint)")
        for key, path in paths.items():
            if path[:1] != (_OPTIM_ROOT,) or len(path) < 4:
                raise CheckpointError(f"{optim_dir}: item {key!r} is not under optimizer.state.<parameter> or "
                                      "optimizer.param_groups.<i>: not the optimizer folder accelerate's "
                                      "save_fsdp_optimizer writes")
            if path[1] == "param_groups":
                ok, value = slices.value(key)
                if not ok:
                    raise CheckpointError(f"{optim_dir}: param group value {key!r} is not plain data (numbers, strings, "
                                          "lists); not what torch's optimizers keep in param_groups")
                groups.setdefault(int(path[2]), {})[str(path[3])] = value
                continue
            name, state = str(path[2]), str(path[3])
            meta = md.tensors.get(key)
            if state == "step":
                steps[name] = _dcp_step(slices, md, key, optim_dir)
            elif meta is not None:
                ckpt.optimizer.setdefault(name, {})[state] = dcp_tensor(slices, key, f"{name}.{state}")
            else:
                ok, value = slices.value(key)
                ckpt.scalars.setdefault("optimizer_values", {})[f"{name}.{state}"] = value if ok else repr(value)
    finally:
        slices.close()
    finish_optimizer(ckpt, optim_dir, steps, [groups[i] for i in sorted(groups)])


def _dcp_step(slices: DcpSlices, md: DcpMetadata, key: str, where: Path) -> float:
    if key in md.tensors:
        ref = slices.tensor_ref(key)
        value = slices.scalar(ref) if ref is not None else None
    else:
        ok, plain = slices.value(key)
        value = float(plain) if ok and type(plain) in (int, float) else None
    if value is None:
        raise CheckpointError(f"{where}: {key} is not a one-element number; not a step torch's optimizers save")
    return value


def refuse_ids(where: Path, keys: list[Any], weights: str) -> None:
    """Refuse an optimizer state keyed by parameter ids (torch's ``optimizer.state_dict()``)."""
    ids = sorted({int(k) for k in keys if isinstance(k, int) or (isinstance(k, str) and k.isdigit())})
    if ids:
        raise CheckpointError(
            f"{where}: the optimizer state is keyed by parameter ids ({', '.join(map(str, ids[:4]))}"
            f"{', ...' if len(ids) > 4 else ''}), not by parameter names: torch's own optimizer.state_dict(), whose ids "
            "are positions in the optimizer's parameter list and whose moments are one rank's flat FSDP shards, so "
            f"which parameter and which elements each holds is not recorded; {_IDS_FIX}. {weights}. Nothing was written")


def finish_optimizer(ckpt: TrainingCheckpoint, where: Path, steps: dict[str, float], groups: list[dict[str, Any]]) -> None:
    """Check the optimizer's entries against the weights, record the scalars and tie the aliases (every FSDP
    optimizer reader ends here)."""
    for name, states in ckpt.optimizer.items():
        w = ckpt.weights.get(name)
        if w is None:
            raise CheckpointError(f"{where}: optimizer state for {name!r}, a name the model's state dict does not hold; "
                                  "the optimizer and model files come from different saves")
        for key, t in states.items():
            if t.numel > 1 and tuple(t.shape) != tuple(w.shape):
                raise CheckpointError(f"{where}: {key} of {name!r} has shape {list(t.shape)}, the parameter "
                                      f"{list(w.shape)}; the optimizer and model files come from different saves")
    named = {p for g in groups for p in g.get("params") or []}
    missing = [n for n in named if n not in ckpt.weights]
    if missing:
        raise CheckpointError(f"{where}: param_groups name {missing[:3]}, which the model's state dict does not hold; "
                              "the optimizer and model files come from different saves")
    ckpt.frozen = {n for n in ckpt.weights if n not in named} if named else set()
    ckpt.optimizer_described = True
    ckpt.scalars.update(step=steps, param_groups=groups, source={"engine": "accelerate-fsdp", "format": ckpt.format})
    tie_aliases(ckpt)
