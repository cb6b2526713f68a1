"""`shardkit estimate` against real engines at 3 ranks (gloo, CPU): the GPU recordings are at world size 1,
so the per-rank partition arithmetic (ceil(numel / world), ZeRO-1/2's flat group padded to 2 x world,
persistence) is checked here against the tensors DeepSpeed itself allocates, item by item, exactly.

The model is the tiny Llama (hidden 64: its norms, 64 elements, do not divide by 3, so every rank pads)."""

from __future__ import annotations

from typing import Any

import pytest

from shardkit.estimate.compute import estimate_memory
from shardkit.estimate.meta_model import shape_from_config_dict
from shardkit.estimate.report import RunShape
from shardkit.estimate.settings import settings_from_config

WORLD = 3
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 256}


def _config(stage: int, offload: bool) -> dict[str, Any]:
    from shardkit.config.generate import deepspeed_config

    off = "cpu" if offload else "none"
    cfg = deepspeed_config(stage, offload_optimizer=off, offload_param=off if stage == 3 else "none",
                           precision="bf16", world_size=WORLD, pin_memory=False)
    if stage == 3:  # the norms (64) and nothing else stay whole on every rank
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 1000
    return cfg


def rank_engine_bytes(stage: int, offload: bool) -> dict[str, int]:
    """Rank target: one DeepSpeed step on the tiny Llama; the bytes of each buffer the estimate names."""
    import torch.distributed as dist

    from shardkit.engines.deepspeed import initialize, train_step
    from shardkit.engines.model_factory import synthetic_batch, tiny_llama

    model = tiny_llama("tiny", seed=0)
    engine = initialize(model, _config(stage, offload))
    train_step(engine, synthetic_batch(model.config.vocab_size, 1, 8, 0, dist.get_rank()))
    opt = engine.optimizer

    def nbytes(tensors: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    state = [t for st in opt.optimizer.state.values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")]
    if stage == 3:
        lp = opt.param_groups_fp16_flat_cpu_memory if offload else [opt.lp_param_buffer]
        out = {
            "z3.lp_partitions": nbytes(lp),
            "z3.grad_partitions": nbytes([opt.grad_partitions_flat_buffer]),
            "z3.fp32_masters": nbytes(opt.fp32_partitioned_groups_flat),
            "z3.optimizer_state": nbytes(state),
            "z3.persistent": nbytes(p.data for p in engine.module.parameters() if getattr(p, "ds_persist", False)),
        }
        if offload:
            out["z3.fp32_grads"] = nbytes(g.grad for g in opt.fp32_partitioned_groups_flat)
        return out
    out = {
        "z12.params": nbytes(opt.bit16_groups_flat),
        "z12.fp32_masters": nbytes(opt.single_partition_of_fp32_groups),
        "z12.optimizer_state": nbytes(state),
    }
    if offload:
        out["z12.fp32_grads"] = nbytes(g.grad for g in opt.single_partition_of_fp32_groups)
        out["z12.lp_staging"] = nbytes(opt.param_buffer_of_bit16_for_cpu_offload_groups)
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage, offload", [(3, False), (3, True), (2, True)], ids=["z3", "z3_offload", "z2_offload"])
def test_estimate_items_equal_deepspeeds_buffers_at_three_ranks(stage, offload):
    from shardkit.run.spawn.process import run_ranks

    results = run_ranks(rank_engine_bytes, WORLD, args=(stage, offload), timeout=500, device="cpu")
    model = shape_from_config_dict(TINY, "tiny llama")
    assert model.total_params == 147_776  # shardkit.engines.model_factory's tiny Llama, built from the same sizes
    est = estimate_memory(model, settings_from_config(_config(stage, offload), model.hidden_size),
                          RunShape(world_size=WORLD, gpus_per_node=WORLD, micro_batch=1, seq_len=8))
    expected = {i.id: i.bytes for i in est.items}
    for r in results:
        got = r.value
        assert got == {k: expected[k] for k in got}, f"rank {r.rank}: DeepSpeed {got}, shardkit {expected}"


def rank_fsdp_bytes() -> dict[str, int]:
    """Rank target: one FSDP2 step (bf16 mixed precision) on the tiny Llama; the bytes of this rank's shards."""
    import torch.distributed as dist

    from shardkit.config.fsdp import fsdp_config_from_dict
    from shardkit.config.generate import fsdp_config
    from shardkit.engines.fsdp import apply_fsdp, build_optimizer
    from shardkit.engines.model_factory import synthetic_batch, tiny_llama

    cfg = fsdp_config_from_dict(fsdp_config(mixed_precision="bf16"))
    model = apply_fsdp(tiny_llama("tiny", seed=0), cfg)
    opt = build_optimizer(model, cfg)
    ids = synthetic_batch(model.config.vocab_size, 1, 8, 0, dist.get_rank())
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    params = list(model.parameters())

    def nbytes(tensors: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    states = [st for st in opt.state.values()]
    return {
        "fsdp.params": nbytes(p.to_local() for p in params),
        "fsdp.grads": nbytes(p.grad.to_local() for p in params),
        "fsdp.optimizer_state": nbytes(st[k].to_local() for st in states for k in ("exp_avg", "exp_avg_sq")),
        "fsdp.step": nbytes(st["step"] for st in states),
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_estimate_items_equal_fsdp2_shards_at_three_ranks():
    """Rank 0 holds ceil(dim0 / 3) rows of every parameter, the estimate's per-rank figure; the others hold
    as much or less (the last rank's chunks are shorter)."""
    from shardkit.config.generate import fsdp_config
    from shardkit.run.spawn.process import run_ranks

    results = run_ranks(rank_fsdp_bytes, WORLD, timeout=500, device="cpu")
    model = shape_from_config_dict(TINY, "tiny llama")
    est = estimate_memory(model, settings_from_config(fsdp_config(mixed_precision="bf16")),
                          RunShape(world_size=WORLD, gpus_per_node=WORLD, micro_batch=1, seq_len=8))
    expected = {i.id: i.bytes for i in est.items}
    by_rank = {r.rank: r.value for r in results}
    assert by_rank[0] == {k: expected[k] for k in by_rank[0]}, f"rank 0: FSDP2 {by_rank[0]}, shardkit {expected}"
    for rank, got in by_rank.items():
        assert all(v <= expected[k] for k, v in got.items()), f"rank {rank}: {got} above {expected}"
