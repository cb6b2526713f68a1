"""Planning the ZeRO-3 files ``convert --to zero3`` writes from the checkpoint model, before a byte
is written: the resuming run's config checked (``check_target_config``: stage 3, no fp16,
``sub_group_size``, precision), the optimizer its engine builds and the param-group format that
optimizer loads (``target_optimizer``, ``target_param_groups``), the sub-group layout at N ranks
(``zero3.repartition.layout_of``) in the order the source's param groups list their parameters,
the one Adam step each sub-group keeps, the names the resuming engine's module has, and DeepSpeed's
counters and client state. ``plan_zero3_target`` reads only the ``TrainingCheckpoint`` (its tensors'
names and the scalars its reader filled in), so every reader that describes the optimizer is planned
alike; it returns one ``writers.zero3.Zero3Target``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.model.tensors import SourceTensor
from shardkit.checkpoint.ops.convert.names import ADAM_STATE_KEYS, ADAM_TYPES, DEEPSPEED_PREFIX
from shardkit.checkpoint.writers.zero3 import TargetOptimizer, Zero3Target
from shardkit.checkpoint.zero3.checkpoint import ParamSlot
from shardkit.checkpoint.zero3.layout import DEEPSPEED_MODEL_KEYS, DEFAULT_SUB_GROUP_SIZE
from shardkit.checkpoint.zero3.repartition import layout_of
from shardkit.config.loading import load_config
from shardkit.config.paths import get
from shardkit.core.errors import CheckpointError, UsageError

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
"""torch Adam flags DeepSpeed's Adam has no state or code for (amsgrad keeps max_exp_avg_sq)."""


def read_ds_config(ds_config: str | os.PathLike[str] | dict[str, Any] | None) -> dict[str, Any] | None:
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


def check_target_config(cfg: dict[str, Any] | None) -> tuple[int, str]:
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


@dataclass(frozen=True)
class SourcePrecision:
    """What the source says about the precision its run trained in."""

    precision: str | None
    """'bf16', 'fp16' or 'fp32' when the source tells it for sure; None when it cannot (float32
    tensors from FSDP2, which keeps float32 parameters also under a bf16 MixedPrecisionPolicy)."""
    seen: str
    """Where that was read, with the value: for messages."""


def source_precision(ckpt: TrainingCheckpoint) -> SourcePrecision:
    """The training precision of the run that wrote ``ckpt``: what its reader saw (``precision_seen``:
    the DCP reader, which may not know), else the format's own record (DeepSpeed's ds_config)."""
    seen = ckpt.scalars.get("precision_seen")
    if seen is not None:
        return SourcePrecision(seen[0], seen[1])
    return SourcePrecision(ckpt.precision, f"the {ckpt.format} checkpoint's precision {ckpt.precision!r}")


def decide_precision(cfg: dict[str, Any] | None, config_precision: str, seen: SourcePrecision, tag_dir: Path,
                     notes: list[str]) -> str:
    """The precision the files are written for: the resuming run's config when one was given, else
    the source's own when it tells it; refused when neither does.

    It decides the optim files' names (``bf16_zero_pp_rank_0_...`` for bf16) and DeepSpeed
    0.19.8's ``load_checkpoint`` looks for exactly one naming: its fallback to the other
    (``_get_all_zero_checkpoints``) only runs when ``_get_all_zero_checkpoint_names`` returns None,
    which it never does, so a guess that is wrong ends in ``FileNotFoundError: ...bf16_zero_pp_rank_0_...``
    inside DeepSpeed."""
    if cfg is not None:
        if seen.precision is not None and seen.precision != config_precision:
            notes.append(f"the source trained in {seen.precision} ({seen.seen}); the files are written for the given "
                         f"config's {config_precision} (the fp32 masters and moments are the same either way)")
        return config_precision
    if seen.precision == "fp16":
        raise UsageError(f"{tag_dir}: trained in fp16 ({seen.seen}) and no --ds-config was given: an fp16 ZeRO-3 run "
                         "needs its loss-scaler state, which an FSDP2 checkpoint does not hold. Pass the resuming run's "
                         "config with bf16 or fp32: --ds-config FILE (ds_config= in Python)")
    if seen.precision is not None:
        notes.append(f"precision {seen.precision} taken from the source ({seen.seen}): the optim files are named "
                     f"{'bf16_zero_pp_rank_*' if seen.precision == 'bf16' else 'zero_pp_rank_*'}; no --ds-config was "
                     "given, so DeepSpeed's other defaults apply (sub_group_size 1e9, FusedAdam, no offload)")
        return seen.precision
    raise UsageError(
        f"{tag_dir}: no --ds-config given and the source does not tell the precision of the resuming run: "
        f"{seen.seen}, and FSDP2 keeps float32 parameters also when a MixedPrecisionPolicy trains in bf16. The "
        "precision decides the files' names (bf16: bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt; fp32: "
        "zero_pp_rank_0_mp_rank_00_optim_states.pt) and DeepSpeed's load_checkpoint finds only its own (a wrong "
        "guess fails later with FileNotFoundError). Pass the resuming run's DeepSpeed config: --ds-config "
        "ds_config.json (ds_config= in Python; it also gives sub_group_size and offload)")


NAME_PREFIXES = ("", DEEPSPEED_PREFIX)
"""What ``name_prefix`` may be: no prefix, or the ``module.`` a wrapped model's names carry."""


def target_names(ckpt: TrainingCheckpoint, name_prefix: str | None, notes: list[str]) -> dict[str, str]:
    """Source FQN -> the name the resuming engine's module has, for every model key that changes.

    ``engine.load_checkpoint`` matches the ``module`` dict and the frozen fragments by name against
    ``engine.module`` (a strict ``load_state_dict``), so they must be the resuming model's names:
    with ``module.`` when the model handed to ``deepspeed.initialize`` is itself a wrapper holding it
    as ``.module`` (a DDP-style wrapper), without it otherwise. ``name_prefix``: ``"module."`` or
    ``""``; None: the prefix a ZeRO-3 checkpoint had before ``--to fsdp2`` removed it (recorded in
    ``extra.converted_from.name_prefix``), else the source's names as they are. A source where some
    names carry the prefix and others do not cannot be mapped either way without guessing: refused."""
    if name_prefix is not None and name_prefix not in NAME_PREFIXES:
        raise UsageError(f"name_prefix {name_prefix!r}: must be 'module.' (the resuming engine's model is a wrapper "
                         "holding it as .module, names like module.model.embed_tokens.weight) or '' (names as the "
                         "model's own named_parameters())")
    tag_dir = ckpt.folder
    came = ckpt.scalars.get("source") or {}
    recorded = came.get("name_prefix") if came.get("engine") == "deepspeed" else None
    want = name_prefix if name_prefix is not None else (recorded if recorded in NAME_PREFIXES else None)
    keys = [*ckpt.weights, *ckpt.aliases]
    with_prefix = [n for n in keys if n.startswith(DEEPSPEED_PREFIX)]
    without = [n for n in keys if not n.startswith(DEEPSPEED_PREFIX)]
    if want is None:
        if with_prefix and not without:
            notes.append(f"every name starts with {DEEPSPEED_PREFIX!r} (the FSDP2 model was a wrapper) and is "
                              "written so: the resuming DeepSpeed model must be wrapped the same way; for an "
                              "unwrapped one convert with name_prefix=''")
        return {}
    if with_prefix and without:
        raise UsageError(
            f"{tag_dir}: cannot give every name the prefix {want!r} or none: some model keys have "
            f"{DEEPSPEED_PREFIX!r} ({with_prefix[:2]}) and some do not ({without[:2]}), so which of them belong to "
            "a wrapper is ambiguous (a submodule named 'module' looks the same). Save the FSDP2 checkpoint from the "
            "unwrapped model, or convert with name_prefix=None to keep the names as they are")
    if want == DEEPSPEED_PREFIX and without:
        mapping = {n: DEEPSPEED_PREFIX + n for n in keys}
        notes.append(f"names written with the prefix {DEEPSPEED_PREFIX!r} (e.g. {mapping[keys[0]]}): the "
                          "resuming engine's model is a wrapper holding the model as .module"
                          + (" (recorded when this checkpoint was converted from ZeRO-3)" if name_prefix is None else ""))
        return mapping
    if want == "" and with_prefix:
        mapping = {n: n[len(DEEPSPEED_PREFIX):] for n in keys}
        notes.append(f"the prefix {DEEPSPEED_PREFIX!r} removed from every name (e.g. {keys[0]} -> "
                          f"{mapping[keys[0]]}): the resuming engine's model is not wrapped")
        return mapping
    return {}


@dataclass
class Zero3Plan:
    """``plan_zero3_target``'s result: the target, and what the result reports."""

    target: Zero3Target
    notes: list[str] = field(default_factory=list)
    not_carried: list[str] = field(default_factory=list)


def plan_zero3_target(ckpt: TrainingCheckpoint, cfg: dict[str, Any] | None, world_size: int, sub_group_size: int,
                      precision: str, names: dict[str, str], notes: list[str]) -> Zero3Plan:
    """The ZeRO-3 files for ``world_size`` ranks of the run ``cfg`` configures (None: DeepSpeed's
    defaults) holding ``ckpt``; what the target cannot hold is refused (UsageError, CheckpointError)
    or added to ``not_carried``, what it changes to ``notes``."""
    tag_dir = ckpt.folder
    not_carried: list[str] = list(ckpt.scalars.get("not_carried") or [])
    source_groups, opt, groups = target_groups(ckpt, cfg, not_carried)
    shapes = {n: ckpt.weights[n].shape for n in ckpt.optimizer}
    # the source's parameters in their groups' order (the sub_group/offset fields of a ZeRO-3 source are unused)
    slots = [ParamSlot(n, shapes[n], ckpt.weights[n].numel, g, 0, 0, 0)
             for g, group in enumerate(source_groups) for n in group["params"]]
    layout = layout_of(slots, world_size, sub_group_size, {}, tag_dir)
    steps: dict[str, float] = dict(ckpt.scalars.get("step") or {})
    step_tensors: dict[str, SourceTensor] = dict(ckpt.scalars.get("step_tensors") or {})
    sub_steps = [_step_value([tp.source.name for tp in params], steps, step_tensors, tag_dir) for params in layout.sub_groups]
    step = sub_steps[0][0] if sub_steps else 0
    counters = dict(ckpt.scalars.get("counters") or {})
    global_steps = counters.pop("global_steps", step)
    if global_steps != step:
        notes.append(f"global_steps {global_steps} comes from the source's step counter; the Adam step is {step}")
    counters.setdefault("skipped_steps", 0)
    dtypes = sorted({ckpt.weights[n].dtype for n in ckpt.optimizer} - {"float32"})
    if dtypes:
        notes.append(f"parameters/moments saved as {dtypes} were upcast to float32 (ZeRO-3's masters and moments "
                     "are fp32); they are exact, but are not a float32 run's values")
    record_cfg = cfg if cfg is not None else minimal_config(source_groups[0], opt)
    client = carry_run_state(ckpt, cfg, counters, global_steps, precision, notes, not_carried)
    target = Zero3Target(opt=opt, groups=groups, layout=layout, sub_steps=sub_steps, global_steps=global_steps,
                         counters=counters, client=client, cfg=record_cfg, precision=precision, names=names)
    return Zero3Plan(target, notes, not_carried)


def check_adam(ckpt: TrainingCheckpoint) -> None:
    """Only Adam/AdamW state (exp_avg, exp_avg_sq, step) has a place in DeepSpeed's Adam (every DeepSpeed target)."""
    kind = str(ckpt.scalars.get("optimizer_type") or "")
    if kind and kind.lower() not in ADAM_TYPES:
        raise UsageError(f"{ckpt.folder}: its optimizer is {kind!r}: only Adam/AdamW state (exp_avg, exp_avg_sq, step) "
                         "converts to DeepSpeed's Adam; resume it with its own optimizer instead")
    for name, states in ckpt.optimizer.items():
        if set(states) != set(ADAM_STATE_KEYS):
            raise UsageError(f"{ckpt.folder}: optimizer state of {name} holds {sorted(states)}, not exactly "
                             f"{list(ADAM_STATE_KEYS)}: not plain Adam/AdamW (amsgrad keeps max_exp_avg_sq), and "
                             "DeepSpeed's Adam has no place for it. Only Adam/AdamW without amsgrad converts")
    if not ckpt.optimizer:
        raise CheckpointError(f"{ckpt.folder}: holds no per-parameter optimizer state (the optimizer never stepped); "
                              "the target checkpoint needs fp32 masters and Adam moments. Convert a checkpoint saved "
                              "after at least one step")


def source_param_groups(ckpt: TrainingCheckpoint) -> list[dict[str, Any]]:
    """The source's param groups (``params``: trainable names), checked against its optimizer state."""
    groups = [dict(g) for g in (ckpt.scalars.get("param_groups") or [{"params": ckpt.trainable}])]
    listed = [n for g in groups for n in g.get("params") or []]
    missing = [n for n in ckpt.optimizer if n not in listed]
    strangers = [n for n in listed if n not in ckpt.optimizer]
    if missing or strangers or len(set(listed)) != len(listed):
        raise CheckpointError(f"{ckpt.folder}: the param groups list {len(listed)} parameters, the optimizer state "
                              f"holds {len(ckpt.optimizer)} (not listed: {missing[:3]}; listed without state: "
                              f"{strangers[:3]}); its optimizer and model state disagree (files of different saves?)")
    # ZeRO-3 lays each group out in the order the resuming run hands DeepSpeed its parameters, which is
    # model.parameters() order; a source optimizer may list them otherwise (FSDP1 keys them in its flat
    # units' order, the root unit's embedding and head after the decoder layers), and
    # _rigid_load_state_dict copies flat tensors without looking at names
    order = {n: i for i, n in enumerate(ckpt.weights)}
    for g in groups:
        g["params"] = sorted(g.get("params") or [], key=lambda n: order[n])
    return groups


def group_decoupled(ckpt: TrainingCheckpoint, group: dict[str, Any]) -> bool | None:
    """Whether a source group decays weights AdamW-style: its own flag (torch), else the source's
    config (DeepSpeed's Adam is AdamW unless ``adam_w_mode: false``); None when neither says (a
    client optimizer the config does not name): the resuming run's config decides then."""
    if "decoupled_weight_decay" in group:
        return bool(group["decoupled_weight_decay"])
    if ckpt.scalars.get("adam_w_mode") is not None:
        return bool(ckpt.scalars["adam_w_mode"])
    return None


def _step_value(names: list[str], steps: dict[str, float], step_tensors: dict[str, SourceTensor],
                source: Path) -> tuple[int, SourceTensor | None]:
    """The one step count of a sub-group (ZeRO-3 keeps one per sub-group; torch one per parameter)."""
    step = single_adam_step(names, steps, str(source), "parameters that share a ZeRO-3 sub-group",
                            "ZeRO-3 keeps one step per sub-group, so their bias corrections cannot all be kept")
    return step, step_tensors.get(names[0])


def single_adam_step(names: list[str], steps: dict[str, float], where: str, sharing: str, rule: str) -> int:
    """The one Adam step the parameters ``names`` share in the target (a ZeRO-3 sub-group, a ZeRO-1/2 param
    group: both keep one step where torch keeps one per parameter); ``where`` starts each error, ``sharing``
    says which parameters must agree and ``rule`` why."""
    missing = [n for n in names if n not in steps]
    if missing:
        raise CheckpointError(f"{where}: no Adam step recorded for {missing[:3]}; Adam's bias correction needs it")
    distinct = sorted({steps[n] for n in names})
    if len(distinct) != 1:
        first = {v: next(n for n in names if steps[n] == v) for v in distinct}
        raise CheckpointError(
            f"{where}: {sharing} have different Adam step counts ("
            + ", ".join(f"{n}: {v:g}" for v, n in first.items())
            + f"): {rule}. Parameters that missed optimizer steps (no gradient) cause this; convert a checkpoint "
            "where all trained together, or put them in separate param groups")
    step = distinct[0]
    if step != int(step) or step < 1:
        raise CheckpointError(f"{where}: Adam step is {step:g}, expected a positive whole number")
    return int(step)


def target_groups(ckpt: TrainingCheckpoint, cfg: dict[str, Any] | None,
                  not_carried: list[str]) -> tuple[list[dict[str, Any]], TargetOptimizer, list[dict[str, Any]]]:
    """The source's Adam param groups, the target optimizer (``cfg``'s, AdamW unless a source group is not) and
    its param groups: what every DeepSpeed target (ZeRO-1/2, ZeRO-3) decides the same way."""
    check_adam(ckpt)
    source_groups = source_param_groups(ckpt)
    decoupled = [group_decoupled(ckpt, g) for g in source_groups]
    opt = target_optimizer(cfg, all(d is not False for d in decoupled))
    return source_groups, opt, target_param_groups(source_groups, decoupled, opt, cfg, ckpt.folder, not_carried)


def target_param_groups(source_groups: list[dict[str, Any]], decoupled_groups: list[bool | None], opt: TargetOptimizer,
                   cfg: dict[str, Any] | None, source: Path, not_carried: list[str]) -> list[dict[str, Any]]:
    """The inner optimizer's param groups in the target optimizer's own format (``params`` filled later)."""
    out = []
    cfg_params = get(cfg or {}, "optimizer.params", {}) or {}
    for g, group in enumerate(source_groups):
        for flag in _TORCH_FLAGS_MUST_BE_OFF:
            if group.get(flag):
                raise UsageError(f"{source}: param_groups[{g}].{flag} is {group[flag]!r}: DeepSpeed's ZeRO-3 Adam has no "
                                 f"{flag} mode, so this state would train differently. Convert a checkpoint trained "
                                 f"with {flag}=False")
        decoupled = opt.adam_w_mode if decoupled_groups[g] is None else decoupled_groups[g]
        if decoupled != opt.adam_w_mode and float(group.get("weight_decay", 0.0)) != 0.0:
            seen = "AdamW (decoupled_weight_decay=True)" if decoupled else "Adam (L2 weight decay)"
            want = "AdamW" if opt.adam_w_mode else "Adam with L2 weight decay"
            raise UsageError(f"{source}: param_groups[{g}] was trained with {seen}, weight_decay "
                             f"{group.get('weight_decay')}, but the target config builds {want}. Set ds_config "
                             f"optimizer.type to {'AdamW' if decoupled else 'Adam'}"
                             f"{'' if decoupled else ' with params.adam_w_mode false'}")
        if opt.name == "torch":
            new = {k: v for k, v in group.items() if k != "params"}
            new.setdefault("decoupled_weight_decay", opt.adam_w_mode)
        else:
            new = dict(_GROUP_FORMATS[opt.name])
            new.update({k: cfg_params[k] for k in new if k in cfg_params and k not in _HYPERPARAMETERS})
            for k in _HYPERPARAMETERS:
                if k in group:
                    new[k] = tuple(group[k]) if k == "betas" else group[k]
            dropped = sorted(k for k in group if k not in new and k not in ("params", *_TORCH_FLAGS_MUST_BE_OFF,
                             "decoupled_weight_decay", "foreach", "capturable", "differentiable", "fused"))
            if dropped:
                not_carried.append(f"param_groups[{g}] entries {dropped}: {opt.name}'s param groups have no such "
                                        "keys (set them in the resuming run if they matter)")
        out.append(new)
    return out


def minimal_config(group: dict[str, Any], opt: TargetOptimizer) -> dict[str, Any]:
    """What is recorded as ``ds_config`` when none was given: a ZeRO-3 Adam config with the source's hyperparameters."""
    params = {k: (list(group[k]) if k == "betas" else group[k]) for k in _HYPERPARAMETERS if k in group}
    return {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW" if opt.adam_w_mode else "Adam", "params": params}}


def carry_run_state(ckpt: TrainingCheckpoint, cfg: dict[str, Any] | None, counters: dict[str, Any], global_steps: int,
                    precision: str, notes: list[str], not_carried: list[str]) -> dict[str, Any]:
    """The run state besides tensors every DeepSpeed writer (ZeRO-3, ZeRO-1/2) records, in one place: the LR
    scheduler into ``counters`` (or named as not carried), ``global_samples``, the loss scaler (named: the
    files are written for a static scale of 1); returns the client state to write (DeepSpeed's own key
    names named as not carried)."""
    if ckpt.scalars.get("lr_scheduler") is not None:
        counters["lr_scheduler"] = ckpt.scalars["lr_scheduler"]
        notes.append("lr_scheduler state restored from the source (the ZeRO-3 checkpoint this one was converted "
                     "from)" if ckpt.format == "dcp" else "lr_scheduler state carried from the source")
    elif cfg is not None and cfg.get("scheduler") is not None:
        not_carried.append(f"lr_scheduler (ds_config has a 'scheduler'): the {ckpt.format} checkpoint holds no "
                           "scheduler state; load with engine.load_checkpoint(OUT, load_lr_scheduler_states=False) "
                           "(the scheduler then starts from its own step 0) or set its state yourself")
    tbs = (cfg or {}).get("train_batch_size")
    if "global_samples" not in counters and isinstance(tbs, int) and not isinstance(tbs, bool):
        counters["global_samples"] = global_steps * tbs
    scaler = ckpt.scalars.get("loss_scaler")
    if scaler:
        not_carried.append(f"loss_scaler (cur_scale={scaler.get('cur_scale')}, dynamic={scaler.get('dynamic')}): "
                           f"the files are written for a {precision} run, which keeps a static scale of 1")
    client: dict[str, Any] = {}
    for k, v in (ckpt.scalars.get("client_state") or {}).items():
        if k in DEEPSPEED_MODEL_KEYS:
            not_carried.append(f"client_state.{k} ({v!r}): the name of an entry DeepSpeed writes itself")
        else:
            client[k] = v
    return client
