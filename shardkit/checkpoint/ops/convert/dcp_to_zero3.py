"""FSDP2 (DCP) -> DeepSpeed ZeRO-3: the per-rank files a ZeRO-3 run at N ranks would have saved.

Input: a DCP checkpoint ``save_fsdp_checkpoint`` wrote (``{"model": ..., "optim": ...}`` from
``get_state_dict``: model FQNs, torch Adam/AdamW state ``step``/``exp_avg``/``exp_avg_sq`` per
parameter, ``param_groups`` listing FQNs in the optimizer's order). Output, under ``OUT/<tag>``
with ``OUT/latest`` moved last and a shardkit manifest (``atomic_checkpoint``):

- ``zero_pp_rank_{r}_mp_rank_00_model_states.pt``: what ``DeepSpeedEngine._save_checkpoint``
  writes (0.19.8): ``module`` (empty placeholders for parameters, as a partitioned ZeRO-3 module's
  ``state_dict`` holds them, and the buffers' values), ``buffer_names``, ``param_shapes`` (one
  ordered dict per sub-group), ``frozen_param_shapes``/``frozen_param_fragments``,
  ``shared_params``, counters, ``dp_world_size``, ``ds_config``, ``ds_version`` and the JSON
  client state the FSDP2 save kept (``extra``);
- ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt``: ``DeepSpeedZeroOptimizer_Stage3.
  _rigid_state_dict``: ``zero_stage``, ``loss_scaler``, ``partition_count``, the inner optimizer's
  ``state``/``param_groups`` (one entry per sub-group) and ``fp32_flat_groups``.

The trainable parameters are laid out as ZeRO-3 lays them out at N ranks (``plan_layout``: each
param group split into sub-groups at ``sub_group_size``, ``ceil(numel / N)`` elements per rank,
zero padding), in the order the DCP param groups list them: the model's ``parameters()`` order when
the FSDP2 optimizer was built from ``model.parameters()``, which is the order DeepSpeed uses.
``_rigid_load_state_dict`` copies flat tensors without looking at names, so that order is what
makes the load right; the tests compare every parameter after a real load.

The metadata is read through the restricted ``.metadata`` unpickler. Each output rank's flat
tensors are byte ranges of the ``.distcp`` files plus zero runs (``dcp_slices`` checks each chunk's
zip/pickle layout first), copied by ``stream_save`` through one 1 MiB buffer and hashed as they
are written, one thread per rank file: every source byte is read once, nothing is built in memory,
and the manifest needs no second read. A chunk layout ``dcp_slices`` does not take (or a dtype
other than float32) is loaded whole through ``load_dcp_state`` (``weights_only`` bytes) in
``BATCH_BYTES`` batches, one rank file after another.

Bit-exactness: fp32 masters, ``exp_avg``, ``exp_avg_sq`` and ``step`` are copied bit for bit
(float32 sources; other dtypes are upcast and said so). What the files cannot hold: DeepSpeed's CPU
Adam kernels (``DeepSpeedCPUAdam`` with offload, ``FusedAdam`` on a CPU run) keep ``beta**step``
in C++; after a plain ``engine.load_checkpoint`` call ``shardkit.restore_cpu_adam_kernel_state
(engine)`` on every rank (see ``zero3/cpu_adam_kernel.py``). The update rule itself differs from
torch's AdamW in rounding, so the continued loss curve matches an FSDP2 continuation to a
tolerance, not bit for bit (README "Convert").
"""

from __future__ import annotations

import math
import os
import warnings
from collections import OrderedDict
from contextlib import closing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable

from shardkit.checkpoint.dcp.reader import METADATA_NAME, load_dcp_state, read_dcp_metadata
from shardkit.checkpoint.dcp.slices import DcpSlices
from shardkit.checkpoint.io.atomic import LATEST_NAME, check_tag, latest_tag, os_errors_named
from shardkit.checkpoint.io.manifest import MANIFEST_NAME, FileEntry, read_manifest
from shardkit.checkpoint.io.pipeline import check_output_root, default_workers, verify_before_reading, warn_unverified
from shardkit.checkpoint.io.staged_save import atomic_checkpoint
from shardkit.checkpoint.io.stream import LazyTensor, Segment, stream_save, write_parallel
from shardkit.checkpoint.ops.convert.names import ADAM_STATE_KEYS, ADAM_TYPES, MODEL_KEY, OPTIM_KEY
from shardkit.checkpoint.ops.convert.result import ConvertResult
from shardkit.checkpoint.zero3.layout import DEEPSPEED_MODEL_KEYS, DEFAULT_SUB_GROUP_SIZE
from shardkit.checkpoint.zero3.reader import MODEL_FILE, OPTIM_FILE, ParamSlot
from shardkit.checkpoint.zero3.repartition import TargetLayout, plan_layout, repartition_frozen
from shardkit.config.loading import config_digest, load_config
from shardkit.config.paths import get
from shardkit.core.errors import CheckpointError, UsageError

if TYPE_CHECKING:
    import torch

FP32 = "fp32"
"""Pseudo state key: the fp32 masters (the FSDP2 parameters themselves)."""

BATCH_BYTES = 64 * 2**20
"""Full source tensors read per ``dcp.load`` call while a partition is produced (bounds memory)."""

MAX_WORLD_SIZE = 2**20

#: Param-group keys of the optimizer DeepSpeed builds from a config ``optimizer`` block (0.19.8,
#: ``DeepSpeedEngine.get_optimizer_configuration``), with their constructor defaults.
#: ``FusedAdam``: ``defaults = dict(lr, bias_correction, betas, eps, weight_decay)`` (ops/adam/
#: fused_adam.py), plus ``step: 0`` its ``step()`` adds to every group. ``DeepSpeedCPUAdam``:
#: ``dict(lr, betas, eps, weight_decay, bias_correction, amsgrad)`` (ops/adam/cpu_adam.py).
#: Written verbatim: ``Optimizer.load_state_dict`` replaces the engine's groups with the saved
#: ones, and FusedAdam's ``step`` reads ``group["bias_correction"]`` (a torch-format group would
#: end in a KeyError). Built from the table, not by constructing the class: that loads (and may
#: JIT-build) a C++ op, 5 s to minutes here.
_GROUP_FORMATS: dict[str, dict[str, Any]] = {
    "FusedAdam": {"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                  "step": 0},
    "DeepSpeedCPUAdam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                         "bias_correction": True, "amsgrad": False},
}
_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
"""Carried from each source param group into the target's (the state being resumed)."""
_TORCH_FLAGS_MUST_BE_OFF = ("amsgrad", "maximize")
"""torch Adam flags ZeRO-3's Adam has no state or code for (amsgrad keeps max_exp_avg_sq)."""


@dataclass(frozen=True)
class _Param:
    """One parameter of the FSDP2 model as the DCP checkpoint records it."""

    fqn: str
    shape: tuple[int, ...]
    dtype: "torch.dtype"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class TargetOptimizer:
    """The optimizer the resuming DeepSpeed engine builds, as far as its checkpoint format goes."""

    name: str
    """'FusedAdam', 'DeepSpeedCPUAdam' or 'torch' (a client torch optimizer or ``torch_adam``)."""
    adam_w_mode: bool
    """Decoupled weight decay (AdamW) or L2 (Adam)."""
    step_as_tensor: bool
    """torch keeps ``step`` as a float32 tensor; DeepSpeed's Adams as a Python int."""


@dataclass
class _Plan:
    """Everything the writer needs, decided before the first file is written."""

    trainable: list[_Param]
    param_group_of: dict[str, int]
    frozen: list[_Param]
    buffers: list[str]
    aliases: dict[str, str]
    """Tied alias FQN -> the FQN holding the data (DeepSpeed's ``shared_params``)."""
    model_keys: list[str]
    """Every model state dict key, in the source's order (the ``module`` dict's order)."""
    steps: dict[str, Any]
    """FQN -> the source's ``step`` value."""
    groups: list[dict[str, Any]]
    """Source param groups (torch format, ``params`` as FQN lists)."""
    notes: list[str] = field(default_factory=list)
    not_carried: list[str] = field(default_factory=list)


class _DcpSource:
    """A DCP checkpoint folder: its metadata and batched, restricted reads of its items."""

    def __init__(self, tag_dir: Path):
        self.tag_dir = tag_dir
        self.md = read_dcp_metadata(tag_dir / METADATA_NAME)
        planner = getattr(self.md, "planner_data", None)
        keys = list(self.md.state_dict_metadata)
        if not isinstance(planner, dict) or not all(k in planner for k in keys):
            raise CheckpointError(
                f"{tag_dir / METADATA_NAME}: has no flattening map (planner_data) for its {len(keys)} keys, so "
                "model and optimizer entries cannot be told apart: it was not written by save_fsdp_checkpoint "
                "(dcp.save of {'model': ..., 'optim': ...} with the default planner). Save it with shardkit")
        self.paths: dict[str, tuple[Any, ...]] = {k: tuple(planner[k]) for k in keys}
        self.bytes_read = 0
        self.slices = DcpSlices(tag_dir, self.md)
        """Element ranges read straight from the .distcp files where the layout allows (dcp_slices)."""

    def tensor_meta(self, key: str) -> Any:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        meta = self.md.state_dict_metadata.get(key)
        return meta if isinstance(meta, TensorStorageMetadata) else None

    def load(self, keys: list[str]) -> dict[str, Any]:
        """The items ``keys`` (flattened DCP keys): full tensors, or the objects bytes items hold."""
        import torch

        template: dict[str, Any] = {}
        for key in keys:
            meta = self.tensor_meta(key)
            value: Any = None
            if meta is not None:
                value = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
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


def _read_ds_config(ds_config: str | os.PathLike[str] | dict[str, Any] | None) -> dict[str, Any] | None:
    if ds_config is None or isinstance(ds_config, dict):
        return ds_config
    return load_config(Path(ds_config))


def target_optimizer(cfg: dict[str, Any] | None, source_adam_w: bool) -> TargetOptimizer:
    """Which optimizer the DeepSpeed engine builds from ``cfg`` (mirrors ``get_optimizer_configuration``)."""
    if cfg is None:
        return TargetOptimizer("FusedAdam", source_adam_w, False)
    opt = cfg.get("optimizer")
    if opt is None:
        # a client optimizer passed to deepspeed.initialize: shardkit's FSDP2 runs use torch's
        return TargetOptimizer("torch", source_adam_w, True)
    kind = str(opt.get("type", "")).lower()
    if kind not in ADAM_TYPES:
        raise UsageError(f"ds_config optimizer.type is {opt.get('type')!r}: only Adam/AdamW state (exp_avg, exp_avg_sq, "
                         "step) converts from an FSDP2 AdamW checkpoint; use a config with optimizer.type 'AdamW' "
                         "(or 'Adam')")
    params = opt.get("params") or {}
    # DeepSpeed: type AdamW is always decoupled; type Adam is too unless adam_w_mode: false
    adam_w = kind == "adamw" or bool(params.get("adam_w_mode", True))
    if params.get("torch_adam"):
        return TargetOptimizer("torch", adam_w, True)
    offload = get(cfg, "zero_optimization.offload_optimizer.device", "none")
    if get(cfg, "zero_optimization.zenflow") is not None:
        raise UsageError("ds_config zero_optimization.zenflow is set: ZenFlow's CPU Adam keeps state this converter "
                         "does not write; convert for a config without zenflow")
    if str(offload).lower() in ("cpu", "nvme"):
        return TargetOptimizer("DeepSpeedCPUAdam", adam_w, False)
    return TargetOptimizer("FusedAdam", adam_w, False)


def _check_config(cfg: dict[str, Any] | None) -> tuple[int, str]:
    """(sub_group_size, precision) of the target config; refuses what cannot be converted."""
    if cfg is None:
        return DEFAULT_SUB_GROUP_SIZE, "fp32"
    stage = get(cfg, "zero_optimization.stage", 0)
    if stage != 3:
        raise UsageError(f"ds_config zero_optimization.stage is {stage!r}: --to zero3 writes ZeRO-3 files; pass the "
                         "config of the resuming ZeRO-3 run (stage 3)")
    for key in ("bf16.enabled", "fp16.enabled", "zero_optimization.offload_optimizer.device"):
        if get(cfg, key) == "auto":
            raise UsageError(f"ds_config {key} is 'auto': it decides the files' names and param-group format, and only "
                             "the HF Trainer fills it in at launch. Pass the config with the value the run uses "
                             "(the Trainer's filled-in config, or set it explicitly)")
    if get(cfg, "fp16.enabled", False) is True:
        raise UsageError("ds_config fp16.enabled is true: an fp16 ZeRO-3 run needs a loss scaler state, which an FSDP2 "
                         "checkpoint does not hold (loss_scaler cannot be carried). Resume in bf16 or fp32 (bf16.enabled "
                         "or neither)")
    value = get(cfg, "zero_optimization.sub_group_size", DEFAULT_SUB_GROUP_SIZE)
    if value == "auto":
        value = DEFAULT_SUB_GROUP_SIZE  # DeepSpeed's config drops "auto" keys: the default applies
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1 or value != int(value):
        raise UsageError(f"ds_config zero_optimization.sub_group_size is {value!r}: not a positive integer; set the "
                         f"resuming run's value (DeepSpeed's default is {DEFAULT_SUB_GROUP_SIZE:.0e})")
    precision = "bf16" if get(cfg, "bf16.enabled", False) is True else "fp32"
    return int(value), precision


def _plan(src: _DcpSource, buffer_names: list[str] | None = None) -> _Plan:
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
    loaded = src.load([k for keys in group_keys.values() for k in keys])
    groups: list[dict[str, Any]] = []
    for g in sorted(group_keys):
        groups.append({src.paths[k][3]: loaded[k] for k in group_keys[g]})
    plan = _Plan(trainable=[], param_group_of={}, frozen=[], buffers=[], aliases={}, model_keys=[], steps={}, groups=groups)
    if other:
        plan.not_carried.append(f"{len(other)} DCP item(s) outside model/optimizer state ({other[:4]}): DeepSpeed's files "
                                "have no place for them")

    def meta(fqn: str) -> Any:
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
        p = _Param(fqn, tuple(m.size), m.properties.dtype)
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
    trainable_by_shape: dict[tuple[Any, ...], list[str]] = {}
    for p in plan.trainable + plan.frozen:
        trainable_by_shape.setdefault((p.shape, p.dtype), []).append(p.fqn)
    outside = [n for n in model if n not in plan.param_group_of]
    for fqn in outside:
        m = meta(fqn)
        owner = _tied_owner(src, fqn, trainable_by_shape.get((tuple(m.size), m.properties.dtype), []))
        if owner is not None:
            plan.aliases[fqn] = owner
        elif (fqn not in buffer_names) if buffer_names is not None else len(m.chunks) > 1:
            plan.frozen.append(_Param(fqn, tuple(m.size), m.properties.dtype))
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
    steps = src.load([state[p.fqn]["step"] for p in plan.trainable])
    plan.steps = {p.fqn: steps[state[p.fqn]["step"]] for p in plan.trainable}
    return plan


def _tied_owner(src: _DcpSource, fqn: str, candidates: list[str]) -> str | None:
    """The optimizer parameter ``fqn`` is tied to: same shape, dtype and bytes (FSDP's model state
    dict holds a tied weight under every name; its optimizer state under the first only)."""
    if not candidates:
        return None
    import torch

    mine = src.load([f"{MODEL_KEY}.{fqn}"])[f"{MODEL_KEY}.{fqn}"]
    for cand in candidates:
        other = src.load([f"{MODEL_KEY}.{cand}"])[f"{MODEL_KEY}.{cand}"]
        if torch.equal(mine.view(torch.uint8) if mine.dtype != torch.uint8 else mine, other.view(torch.uint8) if other.dtype != torch.uint8 else other):
            return cand
    return None


def _step_value(fqns: list[str], steps: dict[str, Any], source: Path) -> tuple[int, Any]:
    """The one step count of a sub-group (ZeRO-3 keeps one per sub-group; torch one per parameter)."""
    import torch

    values: dict[str, float] = {}
    for n in fqns:
        s = steps[n]
        values[n] = float(s.item() if isinstance(s, torch.Tensor) else s)
    distinct = sorted(set(values.values()))
    if len(distinct) != 1:
        first = {v: next(n for n in fqns if values[n] == v) for v in distinct}
        raise CheckpointError(
            f"{source}: parameters that share a ZeRO-3 sub-group have different Adam step counts ("
            + ", ".join(f"{n}: {v:g}" for v, n in first.items())
            + "): ZeRO-3 keeps one step per sub-group, so their bias corrections cannot all be kept. Parameters "
            "that missed optimizer steps (no gradient) cause this; convert a checkpoint where all trained together, "
            "or put them in separate param groups")
    step = distinct[0]
    if step != int(step) or step < 1:
        raise CheckpointError(f"{source}: Adam step is {step:g}, expected a positive whole number")
    return int(step), steps[fqns[0]]


def _target_groups(plan: _Plan, opt: TargetOptimizer, cfg: dict[str, Any] | None, source: Path) -> list[dict[str, Any]]:
    """The inner optimizer's param groups in the target optimizer's own format (``params`` filled later)."""
    out = []
    cfg_params = get(cfg or {}, "optimizer.params", {}) or {}
    for g, group in enumerate(plan.groups):
        for flag in _TORCH_FLAGS_MUST_BE_OFF:
            if group.get(flag):
                raise UsageError(f"{source}: param_groups[{g}].{flag} is {group[flag]!r}: DeepSpeed's ZeRO-3 Adam has no "
                                 f"{flag} mode, so this state would train differently. Convert a checkpoint trained "
                                 f"with {flag}=False")
        decoupled = bool(group.get("decoupled_weight_decay", False))
        if decoupled != opt.adam_w_mode and float(group.get("weight_decay", 0.0)) != 0.0:
            seen = "AdamW (decoupled_weight_decay=True)" if decoupled else "Adam (L2 weight decay)"
            want = "AdamW" if opt.adam_w_mode else "Adam with L2 weight decay"
            raise UsageError(f"{source}: param_groups[{g}] was trained with {seen}, weight_decay "
                             f"{group.get('weight_decay')}, but the target config builds {want}. Set ds_config "
                             f"optimizer.type to {'AdamW' if decoupled else 'Adam'}"
                             f"{'' if decoupled else ' with params.adam_w_mode false'}")
        if opt.name == "torch":
            new = {k: v for k, v in group.items() if k != "params"}
        else:
            new = dict(_GROUP_FORMATS[opt.name])
            new.update({k: cfg_params[k] for k in new if k in cfg_params and k not in _HYPERPARAMETERS})
            for k in _HYPERPARAMETERS:
                if k in group:
                    new[k] = tuple(group[k]) if k == "betas" else group[k]
            dropped = sorted(k for k in group if k not in new and k not in ("params", *_TORCH_FLAGS_MUST_BE_OFF,
                             "decoupled_weight_decay", "foreach", "capturable", "differentiable", "fused"))
            if dropped:
                plan.not_carried.append(f"param_groups[{g}] entries {dropped}: {opt.name}'s param groups have no such "
                                        "keys (set them in the resuming run if they matter)")
        out.append(new)
    return out


def _partition(src: _DcpSource, layout: TargetLayout, j: int, rank: int, key: str) -> "torch.Tensor":
    """Rank ``rank``'s flat ``key`` tensor (fp32) of sub-group ``j``: each parameter's
    ``ceil(numel / N)`` slice in layout order, the last rank's tail zero-padded. Slices are read
    straight from the files (``DcpSlices``); tensors it cannot read so are loaded whole through
    ``load_dcp_state`` in batches."""
    import torch

    params = layout.sub_groups[j]
    out = torch.empty(layout.sub_group_numel(j), dtype=torch.float32)
    batch: list[Any] = []
    size = 0

    def flush() -> None:
        keys = [_source_key(tp.source.name, key) for tp in batch]
        loaded = src.load(keys)
        for tp, k in zip(batch, keys):
            lo, hi = tp.rank_range(rank)
            out.narrow(0, tp.offset, hi - lo).copy_(loaded[k].reshape(-1)[lo:hi])
        batch.clear()

    for tp in params:
        lo, hi = tp.rank_range(rank)
        out.narrow(0, tp.offset + (hi - lo), tp.partition_numel - (hi - lo)).zero_()
        if hi > lo and not src.slices.read_into(_source_key(tp.source.name, key), lo, out.narrow(0, tp.offset, hi - lo)):
            batch.append(tp)
            size += tp.source.numel * 4
            if size >= BATCH_BYTES:
                flush()
                size = 0
    if batch:
        flush()
    return out


def _source_key(fqn: str, key: str) -> str:
    return f"{MODEL_KEY}.{fqn}" if key == FP32 else f"{OPTIM_KEY}.state.{fqn}.{key}"


@os_errors_named("converting the checkpoint")
def convert_dcp_to_zero3(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    world_size: int,
    tag: str | None = None,
    force: bool = False,
    verify: bool = True,
    warn: Callable[[str], None] | None = None,
    ds_config: str | os.PathLike[str] | dict[str, Any] | None = None,
    **options: Any,
) -> ConvertResult:
    """Write the FSDP2 (DCP) checkpoint ``source`` as the ZeRO-3 files of a DeepSpeed run at
    ``world_size`` ranks under ``output/<tag>`` (+ ``output/latest``, a manifest), for DeepSpeed's
    plain ``engine.load_checkpoint(output)``.

    ``ds_config`` (path or dict): the resuming run's DeepSpeed config; gives ``sub_group_size``,
    bf16 (``bf16_`` optim file names, module placeholders), the optimizer whose param-group format
    is written (FusedAdam; DeepSpeedCPUAdam with ``offload_optimizer``; torch's with ``torch_adam``
    or no ``optimizer`` block), and is recorded as ``ds_config``. Without it: DeepSpeed's defaults,
    FusedAdam, fp32. ``options``: ``sub_group_size`` overrides the config's.

    The source is verified against its manifest first (sizes, sha256 unless ``verify=False``);
    ``output`` must be new, empty or a shardkit checkpoint folder (an existing tag only with
    ``force``). Run it in one process (no process group): DCP reads would otherwise be collective.
    """
    import torch

    unknown = sorted(set(options) - {"sub_group_size"})
    if unknown:
        raise UsageError(f"convert_dcp_to_zero3: unknown option(s) {unknown}; accepted: ds_config, sub_group_size")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise UsageError(f"--world-size {world_size!r}: must be a whole number from 1 to {MAX_WORLD_SIZE} (the data-"
                         "parallel ranks of the resuming DeepSpeed run)")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise UsageError("convert_dcp_to_zero3 runs in one process, but a torch.distributed process group is "
                         "initialized here (its DCP reads would become collective); run `shardkit convert` outside "
                         "the training job")
    warn = warn or warn_unverified
    tag_dir = resolve_dcp_tag_dir(source)
    tag = check_tag(tag) if tag is not None else check_tag(tag_dir.name, "source tag (the source folder's name; no --tag given)")
    root = Path(output)
    check_output_root(root, tag, tag_dir, force=force)
    cfg = _read_ds_config(ds_config)
    sub_group_size, precision = _check_config(cfg)
    if options.get("sub_group_size") is not None:
        sub_group_size = int(options["sub_group_size"])
        if sub_group_size < 1:
            raise UsageError(f"sub_group_size {sub_group_size}: must be at least 1")
    checked = verify_before_reading(tag_dir, checksums=verify)
    for note in checked.warnings:
        warn(note)
    manifest = read_manifest(tag_dir) if (tag_dir / MANIFEST_NAME).is_file() else None
    if manifest is not None and manifest.engine != "fsdp2":
        raise UsageError(f"{tag_dir}: its manifest says engine {manifest.engine!r}, not 'fsdp2'; --to zero3 converts FSDP2 "
                         "checkpoints (a ZeRO-3 checkpoint at another world size: `shardkit reshard`)")

    src = _DcpSource(tag_dir)
    extra = manifest.extra if manifest is not None else {}
    hint = extra.get("buffers", (extra.get("converted_from") or {}).get("buffer_names"))
    plan = _plan(src, [str(n) for n in hint] if isinstance(hint, list) else None)
    decoupled = [bool(g.get("decoupled_weight_decay", False)) for g in plan.groups]
    opt = target_optimizer(cfg, all(decoupled))
    groups = _target_groups(plan, opt, cfg, tag_dir)

    slots = [ParamSlot(p.fqn, p.shape, p.numel, plan.param_group_of[p.fqn], 0, 0, 0) for p in plan.trainable]
    # plan_layout reads only ``slots`` when sub_group_size is given: the DCP parameters stand in
    # for a source ZeRO-3 checkpoint's (their sub_group/offset fields are unused)
    layout = plan_layout(SimpleNamespace(slots=slots), world_size, sub_group_size)  # type: ignore[arg-type]
    sub_steps = [_step_value([tp.source.name for tp in params], plan.steps, tag_dir) for params in layout.sub_groups]
    step = sub_steps[0][0] if sub_steps else 0
    user = dict(manifest.extra.get("user") or {}) if manifest is not None else {}
    global_steps = manifest.step if manifest is not None and isinstance(manifest.step, int) else step
    if global_steps != step:
        plan.notes.append(f"global_steps {global_steps} comes from the FSDP2 save's step; the Adam step is {step}")
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in plan.trainable} - {"float32"})
    if dtypes:
        plan.notes.append(f"parameters/moments saved as {dtypes} were upcast to float32 (ZeRO-3's masters and moments "
                          "are fp32); they are exact, but are not a float32 run's values")
    record_cfg = cfg if cfg is not None else _minimal_config(plan.groups[0], opt)
    if cfg is None:
        plan.notes.append("no ds_config given: DeepSpeed's defaults (sub_group_size 1e9, fp32, FusedAdam param groups); "
                          "pass the resuming run's config (--ds-config) when it sets sub_group_size, bf16 or offload")
    if cfg is not None and cfg.get("scheduler") is not None:
        plan.not_carried.append("lr_scheduler (ds_config has a 'scheduler'): the FSDP2 checkpoint holds no scheduler "
                                "state; load with engine.load_checkpoint(OUT, load_lr_scheduler_states=False) (the "
                                "scheduler then starts from its own step 0) or set its state yourself")
    counters = _counters(manifest, global_steps, cfg, plan)
    client: dict[str, Any] = {}
    for k, v in user.items():
        if k in DEEPSPEED_MODEL_KEYS:
            plan.not_carried.append(f"client_state.{k} ({v!r}): the name of an entry DeepSpeed writes itself")
        else:
            client[k] = v

    out = _Writer(src=src, plan=plan, layout=layout, opt=opt, groups=groups, sub_steps=sub_steps,
                  precision=precision, global_steps=global_steps, counters=counters, client=client, cfg=record_cfg)
    facts: dict[str, Any] = dict(world_size=world_size, step=global_steps, zero_stage=3, dtype=precision,
                 config_digest=config_digest(record_cfg),
                 extra={"converted_from": {"path": str(tag_dir), "engine": "fsdp2",
                                           "world_size": manifest.world_size if manifest else None,
                                           "verified": checked.level}})
    outcome = f"nothing written: the staging folder was removed, {root / LATEST_NAME} is unchanged"
    prefix = "bf16_" if precision == "bf16" else ""

    ranks = range(world_size)
    # optim files first (the large ones), so the small model files fill the gaps at the end
    files: list[tuple[str, Callable[[], dict[str, Any]]]] = (
        [(OPTIM_FILE.format(prefix=prefix, rank=r), partial(out.optim_states, r)) for r in ranks]
        + [(MODEL_FILE.format(rank=r), partial(out.model_states, r)) for r in ranks])

    # Byte-range copies release the GIL (preadv, crc32, sha256, write): one thread per rank file
    # (reshard's rule). Tensors that need dcp.load are produced one at a time.
    workers = default_workers(world_size) if out.all_segments() else 1
    with atomic_checkpoint(root, tag, engine="deepspeed", **facts) as save, closing(src.slices):
        # hashed as written (the manifest needs no second read), fsynced by the thread that wrote
        # it; the first failure cancels the files not yet started (stream.write_parallel)
        digests = write_parallel(
            [(save.path / name, lambda path, produce=produce: stream_save(produce(), path)) for name, produce in files],
            workers, outcome=outcome, thread_name="shardkit-convert")
        save.known_files = [FileEntry(name, d.size, d.sha256) for (name, _), d in zip(files, digests)]
        written = [e.path for e in save.known_files]
    final = root / tag
    carried = ["fp32 masters", "exp_avg", "exp_avg_sq", "step", "param_groups (lr, betas, eps, weight_decay)"]
    if plan.buffers:
        carried.append("buffers")
    if plan.frozen:
        carried.append("frozen parameters")
    if plan.aliases:
        carried.append("tied weights (shared_params)")
    carried += [f"client_state.{k}" for k in client]
    notes = list(plan.notes)
    notes.append(f"param groups written in {opt.name}'s format ({'AdamW' if opt.adam_w_mode else 'Adam'}); "
                 f"{len(layout.sub_groups)} sub-group(s) at sub_group_size {sub_group_size}")
    if opt.name in ("FusedAdam", "DeepSpeedCPUAdam"):
        notes.append("after engine.load_checkpoint, call shardkit.restore_cpu_adam_kernel_state(engine) on every rank of "
                     "a CPU run (DeepSpeed's CPU Adam kernels keep beta**step outside the checkpoint)")
    return ConvertResult(
        output=root, tag=tag, source_engine="fsdp2", target_engine="zero3", world_size=world_size,
        source_world_size=manifest.world_size if manifest is not None else 0,
        params=len(plan.trainable) + len(plan.frozen), bytes=sum((final / f).stat().st_size for f in written),
        carried=carried, not_carried=plan.not_carried, notes=notes, verified=checked.level)


class _Writer:
    """Each output rank's two dicts, in the key order DeepSpeed 0.19.8 writes them."""

    def __init__(self, *, src: _DcpSource, plan: _Plan, layout: TargetLayout, opt: TargetOptimizer,
                 groups: list[dict[str, Any]], sub_steps: list[tuple[int, Any]], precision: str, global_steps: int,
                 counters: dict[str, Any], client: dict[str, Any], cfg: dict[str, Any]):
        import deepspeed
        import torch

        self.src, self.plan, self.layout, self.opt, self.sub_steps = src, plan, layout, opt, sub_steps
        self.global_steps, self.counters, self.client, self.cfg = global_steps, counters, client, cfg
        self.ds_version = deepspeed.__version__
        self.module_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        buffers = src.load([f"{MODEL_KEY}.{n}" for n in plan.buffers]) if plan.buffers else {}
        self.frozen_full = src.load([f"{MODEL_KEY}.{p.fqn}" for p in plan.frozen]) if plan.frozen else {}
        params = {p.fqn for p in plan.trainable} | {p.fqn for p in plan.frozen} | set(plan.aliases)
        # a partitioned ZeRO-3 module's state_dict holds an empty tensor per parameter, buffers whole
        self.module: OrderedDict[str, Any] = OrderedDict(
            (n, torch.empty(0, dtype=self.module_dtype) if n in params else buffers[f"{MODEL_KEY}.{n}"])
            for n in plan.model_keys)
        self.param_shapes = [OrderedDict((tp.source.name, torch.Size(tp.source.shape)) for tp in sub)
                             for sub in layout.sub_groups]
        owners: dict[int, list[int]] = {}
        for j, g in enumerate(layout.sub_group_param_group):
            owners.setdefault(g, []).append(j)
        self.groups = [{**group, "params": owners.get(g, [])} for g, group in enumerate(groups)]

    def model_states(self, rank: int) -> dict[str, Any]:
        """``DeepSpeedEngine._common_checkpoint_state`` (+ client state, last, as ``state.update``)."""
        import torch

        plan, n = self.plan, self.layout.world_size
        sd: dict[str, Any] = dict(
            module=self.module, buffer_names=list(plan.buffers), optimizer=None, param_shapes=self.param_shapes,
            frozen_param_shapes=OrderedDict((p.fqn, torch.Size(p.shape)) for p in plan.frozen),
            shared_params=dict(plan.aliases),
            frozen_param_fragments=OrderedDict(
                (p.fqn, repartition_frozen(self.frozen_full[f"{MODEL_KEY}.{p.fqn}"].to(self.module_dtype), n, rank))
                for p in plan.frozen),
            lr_scheduler=self.counters.get("lr_scheduler"), data_sampler=None, random_ltd=None,
            skipped_steps=self.counters["skipped_steps"], global_steps=self.global_steps)
        if "global_samples" in self.counters:
            sd["global_samples"] = self.counters["global_samples"]
        sd.update(dp_world_size=n, mp_world_size=1, checkpoint_parallel_dimensions={"pp_degree": 1, "tp_degree": 1},
                  ds_config=self.cfg, ds_version=self.ds_version, **self.client)
        return sd

    def optim_states(self, rank: int) -> dict[str, Any]:
        """``_save_zero_checkpoint``'s dict around ``DeepSpeedZeroOptimizer_Stage3._rigid_state_dict``,
        with the flat tensors produced only when ``stream_save`` writes them."""
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum

        layout = self.layout
        state: dict[int, dict[str, Any]] = {}
        for j in range(len(layout.sub_groups)):
            count, raw = self.sub_steps[j]
            st: dict[str, Any] = {"step": raw.detach().clone().reshape(()) if self.opt.step_as_tensor else count}
            for key in ADAM_STATE_KEYS:
                st[key] = self._lazy(j, rank, key)
            state[j] = st
        osd = {
            "zero_stage": ZeroStageEnum.weights,
            "loss_scaler": LossScaler(1.0),  # bf16/fp32: DeepSpeed's static scale of 1 (fp16 is refused)
            "dynamic_loss_scale": False,
            "overflow": False,
            "partition_count": layout.world_size,
            "optimizer_state_dict": {"state": state, "param_groups": self.groups},
            "fp32_flat_groups": [self._lazy(j, rank, FP32) for j in range(len(layout.sub_groups))],
        }
        return {"optimizer_state_dict": osd, "ds_config": self.cfg, "ds_version": self.ds_version}

    def all_segments(self) -> bool:
        """Every flat tensor of every rank is a list of byte ranges (no ``dcp.load`` needed)."""
        return all(self._lazy(j, r, key).segments is not None for r in range(self.layout.world_size)
                   for j in range(len(self.layout.sub_groups)) for key in (FP32, *ADAM_STATE_KEYS))

    def _lazy(self, j: int, rank: int, key: str) -> LazyTensor:
        """Rank ``rank``'s flat ``key`` tensor of sub-group ``j``, written later by ``stream_save``:
        as byte ranges of the ``.distcp`` files and zero runs when every slice is float32 there
        (copied through one 1 MiB buffer, never built), else produced by ``_partition``."""
        import torch

        segments: list[Segment] = []
        for tp in self.layout.sub_groups[j]:
            lo, hi = tp.rank_range(rank)
            source = _source_key(tp.source.name, key)
            chunks = self.src.slices.chunks(source) if hi > lo else []
            meta = self.src.tensor_meta(source)
            if chunks is None or meta is None or meta.properties.dtype != torch.float32:
                segments = []
                break
            for ch in chunks:
                a, b = max(lo, ch.start), min(hi, ch.start + ch.numel)
                if b > a:
                    segments.append(Segment(str(ch.file), ch.data_offset + (a - ch.start) * 4, (b - a) * 4))
            if tp.partition_numel > hi - lo:
                segments.append(Segment(None, 0, (tp.partition_numel - (hi - lo)) * 4))
        else:
            return LazyTensor(self.layout.sub_group_numel(j), torch.float32,
                              _producer(self.src, self.layout, j, rank, key), segments=lambda: segments)
        return LazyTensor(self.layout.sub_group_numel(j), torch.float32, _producer(self.src, self.layout, j, rank, key))


def _producer(src: _DcpSource, layout: TargetLayout, j: int, rank: int, key: str) -> Callable[[], "torch.Tensor"]:
    return lambda: _partition(src, layout, j, rank, key)


def _minimal_config(group: dict[str, Any], opt: TargetOptimizer) -> dict[str, Any]:
    """What is recorded as ``ds_config`` when none was given: a ZeRO-3 Adam config with the source's hyperparameters."""
    params = {k: (list(group[k]) if k == "betas" else group[k]) for k in _HYPERPARAMETERS if k in group}
    return {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW" if opt.adam_w_mode else "Adam", "params": params}}


def _counters(manifest: Any, global_steps: int, cfg: dict[str, Any] | None, plan: _Plan) -> dict[str, Any]:
    """DeepSpeed's counters (and scheduler) for the model-states files. A DCP checkpoint converted
    from ZeRO-3 (``convert_zero3_to_dcp``) keeps them in its manifest's ``extra.converted_from``:
    they go back where they came from. Otherwise ``global_samples`` is ``global_steps`` times the
    config's ``train_batch_size`` (what DeepSpeed computes on load when it is missing)."""
    came = (manifest.extra.get("converted_from") if manifest is not None else None) or {}
    out: dict[str, Any] = {"skipped_steps": 0}
    if came.get("engine") == "deepspeed":
        for key in ("global_samples", "skipped_steps"):
            if isinstance(came.get(key), int):
                out[key] = came[key]
        if isinstance(came.get("lr_scheduler"), dict):
            out["lr_scheduler"] = came["lr_scheduler"]
            plan.notes.append("lr_scheduler state restored from the manifest's extra.converted_from (the ZeRO-3 "
                              "checkpoint this one was converted from)")
    tbs = (cfg or {}).get("train_batch_size")
    if "global_samples" not in out and isinstance(tbs, int) and not isinstance(tbs, bool):
        out["global_samples"] = global_steps * tbs
    return out
