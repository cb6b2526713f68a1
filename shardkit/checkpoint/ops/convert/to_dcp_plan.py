"""Planning ``convert --to fsdp2``'s output from the checkpoint model, before a byte is written: the
FSDP names (``names.build_name_map``), one torch param group per source param group with its
hyperparameters and ``decoupled_weight_decay``, ``step`` per parameter, and everything that is
carried, refused or reported (optimizer type and state keys, loss scaler, scheduler, client
state). ``plan_dcp_target`` reads only the ``TrainingCheckpoint`` (its tensors' names and the
scalars its reader filled in: ``readers.deepspeed_scalars`` lists them), so every reader that
describes the optimizer is planned alike; it returns one ``DcpTarget`` whose ``layout`` the DCP
writer (``writers.dcp``) writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.ops.convert.names import (
    ADAM_STATE_KEYS,
    ADAM_TYPES,
    NameMap,
    Uncarried,
    build_name_map,
)
from shardkit.checkpoint.readers.deepspeed_scalars import jsonable
from shardkit.checkpoint.writers.dcp import DcpLayout
from shardkit.checkpoint.writers.dcp_format import is_plain
from shardkit.core.errors import CheckpointError
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
    layout: DcpLayout
    """What the writer writes: FQNs, aliases, torch param groups (``params``: FQNs), steps."""
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


def _optimizer_checks(ckpt: TrainingCheckpoint, groups: list[dict[str, Any]], plan: DcpTarget) -> None:
    kind = str(ckpt.scalars.get("optimizer_type") or "")
    if kind and kind.lower() not in ADAM_TYPES:
        plan.uncarried.append(Uncarried("optimizer.type", repr(kind), "only Adam/AdamW state (exp_avg, exp_avg_sq, "
                                        "step) means the same to FSDP2's torch.optim.AdamW", "train with "
                                        "optimizer.type Adam or AdamW, or resume with DeepSpeed", refused=True))
        return
    keys = {k for states in ckpt.optimizer.values() for k in states}
    if keys != set(ADAM_STATE_KEYS):
        seen = sorted(keys) or "none (the optimizer never stepped)"
        plan.uncarried.append(Uncarried("optimizer.state", f"per-element keys {seen}", f"Adam/AdamW keeps exactly "
                                        f"{list(ADAM_STATE_KEYS)}", "convert a checkpoint saved after at least one "
                                        "step of an Adam/AdamW optimizer (for weights only: shardkit consolidate)",
                                        refused=True))
    marks = sorted({k for g in groups for k in _NON_ADAM_GROUP_KEYS if k in g})
    if not kind and marks:
        plan.uncarried.append(Uncarried("optimizer.type", f"client optimizer with param-group keys {marks}",
                                        "those keys belong to LAMB/1-bit optimizers, whose state means something "
                                        "else than AdamW's", "resume with DeepSpeed", refused=True))
    elif not kind:
        plan.notes.append("the optimizer is not named in ds_config (a client optimizer); its state holds exactly "
                          "exp_avg/exp_avg_sq, so it is read as Adam/AdamW")
    for i, g in enumerate(groups):
        if g.get("amsgrad"):
            plan.uncarried.append(Uncarried(f"param_groups[{i}].amsgrad", "True", "the checkpoint has no "
                                            "max_exp_avg_sq state to carry", "convert a run with amsgrad off",
                                            refused=True))
        if g.get("bias_correction", True) is False:
            plan.uncarried.append(Uncarried(f"param_groups[{i}].bias_correction", "False", "torch's Adam/AdamW "
                                            "always corrects the moments' bias, so the run would step differently",
                                            "resume with DeepSpeed", refused=True))


def _decoupled(ckpt: TrainingCheckpoint, group: dict[str, Any], index: int, adam_w_mode: bool | None,
               plan: DcpTarget) -> bool:
    """Whether group ``index`` decays weights AdamW-style: the group's own flag (torch optimizers),
    then the source's config (``adam_w_mode`` scalar: DeepSpeed's Adam is AdamW unless
    ``adam_w_mode: false``), then the caller's ``adam_w_mode``."""
    if "decoupled_weight_decay" in group:
        return bool(group["decoupled_weight_decay"])
    if ckpt.scalars.get("adam_w_mode") is not None:
        return bool(ckpt.scalars["adam_w_mode"])
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


def plan_dcp_target(ckpt: TrainingCheckpoint, adam_w_mode: bool | None) -> DcpTarget:
    """What the DCP output of ``ckpt`` holds, from its tensors' names and scalars; what cannot be
    carried is listed in ``uncarried`` (the caller refuses or reports it)."""
    trainable = ckpt.trainable
    frozen = [n for n in ckpt.weights if n in ckpt.frozen]
    buffers = [n for n in ckpt.weights if n in ckpt.buffers]
    names = build_name_map([*trainable, *frozen, *buffers], ckpt.aliases)
    source_groups: list[dict[str, Any]] = list(ckpt.scalars.get("param_groups") or [{"params": trainable}])
    steps = {n: float(ckpt.scalars.get("step", {}).get(n, 0)) for n in trainable}
    layout = DcpLayout(fqns={n: names.fsdp_name(n) for n in ckpt.weights}, aliases=dict(names.aliases), steps=steps,
                       state_keys=ADAM_STATE_KEYS)
    plan = DcpTarget(names=names, layout=layout, notes=names.notes())
    hyper_groups = [{k: v for k, v in g.items() if k != "params"} for g in source_groups]
    _optimizer_checks(ckpt, hyper_groups, plan)
    defaults = dict(ADAMW_GROUP_DEFAULTS)
    dropped_by_value: dict[str, list[int]] = {}
    for i, g in enumerate(hyper_groups):
        group = dict(defaults)
        dropped = []
        for k, v in g.items():
            if k in _GROUP_KEYS_WITHOUT_TORCH_MEANING:
                dropped.append(f"{k}={v!r}")
            elif k in defaults or (jsonable(v) and is_plain(v)):
                group[k] = tuple(v) if k == "betas" else v
            else:
                plan.uncarried.append(Uncarried(f"param_groups[{i}].{k}", _kind(v), "not a value torch can "
                                                "keep in a param group's JSON", "set it again after loading",
                                                refused=False))
        group["decoupled_weight_decay"] = _decoupled(ckpt, g, i, adam_w_mode, plan)
        members = list(source_groups[i].get("params") or [])
        strangers = [n for n in members if n not in steps]
        if strangers:
            raise CheckpointError(f"{ckpt.folder}: param_groups[{i}] names {strangers[:3]}, which are not trainable "
                                  f"parameters of the checkpoint ({len(steps)} are); its optimizer and model state "
                                  "disagree (files of different saves?)")
        group["params"] = [names.fsdp_name(n) for n in members]
        layout.groups.append(group)
        if dropped:
            dropped_by_value.setdefault(", ".join(dropped), []).append(i)
    for dropped_keys, indices in dropped_by_value.items():
        plan.notes.append(f"param_groups {indices}: {dropped_keys} not written (DeepSpeed optimizer keys with no "
                          f"torch counterpart: {'; '.join(f'{k}: {v}' for k, v in _GROUP_KEYS_WITHOUT_TORCH_MEANING.items())})")
    written = "; ".join(f"[{i}] {len(g['params'])} params, lr={g['lr']}, weight_decay={g['weight_decay']}"
                       for i, g in enumerate(layout.groups))
    plan.notes.append(f"param groups written: {written}. Build the resuming optimizer with the same groups over "
                      "the same (trainable) parameters: torch's load_state_dict refuses groups of other sizes")
    hyper = sorted({k for g in hyper_groups for k in g if k not in _GROUP_KEYS_WITHOUT_TORCH_MEANING})
    plan.carried = [f"fp32 masters ({len(trainable)} trainable)", *ADAM_STATE_KEYS, "step",
                    f"param_groups x{len(layout.groups)} ({', '.join(hyper)})"]
    if frozen:
        plan.carried.append(f"frozen parameters ({len(frozen)}, no optimizer state)")
    if buffers:
        plan.carried.append(f"buffers ({len(buffers)})")
    if names.aliases:
        plan.carried.append(f"tied names ({', '.join(sorted(names.aliases))})")
    plan.notes.append("fused/foreach/capturable are written as torch's defaults (DeepSpeed has none): they override "
                      "the resuming optimizer's own at load; set them again after load_fsdp_checkpoint if you use them")
    _loss_scaler(ckpt, plan)
    _scheduler_and_client_state(ckpt, plan)
    return plan


def _loss_scaler(ckpt: TrainingCheckpoint, plan: DcpTarget) -> None:
    kept = ckpt.scalars.get("loss_scaler")
    if not kept:
        return  # a static scale of 1 (bf16/fp32): there is no state to lose
    cur, dynamic = kept.get("cur_scale", 1.0), kept.get("dynamic", False)
    plan.deepspeed["loss_scaler"] = dict(kept)
    plan.uncarried.append(Uncarried("loss_scaler", f"cur_scale={cur}, dynamic={dynamic}", "shardkit's FSDP2 "
                                    "checkpoint holds no loss scaler (torch.amp.GradScaler is the training "
                                    "script's)", "its state is in the manifest's extra.converted_from.loss_scaler: "
                                    f"start torch.amp.GradScaler(init_scale={cur}) to continue at the same scale",
                                    refused=False))


def _scheduler_and_client_state(ckpt: TrainingCheckpoint, plan: DcpTarget) -> None:
    plan.deepspeed.update(ckpt.scalars.get("counters") or {})
    sched = ckpt.scalars.get("lr_scheduler")
    if sched:
        # Decision: the scheduler's state is kept (JSON) in the manifest and reported, not refused:
        # the current lr is already in every param group, so training continues at the lr it had; a
        # schedule continues only once the script rebuilds its scheduler from this state.
        where = "kept in the manifest's extra.converted_from.lr_scheduler" if jsonable(sched) else "not kept (not JSON)"
        if jsonable(sched):
            plan.deepspeed["lr_scheduler"] = sched
        plan.uncarried.append(Uncarried("lr_scheduler", f"{len(sched)} keys" if isinstance(sched, dict) else
                                        _kind(sched), "shardkit's FSDP2 checkpoint has no scheduler; the "
                                        "param groups' lr is carried, so training resumes at the current lr",
                                        f"its state_dict is {where}: load it into the script's scheduler",
                                        refused=False))
    client = ckpt.scalars.get("client_state") or {}
    for key in sorted(client):
        if jsonable(client[key]):
            plan.user[key] = client[key]
        else:
            plan.uncarried.append(Uncarried(f"client_state.{key}", _kind(client[key]), "not JSON, and the "
                                            "FSDP2 checkpoint keeps the script's state in the manifest's extra.user",
                                            "save it in the training script's own file", refused=False))
    if plan.user:
        plan.carried.append(f"client_state ({', '.join(sorted(plan.user))}) -> manifest extra.user")
        if (ckpt.world_size or 1) > 1:
            plan.notes.append(f"client_state comes from rank 0's file (saved at {ckpt.world_size} ranks); per-rank "
                              "values (data-loader positions, RNG) must be rebuilt by the training script")
