"""Rank targets for tests/test_convert_zero3_to_fsdp.py (spawned ranks import them by module name).

One model exercises every name-mapping case at once: a tiny Llama with ``tie_word_embeddings``
(ZeRO-3 stores ``model.embed_tokens.weight`` once and lists ``lm_head.weight`` in
``shared_params``), a frozen ``model.norm.weight``, and two param groups with their own lr and
weight decay (layer norms: no decay, half the lr). Every run sees the same global batch per step
whatever its world size (GLOBAL_BATCH rows split over the ranks), so a run resumed under FSDP2 at
1 or 3 ranks continues the 2-rank ZeRO-3 run's curve up to float reduction order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

GLOBAL_BATCH = 6
SEQ_LEN = 16
SAVE_STEPS = 2
RESUME_STEPS = 3
FROZEN = "model.norm.weight"
TIED = ("lm_head.weight", "model.embed_tokens.weight")
GROUPS = ({"lr": 1e-3, "weight_decay": 0.01}, {"lr": 5e-4, "weight_decay": 0.0})
CLIP = 1.0
CLIENT_STATE = {"epoch": 1, "sample": 12}


def model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardkit.engines.model_factory import LLAMA_SIZES

    kw = dict(LLAMA_SIZES["tiny"])
    cfg = LlamaConfig(num_key_value_heads=kw["num_attention_heads"], max_position_embeddings=256,
                      tie_word_embeddings=True, **kw)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg)
    m.get_parameter(FROZEN).requires_grad_(False)
    return m


def param_groups(m: torch.nn.Module) -> list[dict[str, Any]]:
    """Two groups over the trainable parameters (named_parameters yields the tied one once)."""
    trainable = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
    decay = [p for n, p in trainable if "layernorm" not in n]
    norms = [p for n, p in trainable if "layernorm" in n]
    return [{"params": decay, **GROUPS[0]}, {"params": norms, **GROUPS[1]}]


def ds_config(world: int) -> dict[str, Any]:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "gradient_clipping": CLIP,
        "steps_per_print": 10_000,
    }


def _rows(step: int) -> torch.Tensor:
    from shardkit.engines.model_factory import synthetic_batch

    world, rank = dist.get_world_size(), dist.get_rank()
    per = GLOBAL_BATCH // world
    return synthetic_batch(512, GLOBAL_BATCH, SEQ_LEN, step, rank=0)[rank * per:(rank + 1) * per]


def _mean(loss: float) -> float:
    t = torch.tensor([loss], dtype=torch.float32)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def _ds_full_state(engine) -> dict[str, Any]:
    """The fp32 masters, Adam moments and step from DeepSpeed's own API (not shardkit's reader)."""
    from deepspeed.runtime.zero import GatheredParameters
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out: dict[str, Any] = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}, "frozen": {}}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            out["fp32"][name] = safe_get_full_fp32_param(p).detach().cpu().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out[key][name] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
        else:
            with GatheredParameters([p]):
                out["frozen"][name] = p.detach().cpu().clone()
    opt = engine.optimizer
    out["steps"] = sorted({float(opt.optimizer.state[f]["step"]) for f in opt.fp32_partitioned_groups_flat})
    return out


def ds_train_save_continue(root: str) -> dict[str, Any] | None:
    """ZeRO-3 at this world size: SAVE_STEPS steps, save (shardkit's atomic save, with client state),
    DeepSpeed's view of the full state, then RESUME_STEPS more steps: the uninterrupted reference."""
    import deepspeed

    from shardkit.checkpoint.ops.save_zero3 import save_deepspeed_checkpoint
    from shardkit.engines.deepspeed import train_step

    deepspeed.init_distributed(dist_backend=None, auto_mpi_discovery=False)
    m = model()
    engine, *_ = deepspeed.initialize(model=m, model_parameters=param_groups(m), config=ds_config(dist.get_world_size()))
    before = [_mean(train_step(engine, _rows(s))) for s in range(SAVE_STEPS)]
    save_deepspeed_checkpoint(engine, root, client_state=dict(CLIENT_STATE))
    state = _ds_full_state(engine)
    after = [_mean(train_step(engine, _rows(s))) for s in range(SAVE_STEPS, SAVE_STEPS + RESUME_STEPS)]
    if dist.get_rank() != 0:
        return None
    return {"state": state, "losses_before": before, "losses_after": after,
            "groups": [{k: g[k] for k in ("lr", "weight_decay")} for g in engine.optimizer.optimizer.param_groups]}


def fsdp_resume_continue(root: str, cpu_offload: bool) -> dict[str, Any] | None:
    """FSDP2 at this world size: load the converted checkpoint, snapshot the full state right after
    loading, train RESUME_STEPS steps with the same clipping and global batch."""
    from shardkit.checkpoint.ops.fsdp_checkpoint import (
        full_model_state_dict,
        full_optimizer_state_dict,
        load_fsdp_checkpoint,
    )
    from shardkit.config.fsdp import fsdp_config_from_dict
    from shardkit.core.errors import CheckpointError
    from shardkit.engines.fsdp import apply_fsdp, train_step

    cfg = fsdp_config_from_dict({"fsdp": {"wrap": ["LlamaDecoderLayer"], "mixed_precision": "none",
                                          "cpu_offload": cpu_offload, "pin_memory": False}, "train": {"clip": CLIP}})
    m = apply_fsdp(model(), cfg)
    opt = torch.optim.AdamW(param_groups(m))
    report = load_fsdp_checkpoint(m, opt, root)
    snapshot = {"model": full_model_state_dict(m), "optim": full_optimizer_state_dict(m, opt)}
    losses = [_mean(train_step(m, opt, _rows(s), cfg)) for s in range(SAVE_STEPS, SAVE_STEPS + RESUME_STEPS)]
    one_group = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad])
    try:  # one group where two were saved: the norms would silently take group 0's lr and decay
        load_fsdp_checkpoint(m, one_group, root)
        one_group_error = ""
    except CheckpointError as exc:
        one_group_error = str(exc)
    if dist.get_rank() != 0:
        return None
    return {"state": snapshot, "losses": losses, "step": report.manifest.step, "user": report.manifest.extra["user"],
            "findings": [f.rule for f in report.findings], "one_group_error": one_group_error,
            "groups": [{k: g[k] for k in ("lr", "weight_decay", "decoupled_weight_decay")} for g in opt.param_groups]}
