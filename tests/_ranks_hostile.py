"""Rank targets for the hostile-environment and hostile-model tests (spawned processes import them by
module name): preflights called a different number of times per rank, rank environments that
disagree with the process group, and models a careless user hands to DeepSpeed ZeRO-3.
"""

from __future__ import annotations

import os
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


def _outcome(fn: Any) -> dict[str, Any]:
    try:
        rep = fn()
        return {"ok": True, "text": rep.render(), "n": rep.tensor_count}
    except PreflightError as exc:
        return {"ok": False, "text": str(exc)}
    except Exception as exc:  # noqa: BLE001 - what a user would see instead of shardkit's message
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _plain() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def uneven_preflight_calls(calls_by_rank: list[int], timeout: float) -> dict[str, Any]:
    """Rank r calls shardkit.preflight ``calls_by_rank[r]`` times; every call's outcome comes back."""
    import time

    import shardkit

    model, opt = _plain()
    rank = dist.get_rank()
    outcomes = []
    started = time.monotonic()
    for _ in range(calls_by_rank[rank]):
        outcomes.append(_outcome(lambda: shardkit.preflight(model=model, optimizer=opt, timeout=timeout)))
    took = time.monotonic() - started
    # stay until the slowest rank has finished its calls (the store lives as long as the group)
    dist.barrier()
    return {"outcomes": outcomes, "seconds": took}


def env_disagrees_with_group(variable: str, value: str) -> dict[str, Any]:
    """The rank's ``variable`` set to ``value`` after the group was formed (a stale export)."""
    import shardkit

    os.environ[variable] = value
    model, opt = _plain()
    return _outcome(lambda: shardkit.preflight(model=model, optimizer=opt, timeout=20))


# --- models --------------------------------------------------------------------------------------


class Shared(nn.Module):
    """One Linear held by two modules (``encoder.proj`` and ``decoder.proj``): one tensor, two names."""

    def __init__(self) -> None:
        super().__init__()
        proj = nn.Linear(8, 8)
        self.encoder = nn.Sequential()
        self.encoder.add_module("proj", proj)
        self.decoder = nn.Sequential()
        self.decoder.add_module("proj", proj)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder.proj(torch.relu(self.encoder.proj(x))))


def _zero3_step(engine: Any, rank: int) -> float:
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
    loss = engine(x.to(engine.device)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return float(loss)


def zero3_model_cases(base: str) -> dict[str, Any]:
    """Real DeepSpeed ZeRO-3 on gloo: a module shared under two names (preflight, a step, a save and
    shardkit's resume into a fresh engine), tied embeddings (the tiny Llama with
    ``tie_word_embeddings``), and every parameter frozen."""
    import deepspeed

    import shardkit
    from shardkit.checkpoint.ops.resume_zero3 import load_checkpoint_resharded
    from shardkit.checkpoint.ops.save_zero3 import save_deepspeed_checkpoint
    from shardkit.engines.deepspeed import initialize

    out: dict[str, Any] = {}
    rank = dist.get_rank()

    torch.manual_seed(0)
    engine = initialize(Shared(), ZERO3)
    out["shared_names"] = sorted(n for n, _ in engine.module.named_parameters())
    out["shared_param_names"] = sorted(engine.param_names.values())
    out["shared"] = _outcome(lambda: shardkit.preflight(engine, timeout=60))
    out["shared_loss"] = _zero3_step(engine, rank)
    out["shared_after_step"] = _outcome(lambda: shardkit.preflight(engine, timeout=60))
    save_deepspeed_checkpoint(engine, base, "step1")
    masters = [t.detach().clone() for t in engine.optimizer.fp32_partitioned_groups_flat]
    engine = None  # free it before the next engine (not del: the lambdas above name it)
    torch.manual_seed(1)  # other initial weights: the load must bring the saved ones
    resumed = initialize(Shared(), ZERO3)
    loaded = load_checkpoint_resharded(resumed, base)
    out["shared_resume"] = {"notes": loaded.notes, "preflight": loaded.placement_checked,
                            "equal": all(torch.equal(a, b) for a, b in
                                         zip(masters, resumed.optimizer.fp32_partitioned_groups_flat))}
    del resumed

    from transformers import LlamaConfig, LlamaForCausalLM

    from shardkit.engines.model_factory import LLAMA_SIZES

    torch.manual_seed(0)
    kw = dict(LLAMA_SIZES["tiny"])
    llama = LlamaForCausalLM(LlamaConfig(num_key_value_heads=kw["num_attention_heads"], max_position_embeddings=256,
                                         tie_word_embeddings=True, **kw))
    out["tied"] = llama.get_input_embeddings().weight is llama.get_output_embeddings().weight
    engine = initialize(llama, ZERO3)
    out["tied_report"] = _outcome(lambda: shardkit.preflight(engine, timeout=60))
    ids = torch.randint(0, kw["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(rank))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    out["tied_after_step"] = _outcome(lambda: shardkit.preflight(engine, timeout=60))
    engine = None  # free it before the next engine (not del: the lambdas above name it)

    torch.manual_seed(0)
    frozen = Shared()
    for p in frozen.parameters():
        p.requires_grad_(False)
    # what DeepSpeed does with nothing to train, given every parameter (a user's call), and given
    # only the trainable ones (shardkit's engines.deepspeed.initialize): the finding is the error
    for key, build in (("frozen_init", lambda: deepspeed.initialize(model=frozen, model_parameters=frozen.parameters(),
                                                                     config=ZERO3)),
                       ("frozen_init_trainable_only", lambda: initialize(frozen, ZERO3))):
        try:
            build()
            out[key] = "ok"
        except Exception as exc:  # noqa: BLE001
            out[key] = f"{type(exc).__name__}: {exc}"
    deepspeed.comm.barrier()
    return out
