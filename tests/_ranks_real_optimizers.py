"""Rank targets for the real custom optimizers as DeepSpeed ZeRO-3 client optimizers (spawned
processes import them by module name): prodigyopt's ``Prodigy`` and prodigy-plus-schedule-free's
``ProdigyPlusScheduleFree`` passed to ``deepspeed.initialize(optimizer=...)``.

What DeepSpeed 0.19.8 does with them (read from runtime/engine.py and zero/stage3.py, seen here):
it refuses an optimizer it has not tested unless the config says ``zero_allow_untested_optimizer``;
with it, the optimizer steps the fp32 sub-group partitions one at a time (stage3 puts one flat
partition into ``param_groups[i]['params']`` for the step and empties it afterwards), so its D
statistics (``d_numerator``, ``running_d_numerator`` ...) are computed from this rank's partition
and differ between ranks. Each rank's optim_states file keeps its own.

The FSDP2 targets run the same optimizers over DTensor shards and through DCP.
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from shardkit.core.errors import PreflightError
from shardkit.storage.manifest import read_manifest

SAVE_AT = 6
CONTINUE = 3
# param_group entries the Prodigy family recomputes every step from this rank's partition
PER_RANK_KEYS = ("d", "d_numerator", "d_denom", "k")


def client_optimizer(name: str, params: Any, **kw: Any) -> torch.optim.Optimizer:
    # d0 well above the default so D statistics move within a few steps of a tiny model
    if name == "prodigy":
        from prodigyopt import Prodigy

        return Prodigy(params, lr=1.0, d0=1e-2, **kw)
    from prodigyplus import ProdigyPlusScheduleFree

    return ProdigyPlusScheduleFree(params, lr=1.0, d0=1e-2, d_limiter=False, **kw)


def _config(allow: bool) -> dict[str, Any]:
    from tests._ranks_zero3 import ds_config

    cfg = ds_config("fp32", False, dist.get_world_size())
    del cfg["optimizer"]  # the client's optimizer, not one DeepSpeed builds
    if allow:
        cfg["zero_allow_untested_optimizer"] = True
    return cfg


def _engine(name: str, allow: bool = True) -> Any:
    from shardkit.engines.deepspeed import initialize
    from shardkit.engines.model_factory import tiny_llama

    model = tiny_llama("tiny", seed=0)
    return initialize(model, _config(allow), optimizer=client_optimizer(name, model.parameters()))


def _per_rank(engine: Any) -> dict[str, Any]:
    """This rank's D statistics and a digest of every optimizer state tensor (bit-exact comparison)."""
    inner = engine.optimizer.optimizer
    group = inner.param_groups[0]
    h = hashlib.sha256()
    for flat in engine.optimizer.fp32_partitioned_groups_flat:
        for key, value in sorted(inner.state[flat].items()):
            if torch.is_tensor(value):
                h.update(key.encode() + value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    out = {k: group.get(k) for k in PER_RANK_KEYS}
    out["running_d"] = [float(group[k]) for k in ("running_d_numerator", "running_d_denom") if k in group]
    out["state_sha"] = h.hexdigest()
    first = inner.state[engine.optimizer.fp32_partitioned_groups_flat[0]]
    out["dtypes"] = {k: str(v.dtype).removeprefix("torch.") for k, v in sorted(first.items()) if torch.is_tensor(v)}
    return out


def _replace_plans(engine: Any) -> dict[str, Any]:
    """What ``replace_optimizer_state(engine.optimizer)`` would move after a load: nothing here (all
    on the CPU), and on a GPU run (every fp32 partition said to be on cuda:0, planned without
    allocating) the state and the param_group tensors the load left on the CPU."""
    from shardkit.placement.replace import plan_optimizer_moves

    to_gpu = plan_optimizer_moves(engine.optimizer, device_for=lambda p: torch.device("cuda:0"))
    return {"here": [m.name for m in plan_optimizer_moves(engine.optimizer)],
            "to_gpu": sorted({(m.name.split(".", 1)[0].split("[")[0], m.name.rsplit(".", 1)[1], m.to_device)
                              for m in to_gpu})}


def _outcome(fn: Any) -> dict[str, Any]:
    try:
        return {"ok": True, "text": fn().render()}
    except PreflightError as exc:
        return {"ok": False, "text": str(exc)}


def zero3_client_optimizer(name: str, root: str) -> dict[str, Any]:
    """Refused without the flag; with it: train, save with shardkit, continue (the reference), the
    preflight healthy and with one optimizer tensor misplaced, then resumed by DeepSpeed's own
    ``load_checkpoint`` and by shardkit's ``load_checkpoint_resharded``, each continued."""
    import shardkit
    from shardkit.checkpoint.ops.resume_zero3 import load_checkpoint_resharded
    from shardkit.checkpoint.ops.save_zero3 import save_deepspeed_checkpoint
    from tests._ranks_zero3 import _global_step

    out: dict[str, Any] = {}
    try:
        _engine(name, allow=False)
        out["refused"] = ""
    except AssertionError as exc:  # DeepSpeed's own check (engine._do_optimizer_sanity_check)
        out["refused"] = str(exc)

    engine = _engine(name)
    inner = engine.optimizer.optimizer
    out["inner"] = type(inner).__name__
    losses = [_global_step(engine, s) for s in range(SAVE_AT)]
    out["saved"] = _per_rank(engine)
    save_deepspeed_checkpoint(engine, root, tag=f"global_step{SAVE_AT}")
    out["reference"] = losses + [_global_step(engine, s) for s in range(SAVE_AT, SAVE_AT + CONTINUE)]
    out["clean"] = _outcome(lambda: shardkit.preflight(engine, timeout=60))
    group, state = inner.param_groups[0], inner.state[engine.optimizer.fp32_partitioned_groups_flat[0]]
    slot, key = (group, "running_d_numerator") if "running_d_numerator" in group else (state, "p0")
    saved = slot[key]
    if dist.get_rank() == 1:
        slot[key] = torch.empty_like(saved, device="meta")
    out["misplaced"] = _outcome(lambda: shardkit.preflight(engine, timeout=60))
    slot[key] = saved

    plain = _engine(name)
    plain.load_checkpoint(root)
    out["plain"] = {"loaded": _per_rank(plain), "replace": _replace_plans(plain)}
    out["plain"]["losses"] = [_global_step(plain, s) for s in range(SAVE_AT, SAVE_AT + CONTINUE)]
    del plain
    resumed = _engine(name)
    with _call_order() as order:
        result = load_checkpoint_resharded(resumed, root)
    out["shardkit"] = {"loaded": _per_rank(resumed), "order": order, "moves": [m.name for m in result.moves],
                       "placement_checked": result.placement_checked, "notes": result.notes,
                       "losses": [_global_step(resumed, s) for s in range(SAVE_AT, SAVE_AT + CONTINUE)]}
    out["root"] = root
    return out


@contextlib.contextmanager
def _call_order() -> Iterator[list[str]]:
    """Record the order in which ``load_checkpoint_resharded`` re-places optimizer tensors and runs the
    placement preflight (each still does its real work)."""
    from shardkit.checkpoint.ops import resume_zero3

    order: list[str] = []
    real_replace, real_preflight = resume_zero3.replace_optimizer_state, resume_zero3.placement_preflight

    def replace(*args: Any, **kw: Any) -> Any:
        order.append("replace_optimizer_state")
        return real_replace(*args, **kw)

    def preflight(*args: Any, **kw: Any) -> Any:
        order.append("preflight")
        return real_preflight(*args, **kw)

    resume_zero3.replace_optimizer_state, resume_zero3.placement_preflight = replace, preflight  # type: ignore[assignment]
    try:
        yield order
    finally:
        resume_zero3.replace_optimizer_state, resume_zero3.placement_preflight = real_replace, real_preflight


def both(root: str) -> dict[str, Any]:
    """Both optimizers in one spawn (one process start and op load for the pair)."""
    return {name: zero3_client_optimizer(name, f"{root}/{name}") for name in ("prodigy", "plus")}


# ---- FSDP2 ----------------------------------------------------------------------------------------


def _fsdp_parts(name: str, **kw: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from tests._ranks_ckpt import fsdp_model

    model, _ = fsdp_model()  # the tiny Llama sharded per decoder layer; its AdamW is replaced here
    return model, client_optimizer(name, model.parameters(), **kw)


def fsdp2_client_optimizer(name: str, root: str, **kw: Any) -> dict[str, Any]:
    """A Prodigy on FSDP2 shards: train, save through DCP, continue; resume and continue. Where its
    first step fails on DTensor shards, the error."""
    from shardkit.checkpoint.ops.fsdp_checkpoint import load_fsdp_checkpoint, save_fsdp_checkpoint
    from tests._ranks_ckpt import _fsdp_step

    model, opt = _fsdp_parts(name, **kw)
    try:
        losses = [_fsdp_step(model, opt, s) for s in range(SAVE_AT)]
    except (RuntimeError, AssertionError) as exc:  # DTensor's refusals (an AssertionError for mixed tensors)
        import traceback

        return {"error": f"{type(exc).__name__}: {exc}", "where": traceback.extract_tb(exc.__traceback__)[-2].name}
    saved = {k: opt.param_groups[0].get(k) for k in PER_RANK_KEYS}
    saved_keys = sorted(opt.param_groups[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        final = save_fsdp_checkpoint(model, opt, root, step=SAVE_AT)
    per_rank_keys = sorted(read_manifest(final).extra.get("per_rank_param_groups", {}))
    reference = losses + [_fsdp_step(model, opt, s) for s in range(SAVE_AT, SAVE_AT + CONTINUE)]
    model2, opt2 = _fsdp_parts(name, **kw)
    load_fsdp_checkpoint(model2, opt2, root)
    loaded = {k: opt2.param_groups[0].get(k) for k in PER_RANK_KEYS}
    return {"saved": saved, "loaded": loaded, "reference": reference, "per_rank_keys": per_rank_keys,
            "save_warnings": [str(w.message) for w in caught if "param_group" in str(w.message)],
            "dropped_keys": sorted(set(saved_keys) - set(opt2.param_groups[0])),
            "resumed": [_fsdp_step(model2, opt2, s) for s in range(SAVE_AT, SAVE_AT + CONTINUE)]}


def fsdp2_lost_values(root: str) -> dict[str, Any]:
    """A param_group entry that differs between ranks and is not a number (DCP keeps one rank's):
    what ``save_fsdp_checkpoint`` says on each rank."""
    from shardkit.checkpoint.ops.fsdp_checkpoint import save_fsdp_checkpoint

    model, opt = _fsdp_parts("prodigy")
    opt.param_groups[0]["note"] = f"written by rank {dist.get_rank()}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_fsdp_checkpoint(model, opt, root, step=0)
    return {"save_warnings": [str(w.message) for w in caught if "param_group" in str(w.message)]}


def fsdp2_all(root: str) -> dict[str, Any]:
    """Prodigy; ProdigyPlusScheduleFree as built by default (factored second moment) and unfactored."""
    return {"prodigy": fsdp2_client_optimizer("prodigy", f"{root}/prodigy"),
            "lost": fsdp2_lost_values(f"{root}/lost"),
            "plus": fsdp2_client_optimizer("plus", f"{root}/plus"),
            "plus_unfactored": fsdp2_client_optimizer("plus", f"{root}/plus_unfactored", factored=False)}
