"""Planning ``convert_zero3_to_dcp``'s output from the ZeRO-3 source's metadata, before a byte is
written: the FSDP names (``names.build_name_map``), one torch param group per ZeRO-3 param group with
its hyperparameters and ``decoupled_weight_decay``, ``step`` per sub-group, and everything that is
carried, refused or reported (optimizer type and state keys, loss scaler, scheduler, client state).
``plan_dcp_target`` returns it all as one ``DcpTarget``; the source module turns it into the lazy
state dict and the write module writes that.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from shardkit.checkpoint.ops.convert.names import (
    ADAM_STATE_KEYS,
    ADAM_TYPES,
    NameMap,
    Uncarried,
    build_name_map,
)
from shardkit.checkpoint.zero3.checkpoint import Zero3Checkpoint
from shardkit.checkpoint.zero3.layout import client_state_keys
from shardkit.storage.torch_load import TensorRef

_GROUP_KEYS_WITHOUT_TORCH_MEANING = {
    "step": "the optimizer's group-level step counter (FusedAdam/CPUAdam); torch keeps step per parameter, "
            "carried from the sub-group state",
    "bias_correction": "True is torch Adam's only behaviour",
}
# Param-group keys of non-Adam DeepSpeed optimizers: a client optimizer with these is not Adam even
# when its state keys look like it (FusedLamb keeps exp_avg/exp_avg_sq too).
_NON_ADAM_GROUP_KEYS = ("max_coeff", "min_coeff", "max_grad_norm", "freeze_step", "cuda_aware", "comm_backend_name")


@dataclass
class DcpTarget:
    """Everything decided before a byte is written (``plan_dcp_target``)."""

    names: NameMap
    groups: list[dict[str, Any]]
    """torch param groups (``params``: FQNs)."""
    steps: list[float]
    """``step`` of each ZeRO-3 sub-group."""
    uncarried: list[Uncarried] = field(default_factory=list)
    carried: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    user: dict[str, Any] = field(default_factory=dict)
    """JSON client state -> manifest ``extra.user`` (what ``load_fsdp_checkpoint`` hands back)."""
    deepspeed: dict[str, Any] = field(default_factory=dict)
    """DeepSpeed facts with no FSDP2 slot, kept in manifest ``extra.converted_from``."""


def _kind(value: Any) -> str:
    """What a value is, in the user's words: a tensor read without torch is still a Tensor."""
    return "Tensor" if isinstance(value, TensorRef) else type(value).__name__


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _optimizer_checks(ckpt: Zero3Checkpoint, plan: DcpTarget) -> None:
    cfg = ckpt.ds_config.get("optimizer") or {}
    kind = str(cfg.get("type") or "")
    if kind and kind.lower() not in ADAM_TYPES:
        plan.uncarried.append(Uncarried("optimizer.type", repr(kind), "only Adam/AdamW state (exp_avg, exp_avg_sq, "
                                        "step) means the same to FSDP2's torch.optim.AdamW", "train with "
                                        "optimizer.type Adam or AdamW, or resume with DeepSpeed", refused=True))
        return
    keys = set(ckpt.state_keys)
    if keys != set(ADAM_STATE_KEYS):
        seen = sorted(keys) or "none (the optimizer never stepped)"
        plan.uncarried.append(Uncarried("optimizer.state", f"per-element keys {seen}", f"Adam/AdamW keeps exactly "
                                        f"{list(ADAM_STATE_KEYS)}", "convert a checkpoint saved after at least one "
                                        "step of an Adam/AdamW optimizer (for weights only: shardkit consolidate)",
                                        refused=True))
    marks = sorted({k for g in ckpt.param_groups for k in _NON_ADAM_GROUP_KEYS if k in g})
    if not kind and marks:
        plan.uncarried.append(Uncarried("optimizer.type", f"client optimizer with param-group keys {marks}",
                                        "those keys belong to LAMB/1-bit optimizers, whose state means something "
                                        "else than AdamW's", "resume with DeepSpeed", refused=True))
    elif not kind:
        plan.notes.append("the optimizer is not named in ds_config (a client optimizer); its state holds exactly "
                          "exp_avg/exp_avg_sq, so it is read as Adam/AdamW")
    for i, g in enumerate(ckpt.param_groups):
        if g.get("amsgrad"):
            plan.uncarried.append(Uncarried(f"param_groups[{i}].amsgrad", "True", "the checkpoint has no "
                                            "max_exp_avg_sq state to carry", "convert a run with amsgrad off",
                                            refused=True))
        if g.get("bias_correction", True) is False:
            plan.uncarried.append(Uncarried(f"param_groups[{i}].bias_correction", "False", "torch's Adam/AdamW "
                                            "always corrects the moments' bias, so the run would step differently",
                                            "resume with DeepSpeed", refused=True))


def _decoupled(ckpt: Zero3Checkpoint, group: dict[str, Any], index: int, adam_w_mode: bool | None, plan: DcpTarget) -> bool:
    """Whether group ``index`` decays weights AdamW-style: the group's own flag (torch optimizers),
    then ds_config (DeepSpeed's Adam is AdamW unless ``adam_w_mode: false``), then ``adam_w_mode``."""
    if "decoupled_weight_decay" in group:
        return bool(group["decoupled_weight_decay"])
    cfg = ckpt.ds_config.get("optimizer") or {}
    kind = str(cfg.get("type") or "").lower()
    if kind == "adamw":
        return True
    if kind == "adam":
        return bool((cfg.get("params") or {}).get("adam_w_mode", True))
    if adam_w_mode is not None:
        return adam_w_mode
    if float(group.get("weight_decay") or 0.0) != 0.0:
        plan.uncarried.append(Uncarried(f"param_groups[{index}].weight_decay", repr(group["weight_decay"]),
                                        "the client optimizer is not named in ds_config, so whether it decays "
                                        "weights AdamW-style (decoupled) or Adam-style (L2) is unknown",
                                        "pass --adam-w-mode on (AdamW) or off (Adam) (adam_w_mode=True/False)",
                                        refused=True))
    return True


#: torch.optim.AdamW's param-group keys and defaults (torch 2.13: AdamW's constructor over Adam's,
#: which has every key, plus the ``decoupled_weight_decay=True`` AdamW passes on). DCP load needs
#: every key the resuming optimizer's groups hold (``optim.param_groups.<i>.<key>``). Written out, not
#: read from torch: the converter never imports torch (tests/test_convert_zero3_to_fsdp.py checks these
#: against the installed torch's constructors).
ADAMW_GROUP_DEFAULTS: dict[str, Any] = {
    "lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0.01, "amsgrad": False, "foreach": None,
    "maximize": False, "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True,
}


def plan_dcp_target(ckpt: Zero3Checkpoint, optim0: dict[str, Any], adam_w_mode: bool | None) -> DcpTarget:
    """What the DCP output of ``ckpt`` holds, from its metadata and rank 0's optimizer state
    ``optim0``; what cannot be carried is listed in ``uncarried`` (the caller refuses or reports it)."""
    buffers = list(ckpt.buffers())
    names = build_name_map([*(s.name for s in ckpt.slots), *ckpt.frozen_param_shapes, *buffers], ckpt.shared_params)
    state = optim0["optimizer_state_dict"].get("state") or {}
    steps = [float((state.get(j) or {}).get("step", 0)) for j in range(len(ckpt.sub_group_numel))]
    plan = DcpTarget(names=names, groups=[], steps=steps, notes=names.notes())
    _optimizer_checks(ckpt, plan)
    defaults = dict(ADAMW_GROUP_DEFAULTS)
    dropped_by_value: dict[str, list[int]] = {}
    for i, g in enumerate(ckpt.param_groups):
        group = dict(defaults)
        dropped = []
        for k, v in g.items():
            if k in _GROUP_KEYS_WITHOUT_TORCH_MEANING:
                dropped.append(f"{k}={v!r}")
            elif k in defaults or _jsonable(v):
                group[k] = tuple(v) if k == "betas" else v
            else:
                plan.uncarried.append(Uncarried(f"param_groups[{i}].{k}", _kind(v), "not a value torch can "
                                                "keep in a param group's JSON", "set it again after loading",
                                                refused=False))
        group["decoupled_weight_decay"] = _decoupled(ckpt, g, i, adam_w_mode, plan)
        group["params"] = [names.fsdp_name(s.name) for s in ckpt.slots if s.param_group == i]
        plan.groups.append(group)
        if dropped:
            dropped_by_value.setdefault(", ".join(dropped), []).append(i)
    for dropped_keys, indices in dropped_by_value.items():
        plan.notes.append(f"param_groups {indices}: {dropped_keys} not written (DeepSpeed optimizer keys with no "
                          f"torch counterpart: {'; '.join(f'{k}: {v}' for k, v in _GROUP_KEYS_WITHOUT_TORCH_MEANING.items())})")
    layout = "; ".join(f"[{i}] {len(g['params'])} params, lr={g['lr']}, weight_decay={g['weight_decay']}"
                       for i, g in enumerate(plan.groups))
    plan.notes.append(f"param groups written: {layout}. Build the resuming optimizer with the same groups over "
                      "the same (trainable) parameters: torch's load_state_dict refuses groups of other sizes")
    hyper = sorted({k for g in ckpt.param_groups for k in g if k not in _GROUP_KEYS_WITHOUT_TORCH_MEANING})
    plan.carried = [f"fp32 masters ({len(ckpt.slots)} trainable)", *ADAM_STATE_KEYS, "step",
                    f"param_groups x{len(plan.groups)} ({', '.join(hyper)})"]
    if ckpt.frozen_param_shapes:
        plan.carried.append(f"frozen parameters ({len(ckpt.frozen_param_shapes)}, no optimizer state)")
    if buffers:
        plan.carried.append(f"buffers ({len(buffers)})")
    if names.aliases:
        plan.carried.append(f"tied names ({', '.join(sorted(names.aliases))})")
    plan.notes.append("fused/foreach/capturable are written as torch's defaults (DeepSpeed has none): they override "
                      "the resuming optimizer's own at load; set them again after load_fsdp_checkpoint if you use them")
    _loss_scaler(ckpt, optim0, plan)
    _scheduler_and_client_state(ckpt, plan)
    return plan


def _loss_scaler(ckpt: Zero3Checkpoint, optim0: dict[str, Any], plan: DcpTarget) -> None:
    scaler = optim0.get("loss_scaler")
    dynamic = bool(optim0.get("dynamic_loss_scale"))
    cur = getattr(scaler, "cur_scale", 1.0)
    if not dynamic and cur == 1.0 and ckpt.precision != "fp16":
        return  # a static scale of 1 (bf16/fp32): there is no state to lose
    kept = {k: v for k, v in vars(scaler).items() if k != "args" and _jsonable(v)} if scaler is not None else {}
    kept["dynamic"] = dynamic
    plan.deepspeed["loss_scaler"] = kept
    plan.uncarried.append(Uncarried("loss_scaler", f"cur_scale={cur}, dynamic={dynamic}", "shardkit's FSDP2 "
                                    "checkpoint holds no loss scaler (torch.amp.GradScaler is the training "
                                    "script's)", "its state is in the manifest's extra.converted_from.loss_scaler: "
                                    f"start torch.amp.GradScaler(init_scale={cur}) to continue at the same scale",
                                    refused=False))


def _scheduler_and_client_state(ckpt: Zero3Checkpoint, plan: DcpTarget) -> None:
    ms = ckpt.model_state
    for key in ("global_steps", "global_samples", "skipped_steps"):
        if isinstance(ms.get(key), int):
            plan.deepspeed[key] = ms[key]
    sched = ms.get("lr_scheduler")
    if sched:
        # Decision: the scheduler's state is kept (JSON) in the manifest and reported, not refused:
        # the current lr is already in every param group, so training continues at the lr it had; a
        # schedule continues only once the script rebuilds its scheduler from this state.
        where = "kept in the manifest's extra.converted_from.lr_scheduler" if _jsonable(sched) else "not kept (not JSON)"
        if _jsonable(sched):
            plan.deepspeed["lr_scheduler"] = sched
        plan.uncarried.append(Uncarried("lr_scheduler", f"{len(sched)} keys" if isinstance(sched, dict) else
                                        _kind(sched), "shardkit's FSDP2 checkpoint has no scheduler; the "
                                        "param groups' lr is carried, so training resumes at the current lr",
                                        f"its state_dict is {where}: load it into the script's scheduler",
                                        refused=False))
    for key in client_state_keys(ms):
        if _jsonable(ms[key]):
            plan.user[key] = ms[key]
        else:
            plan.uncarried.append(Uncarried(f"client_state.{key}", _kind(ms[key]), "not JSON, and the "
                                            "FSDP2 checkpoint keeps the script's state in the manifest's extra.user",
                                            "save it in the training script's own file", refused=False))
    if plan.user:
        plan.carried.append(f"client_state ({', '.join(sorted(plan.user))}) -> manifest extra.user")
        if ckpt.world_size > 1:
            plan.notes.append(f"client_state comes from rank 0's file (saved at {ckpt.world_size} ranks); per-rank "
                              "values (data-loader positions, RNG) must be rebuilt by the training script")
