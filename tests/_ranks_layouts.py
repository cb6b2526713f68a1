"""Rank targets for the layout tests: small real DeepSpeed saves at ZeRO-1, -2 and -3 (spawned
processes import them by module name). Each trains one step of the tiny Llama on its rank's rows and
saves, so the optimizer state (step, exp_avg, exp_avg_sq) is real."""

from __future__ import annotations

from typing import Any

GLOBAL_BATCH = 2
SEQ_LEN = 8


def ds_config(stage: int, dtype: str, offload: bool, world_size: int) -> dict[str, Any]:
    """An AdamW config for ZeRO ``stage`` whose global batch is GLOBAL_BATCH at 1 or 2 ranks."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    cfg: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 10_000,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def train_and_save(save_dir: str, stage: int, dtype: str, offload: bool) -> None:
    """One step of the tiny Llama under ZeRO ``stage``, then ``engine.save_checkpoint(save_dir)``."""
    import torch.distributed as dist

    from shardkit.engines.deepspeed import initialize, train_step
    from shardkit.engines.model_factory import synthetic_batch, tiny_llama

    world, rank = dist.get_world_size(), dist.get_rank()
    engine = initialize(tiny_llama("tiny", seed=0), ds_config(stage, dtype, offload, world))
    rows = synthetic_batch(engine.module.config.vocab_size, GLOBAL_BATCH, SEQ_LEN, 0, rank=0)
    per = GLOBAL_BATCH // world
    train_step(engine, rows[rank * per:(rank + 1) * per])
    engine.save_checkpoint(save_dir, tag="global_step1")
