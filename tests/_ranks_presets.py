"""Rank targets for the FSDP and preset tests (spawned processes import them by module name)."""

from __future__ import annotations

from typing import Any


def fsdp_one_step(cfg_dict: dict[str, Any], size: str = "tiny") -> dict[str, Any]:
    """Apply shardkit's FSDP2 config to a tiny Llama, run forward/backward/step; report what it saw."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from shardkit.config.fsdp import fsdp_config_from_dict
    from shardkit.engines.fsdp import apply_fsdp, build_optimizer, clip_grad_norm
    from shardkit.engines.model_factory import synthetic_batch, tiny_llama

    cfg = fsdp_config_from_dict(cfg_dict)
    model = tiny_llama("tiny", seed=0)
    apply_fsdp(model, cfg)
    sharded = sorted(
        name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)
    )
    opt = build_optimizer(model, cfg)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    ids = synthetic_batch(model.config.vocab_size, cfg.train.micro_batch, 16, step=0, rank=dist.get_rank())
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    norm = clip_grad_norm(model, cfg)
    opt.step()
    opt.zero_grad()
    changed = sum(int(not torch.equal(before[n], p.full_tensor())) for n, p in model.named_parameters())
    p0 = next(model.parameters())
    return {
        "loss": float(loss.detach().float()),
        "norm": norm,
        "sharded": sharded,
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "local_numel": sum(p.to_local().numel() for p in model.parameters()),
        "full_numel": sum(p.numel() for p in model.parameters()),
        "param_device": str(p0.to_local().device),
        "param_dtype": str(p0.dtype),
        "changed": changed,
        "n_params": len(before),
    }


def _ds_two_steps(cfg: dict[str, Any]) -> list[float]:
    """Two DeepSpeed steps on the same batch; the second loss must be lower if the step happened."""
    import torch.distributed as dist

    from shardkit.engines.deepspeed import initialize, train_step
    from shardkit.engines.model_factory import synthetic_batch, tiny_llama

    model = tiny_llama("tiny", seed=0)
    engine = initialize(model, cfg)
    ids = synthetic_batch(model.config.vocab_size, 2, 16, step=0, rank=dist.get_rank())
    losses = [train_step(engine, ids) for _ in range(2)]
    engine.destroy() if hasattr(engine, "destroy") else None
    return losses


def _fsdp_two_steps(cfg_dict: dict[str, Any]) -> list[float]:
    import torch.distributed as dist

    from shardkit.config.fsdp import fsdp_config_from_dict
    from shardkit.engines.fsdp import initialize, train_step
    from shardkit.engines.model_factory import synthetic_batch, tiny_llama

    cfg = fsdp_config_from_dict(cfg_dict)
    model, opt = initialize(tiny_llama("tiny", seed=0), cfg)
    ids = synthetic_batch(model.config.vocab_size, 2, 16, step=0, rank=dist.get_rank())
    return [train_step(model, opt, ids, cfg) for _ in range(2)]


def presets_two_steps(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Run each named preset config (DeepSpeed or FSDP2) for two steps in this one process group;
    one spawn for all presets saves the process and group start-up per preset."""
    import gc

    from shardkit.config.loading import config_kind

    out: dict[str, Any] = {}
    for name, cfg in configs.items():
        out[name] = _fsdp_two_steps(cfg) if config_kind(cfg) == "fsdp" else _ds_two_steps(cfg)
        gc.collect()
    return out
