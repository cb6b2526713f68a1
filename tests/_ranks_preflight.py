"""Rank targets for the preflight tests (spawned processes import them by module name).

The ZeRO-3 scenario builds one real 2-rank engine and injects each failure case in turn
(restoring after each), so the expensive deepspeed.initialize runs once for six cases.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.core.errors import PreflightError

ZERO3 = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "param_persistence_threshold": 0},
}


class Classifier(nn.Module):
    """A body and an ``out_head`` a fine-tuner replaces (after the engine was built)."""

    def __init__(self, vocab: int = 64, hidden: int = 32, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.body = nn.Linear(hidden, hidden)
        self.out_head = nn.Linear(hidden, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out_head(torch.relu(self.body(self.embed(ids)))).mean(dim=1)


def _outcome(fn: Any) -> dict[str, Any]:
    try:
        rep = fn()
        return {"ok": True, "text": rep.render(), "n": rep.tensor_count}
    except PreflightError as exc:
        return {"ok": False, "text": str(exc)}


def zero3_failure_cases(json_path: str) -> dict[str, Any]:
    import deepspeed

    import shardkit
    from shardkit.engines.deepspeed import initialize

    torch.manual_seed(0)
    engine = initialize(Classifier(), ZERO3)
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    out["clean"] = _outcome(lambda: shardkit.preflight(engine, timeout=60, json_path=json_path))

    # fp32 master partition on the wrong device on rank 1 only.
    zopt = engine.optimizer
    saved = zopt.fp32_partitioned_groups_flat[0]
    if rank == 1:
        zopt.fp32_partitioned_groups_flat[0] = torch.empty_like(saved, device="meta")
    out["fp32_partition"] = _outcome(lambda: shardkit.preflight(engine, timeout=60))
    zopt.fp32_partitioned_groups_flat[0] = saved

    # One real step so the optimizer has state, then an exp_avg on the wrong device (rank 0).
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    loss = engine(ids.to(engine.device)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    inner = zopt.optimizer
    state = inner.state[zopt.fp32_partitioned_groups_flat[0]]
    out["state_keys"] = sorted(state)
    saved_state = state["exp_avg"]
    if rank == 0:
        state["exp_avg"] = torch.empty_like(saved_state, device="meta")
    out["optimizer_state"] = _outcome(lambda: shardkit.preflight(engine, timeout=60))
    state["exp_avg"] = saved_state

    # A Prodigy-style tensor inside param_groups that load_state_dict would never move.
    inner.param_groups[0]["d_numerator"] = torch.zeros((), device="meta")
    out["param_group"] = _outcome(lambda: shardkit.preflight(engine, timeout=60))
    del inner.param_groups[0]["d_numerator"]

    # Version skew: rank 1 reports another deepspeed.
    real = deepspeed.__version__
    if rank == 1:
        deepspeed.__version__ = "0.14.0"
    out["version_skew"] = _outcome(lambda: shardkit.preflight(engine, timeout=60))
    deepspeed.__version__ = real

    out["after_repair"] = _outcome(lambda: shardkit.preflight(engine, timeout=60))

    # The head replaced after deepspeed.initialize. On a GPU the new Linear
    # would land on the CPU; here the analog is the meta device (any device difference counts).
    engine.module.out_head = nn.Linear(32, 7, device="meta")
    out["replaced_head"] = _outcome(lambda: shardkit.preflight(engine, timeout=60))
    return out


def zero2_offload_cases() -> dict[str, Any]:
    """ZeRO-2 with optimizer offload: clean after a real step, then an fp32 partition misplaced."""
    import shardkit
    from shardkit.engines.deepspeed import initialize

    cfg = {**ZERO3, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}}
    torch.manual_seed(0)
    engine = initialize(Classifier(), cfg)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(ids.to(engine.device)).float().pow(2).mean())
    engine.step()
    out = {"clean": _outcome(lambda: shardkit.preflight(engine, timeout=60))}
    groups = engine.optimizer.single_partition_of_fp32_groups
    saved = groups[0]
    if dist.get_rank() == 0:
        groups[0] = torch.empty_like(saved, device="meta")
    out["fp32_partition"] = _outcome(lambda: shardkit.preflight(engine, timeout=60))
    groups[0] = saved
    return out


def rank1_exits_before_preflight(timeout: float) -> dict[str, Any]:
    import shardkit

    if dist.get_rank() == 1:
        return {"exited": True}
    model = Classifier()
    start = time.monotonic()
    out = _outcome(lambda: shardkit.preflight(model=model, timeout=timeout))
    out["elapsed"] = time.monotonic() - start
    return out


def rank1_arrives_late(timeout: float) -> dict[str, Any]:
    """Rank 1 reaches preflight after rank 0 gave up: it must fail the same way, not go on alone."""
    import shardkit

    if dist.get_rank() == 1:
        # Wait until rank 0 has given up and recorded its verdict (timing alone is flaky on a
        # loaded machine: rank 0 may itself be slower than the sleep).
        store = dist.distributed_c10d._get_default_store()
        deadline = time.monotonic() + 120
        while not store.check(["shardkit/preflight/0/verdict"]) and time.monotonic() < deadline:
            time.sleep(0.1)
    return _outcome(lambda: shardkit.preflight(model=Classifier(), timeout=timeout))


def fsdp2_cases(cpu_offload: bool) -> dict[str, Any]:
    import shardkit
    from shardkit.engines.fsdp import apply_fsdp, build_optimizer

    cfg = {"fsdp": {"cpu_offload": cpu_offload, "pin_memory": False, "mixed_precision": "none", "wrap": ["Linear"]}}
    torch.manual_seed(0)
    model = apply_fsdp(Classifier(), cfg)
    opt = build_optimizer(model, cfg)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(ids).float().pow(2).mean().backward()
    opt.step()
    out: dict[str, Any] = {"clean": _outcome(lambda: shardkit.preflight(model=model, optimizer=opt, config=cfg, timeout=60))}
    # Optimizer state left behind (the CPU analog): exp_avg of the first shard on meta.
    p = next(iter(opt.state))
    saved = opt.state[p]["exp_avg"]
    if dist.get_rank() == 1:
        opt.state[p]["exp_avg"] = torch.empty_like(saved.to_local(), device="meta")
    out["state"] = _outcome(lambda: shardkit.preflight(model=model, optimizer=opt, config=cfg, timeout=60))
    opt.state[p]["exp_avg"] = saved
    # The config says no offload but the model was sharded with CPU offload (or the reverse).
    other = {"fsdp": {**cfg["fsdp"], "cpu_offload": not cpu_offload}}
    out["config_disagrees"] = _outcome(lambda: shardkit.preflight(model=model, optimizer=opt, config=other, timeout=60))
    return out


def _round_keys(round_: int) -> list[str]:
    base = f"shardkit/preflight/{round_}"
    return [f"{base}/rank0", f"{base}/rank1", f"{base}/request", f"{base}/detail1", f"{base}/verdict", f"{base}/done"]


def store_is_clean_after_rounds() -> dict[str, Any]:
    """A passing and a failing round, then: which of their store keys are left, and what each rank holds."""
    import shardkit

    torch.manual_seed(0)
    model = Classifier()
    clean = shardkit.preflight(model=model, timeout=60)
    if dist.get_rank() == 1:
        model.out_head = nn.Linear(32, 5, device="meta")  # replaced after .to()
    failed = _outcome(lambda: shardkit.preflight(model=model, timeout=60))
    dist.barrier()  # both ranks are past both rounds: nothing should be left to read
    store = dist.distributed_c10d._get_default_store()
    left = [k for r in (0, 1) for k in _round_keys(r) if store.check([k])]
    return {"left": left, "ranks_held": [r.rank for r in clean.ranks],
            "summaries_held": [s.rank for s in clean.summaries], "failed": failed}


def rank0_arrives_late(timeout: float) -> dict[str, Any]:
    """Rank 0 reaches preflight after rank 1 gave up on it: both fail naming rank 0."""
    import shardkit

    if dist.get_rank() == 0:
        store = dist.distributed_c10d._get_default_store()
        deadline = time.monotonic() + 120
        while not store.check(["shardkit/preflight/0/verdict"]) and time.monotonic() < deadline:
            time.sleep(0.1)
    out = _outcome(lambda: shardkit.preflight(model=Classifier(), timeout=timeout))
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    out["left"] = [k for k in _round_keys(0) if store.check([k])]
    return out


def fails_to_build() -> nn.Module:
    """A model factory that dies in every rank before the preflight (like DeepSpeed refusing fp16
    on a CPU without fp16 support)."""
    print("building the model", flush=True)
    raise ValueError(f"Type fp16 is not supported on your device (rank {dist.get_rank()})\nsecond line of the message")
