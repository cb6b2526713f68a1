"""The DCP reader: an FSDP2 / torch.distributed.checkpoint checkpoint as the checkpoint model.

The ``.metadata`` is read with the restricted, torch-free unpickler (``dcp.plain_metadata``), and each
tensor's stored chunks are located with ``dcp.slices.DcpSlices`` (dim-0 slabs in plain zip
records: one byte range each). Model tensors are the keys under ``model.`` (shardkit's
``save_fsdp_checkpoint`` saves ``{"model": ..., "optim": ...}``, accelerate's FSDP save of the
Trainer ``{"model": ...}``). A tensor whose chunks cannot be read as byte ranges is read whole
through ``dcp.safe_load.load_dcp_state`` (that tensor alone in memory).

Where the folder holds shardkit's optimizer state (``optim.state.<fqn>.{exp_avg,exp_avg_sq,step}``
and ``optim.param_groups.<i>.<key>``, as ``get_state_dict`` flattens a torch Adam/AdamW), it is
described too (``optimizer_described``): each moment as byte-range pieces, ``step`` per parameter
(its 0-dim record in ``scalars["step_tensors"]``, for a writer that copies it as it is), the param
groups with their parameters' names, and what the manifest recorded (counters, client state, the
ZeRO-3 run a ``--to fsdp2`` conversion came from). Model keys outside the optimizer are tied aliases
(bit-equal to an optimizer parameter of the same shape), frozen parameters (named by the manifest's
buffer list, else sharded by FSDP2: more than one chunk) or buffers.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkit.checkpoint.dcp.plain_metadata import METADATA_NAME, DcpMetadata, read_plain_metadata
from shardkit.checkpoint.dcp.safe_load import load_dcp_state
from shardkit.checkpoint.dcp.slices import DcpSlices
from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.model.tensors import Piece, SourceTensor, box_fault
from shardkit.core.errors import CheckpointError, UsageError
from shardkit.storage.manifest import MANIFEST_NAME, Manifest, read_manifest

if TYPE_CHECKING:
    import torch

MODEL_PREFIX = "model."
OPTIM_STATE = ("exp_avg", "exp_avg_sq")
"""The per-element state of torch's Adam/AdamW (``step`` is a 0-dim tensor beside them)."""

#: How a manifest's ``dtype`` (shardkit writes the torch name, ``bfloat16``; a conversion from ZeRO-3
#: writes ``bf16``/``fp16``/``fp32`` into ``extra.converted_from.precision``) reads as a precision.
PRECISIONS = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
              "fp32": "fp32", "float32": "fp32", "float": "fp32"}


def read_dcp(tag_dir: Path) -> TrainingCheckpoint:
    """The DCP folder ``tag_dir`` as the checkpoint model, with its optimizer state where it holds one."""
    md = read_plain_metadata(tag_dir / METADATA_NAME)
    weights = dcp_tensors(tag_dir, md)
    ckpt = TrainingCheckpoint("dcp", tag_dir, weights, world_size=None, tag=tag_dir.name,
                              notes=[f"FSDP2/DCP checkpoint {tag_dir}"])
    manifest = read_manifest(tag_dir) if (tag_dir / MANIFEST_NAME).is_file() else None
    if manifest is not None and isinstance(manifest.world_size, int):
        ckpt.world_size = manifest.world_size
    if any(k.startswith("optim.") for k in md.keys) and all(k in md.planner_data for k in md.keys):
        _describe_optimizer(ckpt, md, manifest)
    return ckpt


def dcp_tensors(tag_dir: Path, md: DcpMetadata | None = None) -> dict[str, SourceTensor]:
    """The model tensors of the DCP folder ``tag_dir`` (holding ``.metadata``), by name under ``model.``."""
    md = md if md is not None else read_plain_metadata(tag_dir / METADATA_NAME)
    slices = DcpSlices(tag_dir, md)
    out: dict[str, SourceTensor] = {}
    try:
        for key, meta in md.tensors.items():
            if key.startswith(MODEL_PREFIX):
                out[key[len(MODEL_PREFIX):]] = dcp_tensor(slices, key, key[len(MODEL_PREFIX):])
    finally:
        slices.close()
    if not out:
        keys = sorted(md.keys)[:5]
        raise CheckpointError(f"{tag_dir}: a DCP checkpoint without model tensors (no key under '{MODEL_PREFIX}'; it "
                              f"holds {keys}): not a model checkpoint shardkit or the Trainer wrote (an optimizer-only "
                              "folder such as optimizer_0/?). Pass the model's folder")
    return out


def dcp_tensor(slices: DcpSlices, key: str, name: str) -> SourceTensor:
    """Tensor ``key`` of the DCP folder ``slices`` reads, as ``name``: its chunks as byte-range pieces, or
    where they are not dim-0 slabs in plain records, read whole by torch's ``dcp.load`` (that tensor
    alone in memory). The chunks ``.metadata`` lists are checked either way: ``dcp.load`` leaves the
    elements no chunk holds as ``torch.empty`` left them, and nothing would tell."""
    meta = slices.md.tensors[key]
    dtype, shape = meta.dtype, meta.size
    chunks = slices.chunks(key) if meta.chunks and math.prod(shape) > 0 else []
    if chunks is None:
        fault = box_fault(shape, [(c.offsets, c.sizes) for c in meta.chunks])
        return SourceTensor(name, dtype, shape, load=_loader(slices.tag_dir, key, shape, dtype),
                            index_fault=fault and f"of the chunks {METADATA_NAME} lists, {fault}")
    return SourceTensor(name, dtype, shape, [Piece(c.file, c.data_offset, c.start, c.numel) for c in chunks])


def _step_tensor(slices: DcpSlices, key: str, name: str) -> tuple[float, SourceTensor | None]:
    """A parameter's Adam ``step``: its number, and its 0-dim record as one piece when stored so."""
    ref = slices.tensor_ref(key)
    count = slices.scalar(ref) if ref is not None else None
    if ref is not None and count is not None and ref.is_contiguous() and ref.path is not None \
            and ref.file_offset is not None:
        return count, SourceTensor(name, ref.dtype, tuple(ref.shape), [Piece(Path(ref.path), ref.file_offset, 0, 1)])
    plain, value = slices.value(key)
    if plain and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value), None
    loaded = _load_items(slices.tag_dir, slices.md, [key])[key]
    return float(loaded.item() if hasattr(loaded, "item") else loaded), None


def _describe_optimizer(ckpt: TrainingCheckpoint, md: DcpMetadata, manifest: Manifest | None) -> None:
    """Fill ``ckpt``'s optimizer, scalars, frozen/buffers/aliases from the ``optim.*`` items (module doc)."""
    tag_dir = ckpt.folder
    paths = {k: tuple(md.planner_data[k]) for k in md.keys}
    state: dict[str, dict[str, str]] = {}
    group_keys: dict[int, list[str]] = {}
    other: list[str] = []
    for key, path in paths.items():
        if path[0] == "model" and len(path) == 2:
            continue
        if path[0] == "optim" and len(path) == 4 and path[1] == "state":
            state.setdefault(str(path[2]), {})[str(path[3])] = key
        elif path[0] == "optim" and len(path) == 4 and path[1] == "param_groups":
            group_keys.setdefault(int(path[2]), []).append(key)
        else:
            other.append(key)
    if not group_keys or not state:
        return  # no param groups or nothing stepped: weights only (a writer that needs Adam state refuses by name)
    slices = DcpSlices(tag_dir, md)
    try:
        groups = _param_groups(slices, paths, group_keys)
        extra = manifest.extra if manifest is not None else {}
        came = dict(extra.get("converted_from") or {})
        hint = extra.get("buffers", came.get("buffer_names"))
        buffer_names = [str(n) for n in hint] if isinstance(hint, list) else None
        trainable: list[str] = []
        no_state: list[str] = []
        for g, group in enumerate(groups):
            for fqn in group["params"]:
                if fqn not in ckpt.weights:
                    raise CheckpointError(f"{tag_dir}: the optimizer's param_groups[{g}] names {fqn!r}, which the "
                                          "model state does not hold; the checkpoint is damaged or not from "
                                          "save_fsdp_checkpoint")
                (trainable if all(k in state.get(fqn, {}) for k in OPTIM_STATE) else no_state).append(fqn)
        steps: dict[str, float] = {}
        step_tensors: dict[str, SourceTensor] = {}
        for fqn in trainable:
            keys = state[fqn]
            odd = sorted(set(keys) - {*OPTIM_STATE, "step"})
            if odd:
                raise UsageError(f"{tag_dir}: optimizer state of {fqn} holds {odd} besides exp_avg/exp_avg_sq/step: "
                                 "not plain Adam/AdamW (amsgrad keeps max_exp_avg_sq), and ZeRO-3's Adam has no place "
                                 "for it. Only Adam/AdamW without amsgrad converts")
            if "step" not in keys:
                raise CheckpointError(f"{tag_dir}: optimizer state of {fqn} has no 'step'; Adam's bias correction needs it")
            ckpt.optimizer[fqn] = {k: dcp_tensor(slices, keys[k], f"{fqn}.{k}") for k in OPTIM_STATE}
            steps[fqn], step_tensor = _step_tensor(slices, keys["step"], fqn)
            if step_tensor is not None:
                step_tensors[fqn] = step_tensor
        _classify_outside(ckpt, slices, trainable, no_state, buffer_names)
    finally:
        slices.close()
    ckpt.optimizer_described = True
    for group in groups:
        group["params"] = [n for n in group["params"] if n in ckpt.optimizer]
    user = dict(extra.get("user") or {})
    counters = {k: came[k] for k in ("global_samples", "skipped_steps") if isinstance(came.get(k), int)}
    if manifest is not None and isinstance(manifest.step, int):
        counters["global_steps"] = manifest.step
    ckpt.scalars.update(step=steps, step_tensors=step_tensors, param_groups=groups, client_state=user,
                        counters=counters, source={"engine": "fsdp2", **came}, not_carried=[],
                        precision_seen=precision_seen(ckpt, manifest, came))
    if "lr_scheduler" in came and came.get("engine") == "deepspeed":
        ckpt.scalars["lr_scheduler"] = came["lr_scheduler"]
    seen = ckpt.scalars["precision_seen"][0]
    ckpt.precision = seen or "fp32"
    if other:
        ckpt.scalars["not_carried"].append(f"{len(other)} DCP item(s) outside model/optimizer state ({other[:4]}): "
                                           "DeepSpeed's files have no place for them")
    if no_state:
        ckpt.notes.append(f"{len(no_state)} parameter(s) in the optimizer have no Adam state and are written as "
                          f"frozen: {no_state[:6]}{'...' if len(no_state) > 6 else ''}; if the resuming run trains "
                          "them, its flat partitions will not match and load_checkpoint fails")


def _param_groups(slices: DcpSlices, paths: dict[str, tuple[Any, ...]],
                  group_keys: dict[int, list[str]]) -> list[dict[str, Any]]:
    """The torch param groups (``params``: FQNs), plain values read directly, others through torch."""
    keys = [k for g in sorted(group_keys) for k in group_keys[g]]
    values: dict[str, Any] = {}
    rest: list[str] = []
    for key in keys:
        plain, value = slices.value(key)
        if plain:
            values[key] = value
        else:
            rest.append(key)
    if rest:
        values.update(_load_items(slices.tag_dir, slices.md, rest))
    groups = [{paths[k][3]: values[k] for k in group_keys[g]} for g in sorted(group_keys)]
    for g, group in enumerate(groups):
        fqns = group.get("params")
        if not isinstance(fqns, list) or not all(isinstance(n, str) for n in fqns):
            raise CheckpointError(f"{slices.tag_dir}: optim.param_groups[{g}].params is {type(fqns).__name__}, "
                                  "expected the list of parameter FQNs get_optimizer_state_dict writes")
    return groups


def _classify_outside(ckpt: TrainingCheckpoint, slices: DcpSlices, trainable: list[str], no_state: list[str],
                      buffer_names: list[str] | None) -> None:
    """Model keys the optimizer holds no state for: tied aliases, frozen parameters, buffers."""
    by_shape: dict[tuple[tuple[int, ...], str], list[str]] = {}
    for n in [*trainable, *no_state]:
        t = ckpt.weights[n]
        by_shape.setdefault((t.shape, t.dtype), []).append(n)
    in_groups = set(trainable) | set(no_state)
    ckpt.frozen.update(no_state)
    for name in [n for n in ckpt.weights if n not in in_groups]:
        t = ckpt.weights[name]
        owner = next((c for c in by_shape.get((t.shape, t.dtype), []) if _same(slices, name, c)), None)
        if owner is not None:
            ckpt.aliases[name] = owner
            del ckpt.weights[name]
        elif (name not in buffer_names) if buffer_names is not None else len(slices.md.tensors[MODEL_PREFIX + name].chunks) > 1:
            ckpt.frozen.add(name)
        else:
            ckpt.buffers.add(name)
    if ckpt.aliases:
        ckpt.notes.append("tied weights (bit-equal to an optimizer parameter, not in the optimizer): "
                          + ", ".join(f"{a} -> {o}" for a, o in ckpt.aliases.items()))
    if ckpt.buffers and buffer_names is None:
        ckpt.notes.append(f"buffers (one unsharded copy, not in the optimizer): {sorted(ckpt.buffers)}; a frozen "
                          "parameter saved from one rank looks the same and would be refused by load_checkpoint as a "
                          "size mismatch")


def _same(slices: DcpSlices, a: str, b: str) -> bool:
    """``a`` and ``b`` hold the same bytes (FSDP's model state holds a tied weight under every name)."""
    same = slices.same_bytes(MODEL_PREFIX + a, MODEL_PREFIX + b)
    if same is None:
        import torch  # lazy: only a chunk layout the slice reader does not take

        got = _load_items(slices.tag_dir, slices.md, [MODEL_PREFIX + a, MODEL_PREFIX + b])
        x, y = got[MODEL_PREFIX + a], got[MODEL_PREFIX + b]
        same = torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
    return bool(same)


def precision_seen(ckpt: TrainingCheckpoint, manifest: Manifest | None, came: dict[str, Any]) -> tuple[str | None, str]:
    """The training precision of the run that wrote the source, as far as it can be known, and where it was read.

    A checkpoint ``--to fsdp2`` made from ZeRO-3 records the DeepSpeed run's precision: certain.
    Parameters saved as bfloat16/float16 mean a run in that precision. Float32 parameters say
    nothing: FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` trains in bf16 and keeps
    (and saves) float32 sharded parameters, exactly as an fp32 run does."""
    recorded = came.get("precision") if came.get("engine") == "deepspeed" else None
    if isinstance(recorded, str) and recorded in PRECISIONS:
        return PRECISIONS[recorded], (f"its manifest's extra.converted_from.precision {recorded!r} (the DeepSpeed run "
                                      "it was converted from)")
    dtypes = sorted({ckpt.weights[n].dtype for n in ckpt.optimizer})
    low = [d for d in dtypes if d in ("bfloat16", "float16")]
    if manifest is not None and isinstance(manifest.dtype, str) and PRECISIONS.get(manifest.dtype) in ("bf16", "fp16"):
        return PRECISIONS[manifest.dtype], f"its manifest's dtype {manifest.dtype!r}"
    if low:
        return PRECISIONS[low[0]], f"its parameters saved as {low[0]}"
    if manifest is not None and manifest.dtype:
        return None, f"its manifest's dtype {manifest.dtype!r}"
    return None, f"its parameters' dtype {dtypes} (no manifest)"


def _load_items(tag_dir: Path, md: DcpMetadata, keys: list[str]) -> dict[str, Any]:
    """Items ``keys`` through ``load_dcp_state`` (full tensors, or the objects bytes items hold; imports torch)."""
    import torch  # lazy: only items the torch-free reader does not take

    template: dict[str, Any] = {}
    for key in keys:
        meta = md.tensors.get(key)
        value = torch.empty(meta.size, dtype=getattr(torch, meta.dtype)) if meta is not None else None
        _set_path(template, tuple(md.planner_data[key]), value)
    with warnings.catch_warnings():
        # dcp.load without a process group says it assumes one process: that is the intent here
        warnings.simplefilter("ignore", UserWarning)
        load_dcp_state(template, tag_dir)
    out: dict[str, Any] = {}
    for key in keys:
        node: Any = template
        for p in md.planner_data[key]:
            node = node[p]
        out[key] = node
    return out


def _set_path(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    node: Any = root
    for here, nxt in zip(path[:-1], path[1:]):
        has = (isinstance(node, list) and here < len(node)) or (isinstance(node, dict) and here in node)
        child = node[here] if has else None
        if child is None:
            child = [] if isinstance(nxt, int) else {}
            if isinstance(node, list):
                node.extend([None] * (here + 1 - len(node)))
            node[here] = child
        node = child
    last = path[-1]
    if isinstance(node, list):
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value


def _loader(tag_dir: Path, key: str, shape: tuple[int, ...], dtype: str) -> Any:
    def load() -> "torch.Tensor":
        import torch  # lazy: only a tensor whose chunks are not byte ranges

        holder = {key: torch.empty(shape, dtype=getattr(torch, dtype))}
        load_dcp_state(holder, tag_dir)
        return holder[key]

    return load
