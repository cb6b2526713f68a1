"""Reading the FSDP2 (DCP) source of ``convert_dcp_to_zero3``: which folder is its tag folder
(``resolve_dcp_tag_dir``), its ``.metadata`` and items read without torch where their layout allows
(``DcpSource``: ``plain_metadata``, ``DcpSlices`` for element ranges, whole tensors and plain values
straight from the ``.distcp`` files), else through the restricted ``dcp.load`` in batches,
and what its model keys are (``classify_source``: trainable, frozen, tied alias or buffer, with
their Adam ``step`` and the source's param groups) as the ``SourcePlan`` the target plan and the
writer follow.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardkit.checkpoint.dcp.plain_metadata import TensorMeta, read_plain_metadata
from shardkit.checkpoint.dcp.reader import METADATA_NAME, load_dcp_state
from shardkit.checkpoint.dcp.slices import DcpSlices
from shardkit.checkpoint.ops.convert.names import ADAM_STATE_KEYS, MODEL_KEY, OPTIM_KEY
from shardkit.core.errors import CheckpointError, UsageError
from shardkit.storage.manifest import MANIFEST_NAME
from shardkit.storage.tags import LATEST_NAME, latest_tag
from shardkit.storage.torch_load import TensorRef


def resolve_dcp_tag_dir(path: str | os.PathLike[str]) -> Path:
    """Root (with ``latest``), tag folder or ``.metadata`` file of a DCP checkpoint -> its tag folder."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: checkpoint path does not exist")
    if p.is_file():
        if p.name in (METADATA_NAME, LATEST_NAME, MANIFEST_NAME):
            return resolve_dcp_tag_dir(p.parent)
        raise CheckpointError(f"{p}: is a file; pass the FSDP2 checkpoint folder (holding 'latest') or its tag folder")
    if (p / METADATA_NAME).is_file():
        return p
    if any(f.name.endswith("_optim_states.pt") for f in p.iterdir()):
        raise UsageError(f"{p}: is a DeepSpeed ZeRO checkpoint (per-rank *_optim_states.pt files), not an FSDP2 (DCP) "
                         "one; --to zero3 converts FSDP2 checkpoints. For another world size use `shardkit reshard "
                         f"{p} --world-size N -o OUT`")
    tag = latest_tag(p)  # one folder name inside p, or a CheckpointError naming the pointer file
    if tag is not None:
        tag_dir = p / tag
        if (tag_dir / METADATA_NAME).is_file():
            return tag_dir
        if tag_dir.is_dir() and any(f.name.endswith("_optim_states.pt") for f in tag_dir.iterdir()):
            return resolve_dcp_tag_dir(tag_dir)
        raise CheckpointError(f"{p / LATEST_NAME}: names tag {tag!r}, but {tag_dir / METADATA_NAME} does not exist "
                              "(an interrupted save, or a partial copy); pass a complete tag folder")
    raise CheckpointError(f"{p}: no DCP checkpoint here (no {METADATA_NAME}, no 'latest' file); pass the folder "
                          "save_fsdp_checkpoint wrote")


@dataclass(frozen=True)
class DcpParam:
    """One parameter of the FSDP2 model as the DCP checkpoint records it."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    """torch's dtype name without ``torch.`` (``float32``)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class StepValue:
    """One parameter's Adam ``step`` in the source."""

    count: float
    ref: TensorRef | None
    """Its tensor's bytes in the source (torch keeps ``step`` as a 0-dim float32 tensor), copied as
    they are into a torch-format target; None when it was read through torch or is a number."""
    dtype: str
    """The tensor's dtype name (``float32``); empty for a number."""


@dataclass
class SourcePlan:
    """Everything the writer needs, decided before the first file is written: the source's model
    keys classified (``classify_source``). ``notes``/``not_carried`` collect what the result
    reports; ``plan_zero3_target`` adds to them."""

    trainable: list[DcpParam]
    param_group_of: dict[str, int]
    frozen: list[DcpParam]
    buffers: list[str]
    aliases: dict[str, str]
    """Tied alias FQN -> the FQN holding the data (DeepSpeed's ``shared_params``)."""
    model_keys: list[str]
    """Every model state dict key, in the source's order (the ``module`` dict's order)."""
    steps: dict[str, StepValue]
    """FQN -> the source's ``step``."""
    groups: list[dict[str, Any]]
    """Source param groups (torch format, ``params`` as FQN lists)."""
    notes: list[str] = field(default_factory=list)
    not_carried: list[str] = field(default_factory=list)


class DcpSource:
    """A DCP checkpoint folder: its metadata, and its items read without torch where their layout
    allows (``slices``), else through restricted, batched ``dcp.load`` reads (``load``)."""

    def __init__(self, tag_dir: Path):
        self.tag_dir = tag_dir
        self.md = read_plain_metadata(tag_dir / METADATA_NAME)
        planner = self.md.planner_data
        keys = list(self.md.keys)
        if not all(k in planner for k in keys):
            raise CheckpointError(
                f"{tag_dir / METADATA_NAME}: has no flattening map (planner_data) for its {len(keys)} keys, so "
                "model and optimizer entries cannot be told apart: it was not written by save_fsdp_checkpoint "
                "(dcp.save of {'model': ..., 'optim': ...} with the default planner). Save it with shardkit")
        self.paths: dict[str, tuple[Any, ...]] = {k: tuple(planner[k]) for k in keys}
        self.bytes_read = 0
        self.slices = DcpSlices(tag_dir, self.md)
        """Element ranges, whole tensors and values read straight from the .distcp files (dcp.slices)."""

    def tensor_meta(self, key: str) -> TensorMeta | None:
        return self.md.tensors.get(key)

    def values(self, keys: list[str]) -> dict[str, Any]:
        """The values of non-tensor items ``keys``: plain data read directly, anything else through ``load``."""
        out: dict[str, Any] = {}
        rest: list[str] = []
        for key in keys:
            plain, value = self.slices.value(key)
            if plain:
                out[key] = value
            else:
                rest.append(key)
        if rest:
            out.update(self.load(rest))
        return {key: out[key] for key in keys}

    def step(self, key: str) -> StepValue:
        """The Adam ``step`` item ``key``: its number, and its bytes when it is a tensor stored whole."""
        ref = self.slices.tensor_ref(key)
        count = self.slices.scalar(ref) if ref is not None else None
        if ref is not None and count is not None:
            return StepValue(count, ref, ref.dtype)
        plain, value = self.slices.value(key)
        if plain and isinstance(value, (int, float)) and not isinstance(value, bool):
            return StepValue(float(value), None, "")
        loaded = self.load([key])[key]
        if hasattr(loaded, "item"):  # a tensor the slice reader did not take
            return StepValue(float(loaded.item()), None, str(loaded.dtype).removeprefix("torch."))
        return StepValue(float(loaded), None, "")

    def load(self, keys: list[str]) -> dict[str, Any]:
        """The items ``keys`` (flattened DCP keys) through ``load_dcp_state``: full tensors, or the
        objects bytes items hold (imports torch)."""
        import torch

        template: dict[str, Any] = {}
        for key in keys:
            meta = self.tensor_meta(key)
            value: Any = None
            if meta is not None:
                value = torch.empty(meta.size, dtype=getattr(torch, meta.dtype))
                self.bytes_read += value.numel() * value.element_size()
            _set_path(template, self.paths[key], value)
        with warnings.catch_warnings():
            # dcp.load without a process group says it assumes one process: that is the intent here
            warnings.simplefilter("ignore", UserWarning)
            load_dcp_state(template, self.tag_dir)
        return {key: _get_path(template, self.paths[key]) for key in keys}


def _set_path(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    node: Any = root
    for here, nxt in zip(path[:-1], path[1:]):
        child = node[here] if (isinstance(node, list) and here < len(node)) or (isinstance(node, dict) and here in node) else None
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


def _get_path(root: dict[str, Any], path: tuple[Any, ...]) -> Any:
    node: Any = root
    for p in path:
        node = node[p]
    return node


def classify_source(src: DcpSource, buffer_names: list[str] | None = None) -> SourcePlan:
    """Classify the source's model keys (trainable, frozen, tied alias, buffer) and collect its Adam state.

    ``buffer_names``: the buffers, when the manifest names them (``extra.buffers``, or
    ``extra.converted_from.buffer_names`` from a ZeRO-3 conversion); otherwise a model key outside
    the optimizer that is not a tied alias is a frozen parameter when FSDP2 sharded it (several
    chunks) and a buffer when not."""
    model: list[str] = []
    state: dict[str, dict[str, str]] = {}
    group_keys: dict[int, list[str]] = {}
    other: list[str] = []
    for key, path in src.paths.items():
        if path[0] == MODEL_KEY and len(path) == 2:
            model.append(str(path[1]))
        elif path[0] == OPTIM_KEY and len(path) == 4 and path[1] == "state":
            state.setdefault(str(path[2]), {})[str(path[3])] = key
        elif path[0] == OPTIM_KEY and len(path) == 4 and path[1] == "param_groups":
            group_keys.setdefault(int(path[2]), []).append(key)
        else:
            other.append(key)
    if not model:
        raise CheckpointError(f"{src.tag_dir}: holds no model state ('model.*' keys); not a save_fsdp_checkpoint folder")
    if not group_keys or not state:
        raise CheckpointError(
            f"{src.tag_dir}: holds no optimizer state ({'no param_groups' if not group_keys else 'no per-parameter state: the optimizer never stepped'}); "
            "a ZeRO-3 checkpoint needs fp32 masters and Adam moments. Save with save_fsdp_checkpoint(model, optimizer, ...) "
            "after at least one step, or load the weights alone (engine.load_checkpoint(..., load_module_only=True) of a "
            "consolidated checkpoint)")
    loaded = src.values([k for keys in group_keys.values() for k in keys])
    groups: list[dict[str, Any]] = []
    for g in sorted(group_keys):
        groups.append({src.paths[k][3]: loaded[k] for k in group_keys[g]})
    plan = SourcePlan(trainable=[], param_group_of={}, frozen=[], buffers=[], aliases={}, model_keys=[], steps={}, groups=groups)
    if other:
        plan.not_carried.append(f"{len(other)} DCP item(s) outside model/optimizer state ({other[:4]}): DeepSpeed's files "
                                "have no place for them")

    def meta(fqn: str) -> TensorMeta:
        m = src.tensor_meta(f"{MODEL_KEY}.{fqn}")
        if m is None:
            raise CheckpointError(f"{src.tag_dir}: model entry {fqn!r} is not a tensor; not a model state dict")
        return m

    in_groups: list[str] = []
    for g, group in enumerate(groups):
        fqns = group.get("params")
        if not isinstance(fqns, list) or not all(isinstance(n, str) for n in fqns):
            raise CheckpointError(f"{src.tag_dir}: optim.param_groups[{g}].params is {type(fqns).__name__}, expected the "
                                  "list of parameter FQNs get_optimizer_state_dict writes")
        for fqn in fqns:
            plan.param_group_of[fqn] = g
            in_groups.append(fqn)
    unknown = [n for n in in_groups if n not in model]
    if unknown:
        raise CheckpointError(f"{src.tag_dir}: the optimizer's param groups name {unknown[:4]}, which the model state "
                              "does not hold; the checkpoint is damaged or not from save_fsdp_checkpoint")
    no_state = [n for n in in_groups if not all(k in state.get(n, {}) for k in ADAM_STATE_KEYS)]
    for fqn in in_groups:
        m = meta(fqn)
        p = DcpParam(fqn, m.size, m.dtype)
        if fqn in no_state:
            plan.frozen.append(p)
        else:
            plan.trainable.append(p)
            extra = sorted(set(state[fqn]) - {*ADAM_STATE_KEYS, "step"})
            if extra:
                raise UsageError(f"{src.tag_dir}: optimizer state of {fqn} holds {extra} besides exp_avg/exp_avg_sq/step: "
                                 "not plain Adam/AdamW (amsgrad keeps max_exp_avg_sq), and ZeRO-3's Adam has no place for "
                                 "it. Only Adam/AdamW without amsgrad converts")
            if "step" not in state[fqn]:
                raise CheckpointError(f"{src.tag_dir}: optimizer state of {fqn} has no 'step'; Adam's bias correction needs it")
    if no_state:
        plan.notes.append(f"{len(no_state)} parameter(s) in the optimizer have no Adam state and are written as frozen "
                          f"(frozen_param_shapes): {no_state[:6]}{'...' if len(no_state) > 6 else ''}; if the resuming "
                          "run trains them, its flat partitions will not match and load_checkpoint fails")
    # model keys the optimizer never saw: tied aliases (same tensor as an optimizer parameter),
    # frozen parameters left out of the optimizer (FSDP2 shards them: more than one chunk), buffers
    trainable_by_shape: dict[tuple[tuple[int, ...], str], list[str]] = {}
    for p in plan.trainable + plan.frozen:
        trainable_by_shape.setdefault((p.shape, p.dtype), []).append(p.fqn)
    outside = [n for n in model if n not in plan.param_group_of]
    for fqn in outside:
        m = meta(fqn)
        owner = _tied_owner(src, fqn, trainable_by_shape.get((m.size, m.dtype), []))
        if owner is not None:
            plan.aliases[fqn] = owner
        elif (fqn not in buffer_names) if buffer_names is not None else len(m.chunks) > 1:
            plan.frozen.append(DcpParam(fqn, m.size, m.dtype))
        else:
            plan.buffers.append(fqn)
    if plan.aliases:
        plan.notes.append("tied weights (bit-equal to an optimizer parameter, not in the optimizer): "
                          + ", ".join(f"{a} -> {o}" for a, o in plan.aliases.items()) + " (shared_params)")
    frozen_outside = [p.fqn for p in plan.frozen if p.fqn not in plan.param_group_of]
    if frozen_outside:
        plan.notes.append(f"frozen (sharded by FSDP2, not in the optimizer): {frozen_outside}")
    if plan.buffers and buffer_names is None:
        plan.notes.append(f"buffers (one unsharded copy, not in the optimizer): {plan.buffers}; a frozen parameter "
                          "saved from one rank looks the same and would be refused by load_checkpoint as a size mismatch")
    # frozen parameters in the module's parameters() order, as DeepSpeed lists them
    order = {n: i for i, n in enumerate(model)}
    plan.frozen.sort(key=lambda p: order[p.fqn])
    plan.model_keys = model
    plan.steps = {p.fqn: src.step(state[p.fqn]["step"]) for p in plan.trainable}
    return plan


def _tied_owner(src: DcpSource, fqn: str, candidates: list[str]) -> str | None:
    """The optimizer parameter ``fqn`` is tied to: same shape, dtype and bytes (FSDP's model state
    dict holds a tied weight under every name; its optimizer state under the first only). Compared
    straight from the files; through dcp.load where the slice reader cannot read them."""
    for cand in candidates:
        same = src.slices.same_bytes(f"{MODEL_KEY}.{fqn}", f"{MODEL_KEY}.{cand}")
        if same is None:
            import torch

            mine = src.load([f"{MODEL_KEY}.{fqn}"])[f"{MODEL_KEY}.{fqn}"]
            other = src.load([f"{MODEL_KEY}.{cand}"])[f"{MODEL_KEY}.{cand}"]
            same = torch.equal(mine.reshape(-1).view(torch.uint8), other.reshape(-1).view(torch.uint8))
        if same:
            return cand
    return None
