"""Synthetic placement reports shaped like one rank of a 70B Llama under ZeRO-3 with optimizer offload.

Shared by benchmarks/bench_preflight_scale.py and tests/test_preflight_exchange.py: 723 parameters
(80 layers x 9 + embeddings, final norm, lm_head) with the real shapes, five records each (module
placeholder, ZeRO-3 shard, gradient partition, exp_avg, exp_avg_sq): 3,615 records per rank, the
count measured at 70B. ``misplaced`` plants one optimizer state on the accelerator instead of the
CPU; ``drop`` leaves one parameter out of the rank's model.
"""

from __future__ import annotations

import math
from functools import lru_cache

from shardkit.placement import records as R
from shardkit.placement.records import PlacementRecord, RankReport

HIDDEN, INTER, LAYERS, KV, VOCAB = 8192, 28672, 80, 1024, 128256
#: The parameter the benchmark's fault leaves out of one rank's model.
DROPPED = "model.layers.40.mlp.up_proj.weight"
#: The optimizer state the benchmark's fault puts on the wrong device.
MISPLACED = "zero.optimizer.state[1.mlp.down_proj].exp_avg"
VERSIONS = {"torch": "2.13.0", "deepspeed": "0.19.8", "python": "3.11.7", "shardkit": "0.1.0"}


@lru_cache(maxsize=1)
def llama70b_params() -> tuple[tuple[str, int], ...]:
    per_layer = [("self_attn.q_proj.weight", HIDDEN * HIDDEN), ("self_attn.k_proj.weight", HIDDEN * KV),
                 ("self_attn.v_proj.weight", HIDDEN * KV), ("self_attn.o_proj.weight", HIDDEN * HIDDEN),
                 ("mlp.gate_proj.weight", HIDDEN * INTER), ("mlp.up_proj.weight", HIDDEN * INTER),
                 ("mlp.down_proj.weight", INTER * HIDDEN), ("input_layernorm.weight", HIDDEN),
                 ("post_attention_layernorm.weight", HIDDEN)]
    out = [("model.embed_tokens.weight", VOCAB * HIDDEN)]
    out += [(f"model.layers.{i}.{n}", numel) for i in range(LAYERS) for n, numel in per_layer]
    out += [("model.norm.weight", HIDDEN), ("lm_head.weight", VOCAB * HIDDEN)]
    return tuple(out)


def llama70b_report(rank: int, world: int, *, misplaced: bool = False, drop: bool = False,
                    gpus_per_node: int = 8) -> RankReport:
    dev = f"cuda:{rank % gpus_per_node}"
    why_cpu = "zero_optimization.offload_optimizer.device=cpu"
    records: list[PlacementRecord] = []
    numels: dict[str, int] = {}
    parts: dict[str, int] = {}
    for i, (name, numel) in enumerate(llama70b_params()):
        if drop and name == DROPPED:
            continue
        part = math.ceil(numel / world)
        numels[name], parts[name] = numel, part
        short = name.removeprefix("model.layers.")
        state = f"zero.optimizer.state[{short.rsplit('.', 1)[0]}]"
        records += [
            PlacementRecord(rank, f"module.{name}", R.PARAM, dev, dev, 0, 0, "ZeRO-3 placeholder"),
            PlacementRecord(rank, f"module.{name}.ds_tensor", R.ZERO_PARAM_SHARD, dev, dev, 2 * part, part, "compute device"),
            PlacementRecord(rank, f"zero.grad_partition[{i}]", R.ZERO_GRAD_PARTITION, "cpu", "cpu", 4 * part, part, why_cpu),
            PlacementRecord(rank, f"{state}.exp_avg", R.OPTIMIZER_STATE, "cpu", "cpu", 4 * part, part, why_cpu),
            PlacementRecord(rank, f"{state}.exp_avg_sq", R.OPTIMIZER_STATE, "cpu", "cpu", 4 * part, part, why_cpu),
        ]
    if misplaced:
        at = next(n for n, r in enumerate(records) if r.name == MISPLACED)
        r = records[at]
        records[at] = PlacementRecord(r.rank, r.name, r.kind, dev, r.expected, r.bytes, r.numel, r.why)
    return RankReport(rank=rank, world_size=world, host=f"node{rank // gpus_per_node:03d}", compute_device=dev,
                      engine="deepspeed-zero3", versions=dict(VERSIONS), config_digest="c0ffee" * 10 + "abcd",
                      records=records, param_numels=numels, zero3_partitions=parts, zero3_partition_ranks=world)
