"""Rank targets for tests/test_dcp_writer.py (spawned ranks import them by module name): the model of
tests/_ranks_convert.py (tied embeddings, a frozen norm, two param groups) trained under DeepSpeed
ZeRO-2 and saved, with DeepSpeed's own view of every master and moment beside it (its parameters'
``_hp_mapping`` into the ranks' partitions, read as tests/_ranks_zero12_sources.py reads it)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from tests import _ranks_convert as C
from tests._ranks_zero12_sources import _engine_view


def zero2_config(world: int, bf16: bool) -> dict[str, Any]:
    cfg = C.ds_config(world)
    cfg["zero_optimization"] = {"stage": 2}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def zero2_train_save_continue(root: str, bf16: bool) -> dict[str, Any] | None:
    """ZeRO-2 at this world size: SAVE_STEPS steps, shardkit's atomic save, DeepSpeed's view of the
    full state, then RESUME_STEPS more steps: the uninterrupted reference."""
    import deepspeed

    from shardkit.checkpoint.ops.save_zero3 import save_deepspeed_checkpoint
    from shardkit.engines.deepspeed import train_step

    deepspeed.init_distributed(dist_backend=None, auto_mpi_discovery=False)
    m = C.model()
    engine, *_ = deepspeed.initialize(model=m, model_parameters=C.param_groups(m),
                                      config=zero2_config(dist.get_world_size(), bf16))
    before = [C._mean(train_step(engine, C._rows(s))) for s in range(C.SAVE_STEPS)]
    save_deepspeed_checkpoint(engine, root, client_state=dict(C.CLIENT_STATE))
    # DeepSpeed's own mapping of each parameter to the ranks' flat partitions (_hp_mapping);
    # safe_get_full_optimizer_state raises "exp_avg not found" with two param groups in DeepSpeed 0.19
    view = _engine_view(engine)
    state: dict[str, Any] = {key: {name: v[key] for name, v in view.items()} for key in ("fp32", "exp_avg", "exp_avg_sq")}
    state["frozen"] = {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters() if not p.requires_grad}
    inner = engine.optimizer.optimizer
    state["steps"] = sorted({float(inner.state[f]["step"]) for f in engine.optimizer.single_partition_of_fp32_groups})
    after = [C._mean(train_step(engine, C._rows(s))) for s in range(C.SAVE_STEPS, C.SAVE_STEPS + C.RESUME_STEPS)]
    if dist.get_rank() != 0:
        return None
    return {"state": state, "losses_before": before, "losses_after": after}
