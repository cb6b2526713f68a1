"""Rank targets for the FSDP2 -> ZeRO-3 conversion tests (spawned processes import them by name).

The FSDP2 side is ``tests._ranks_ckpt.fsdp_train_save_continue`` (2 steps, save ``step2``, 2 more
steps; GLOBAL_BATCH rows per step split over the ranks). The ZeRO-3 side here loads the converted
files with DeepSpeed's plain ``engine.load_checkpoint`` at its own world size, reports this rank's
flat partitions right after the load, continues on the same global batches, and saves (a checkpoint
DeepSpeed itself wrote: the start of the ZeRO-3 -> FSDP2 -> ZeRO-3 round trip).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from tests._ranks_ckpt import GLOBAL_BATCH, SEQ_LEN
from tests._ranks_zero3 import _local_fp32_state


def ds_config(world_size: int, offload: bool) -> dict[str, Any]:
    """The resuming ZeRO-3 run: AdamW like the FSDP2 run (lr 1e-3, weight decay 0.01), no clipping
    (the FSDP2 steps do not clip), the same global batch at any world size dividing GLOBAL_BATCH."""
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    return {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 10_000,
        "wall_clock_breakdown": False,
    }


def _global_step(engine, step: int) -> float:
    from shardkit.engines.deepspeed import train_step
    from shardkit.engines.model_factory import synthetic_batch

    world, rank = dist.get_world_size(), dist.get_rank()
    rows = synthetic_batch(engine.module.config.vocab_size, GLOBAL_BATCH, SEQ_LEN, step, rank=0)
    per = GLOBAL_BATCH // world
    t = torch.tensor([train_step(engine, rows[rank * per:(rank + 1) * per])], dtype=torch.float32)
    dist.all_reduce(t)
    return float(t.item()) / world


def load_and_continue(ckpt: str, offload: bool, start: int, steps: int, save_to: str,
                      named: str | None = None, bf16: str | None = None) -> dict[str, Any]:
    """Plain ``engine.load_checkpoint(ckpt)``; this rank's state right after it; ``steps`` more steps
    (after ``restore_cpu_adam_kernel_state``, as the README tells plain-load users); save to ``save_to``.
    ``named``/``bf16``: then, in the same process, ``load_named(named)`` / ``load_bf16(bf16)`` (saves spawns)."""
    from shardkit.checkpoint.ops.cpu_adam_kernel import restore_cpu_adam_kernel_state
    from shardkit.checkpoint.ops.save_zero3 import save_deepspeed_checkpoint
    from shardkit.engines.deepspeed import initialize
    from shardkit.engines.model_factory import tiny_llama

    world = dist.get_world_size()
    engine = initialize(tiny_llama("tiny", seed=1), ds_config(world, offload))  # other init: the load must overwrite it
    path, client = engine.load_checkpoint(ckpt)
    if path is None:
        raise RuntimeError(f"engine.load_checkpoint({ckpt!r}) loaded nothing")
    opt = engine.optimizer
    out = _local_fp32_state(engine)
    out["param_shapes"] = [[(n, tuple(s)) for n, s in g.items()] for g in engine._get_zero_param_shapes()]
    out["optimizer"] = type(opt.optimizer).__name__
    out["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]
    out["global_steps"] = engine.global_steps
    out["client"] = {k: client[k] for k in ("epoch", "sample") if k in client}
    out["kernel_replays"] = len(restore_cpu_adam_kernel_state(engine))
    out["losses"] = [_global_step(engine, s) for s in range(start, start + steps)]
    save_deepspeed_checkpoint(engine, save_to, tag=f"global_step{start + steps}")
    if named is not None:
        out["named"] = load_named(named)
    if bf16 is not None:
        out["bf16"] = load_bf16(bf16)
    return out


def load_bf16(ckpt: str) -> dict[str, Any]:
    """A bf16 ZeRO-3 engine (``bf16_`` optim files, bf16 module): plain load; its fp32 flats and moments."""
    from shardkit.engines.deepspeed import initialize
    from shardkit.engines.model_factory import tiny_llama

    engine = initialize(tiny_llama("tiny", seed=1), {**ds_config(dist.get_world_size(), False), "bf16": {"enabled": True}})
    path, _ = engine.load_checkpoint(ckpt)
    if path is None:
        raise RuntimeError(f"engine.load_checkpoint({ckpt!r}) loaded nothing")
    out = _local_fp32_state(engine)
    out["param_shapes"] = [[(n, tuple(s)) for n, s in g.items()] for g in engine._get_zero_param_shapes()]
    out["module_dtype"] = str(next(engine.module.parameters()).dtype)
    return out


def named_dcp(root: str) -> dict[str, Any]:
    """In this process, no FSDP: tests/_ranks_convert.py's model (tied embeddings, a frozen norm, two
    param groups) trained 2 steps with torch AdamW, the frozen norm inside group 0 as
    ``model.parameters()``-built optimizers hold it (never stepped: no state), saved by
    ``save_fsdp_checkpoint`` (a plain module's state dict: one chunk per tensor). Returns the state."""
    from shardkit.checkpoint.ops.fsdp_checkpoint import save_fsdp_checkpoint
    from shardkit.engines.model_factory import synthetic_batch
    from tests import _ranks_convert as N

    m = N.model()
    groups = N.param_groups(m)
    groups[0]["params"] = [*groups[0]["params"], m.get_parameter(N.FROZEN)]
    opt = torch.optim.AdamW(groups)
    for step in range(2):
        rows = synthetic_batch(512, N.GLOBAL_BATCH, N.SEQ_LEN, step, rank=0)
        m(input_ids=rows, labels=rows).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: no process group, one process (intended)
        save_fsdp_checkpoint(m, opt, root, step=2)
    by_param = {p: n for n, p in m.named_parameters()}
    return {"params": {n: p.detach().clone() for n, p in m.named_parameters()},
            "state": {by_param[p]: {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}}


def load_named(ckpt: str) -> dict[str, Any] | None:
    """tests/_ranks_convert.py's model and param groups under ZeRO-3 at this world size: plain
    ``load_checkpoint``, then DeepSpeed's own full fp32 masters, moments and frozen weights."""
    import deepspeed

    from tests import _ranks_convert as N

    m = N.model()
    engine, *_ = deepspeed.initialize(model=m, model_parameters=N.param_groups(m), config=N.ds_config(dist.get_world_size()))
    path, _ = engine.load_checkpoint(ckpt)
    if path is None:
        raise RuntimeError(f"engine.load_checkpoint({ckpt!r}) loaded nothing")
    state = N._ds_full_state(engine)
    state["tied"] = engine.module.lm_head.weight is engine.module.model.embed_tokens.weight
    state["groups"] = [{k: g[k] for k in ("lr", "weight_decay")} for g in engine.optimizer.optimizer.param_groups]
    return state if dist.get_rank() == 0 else None
