"""The ZeRO-1/2 saves tests/test_zero12_sources.py reads: real 2-rank DeepSpeed saves of small Hugging Face
models (a rank target: spawned processes import it by module name), each with its engine's own view of
every parameter's fp32 master and Adam moments beside it (``reference.pt``, gathered by DeepSpeed's
``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``), and the model's ``config.json`` in the
root (where export finds it).

Sizes are odd on purpose (hidden 40, intermediate 52, vocabulary 203): parameters straddle the rank boundary and the
flat groups carry tail padding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

GLOBAL_BATCH = 2
SEQ_LEN = 8
TAG = "global_step2"

#: label -> (ZeRO stage, precision, CPU optimizer offload, model, param groups).
#: models: ``llama``; ``llama_tied`` (tie_word_embeddings); ``llama_frozen`` (embedding requires_grad
#: False); ``qwen2`` (q/k/v biases). Two param groups: decay / no decay on biases and norms, as the Trainer.
VARIANTS: dict[str, tuple[int, str, bool, str, int]] = {
    "zero1": (1, "fp32", False, "llama", 1),
    "zero1_frozen": (1, "fp32", False, "llama_frozen", 2),
    "zero2": (2, "fp32", False, "qwen2", 2),
    "zero2_bf16": (2, "bf16", False, "qwen2", 2),
    "zero2_offload": (2, "fp32", True, "llama_tied", 1),
    "zero2_frozen_bf16": (2, "bf16", False, "llama_frozen", 1),
    "zero2_tied_bf16": (2, "bf16", False, "llama_tied", 2),
    "zero1_bf16": (1, "bf16", False, "llama", 1),  # DeepSpeed's BF16_Optimizer: refused by name
}
FP16_VARIANT = {"zero2_fp16": (2, "fp16", False, "llama_tied", 1)}


def build_model(kind: str) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(hidden_size=40, intermediate_size=52, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=203, max_position_embeddings=64)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=kind == "llama_tied"))
    if kind == "llama_frozen":
        model.model.embed_tokens.weight.requires_grad_(False)
    return model


def ds_config(stage: int, dtype: str, offload: bool, world: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    cfg: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "betas": [0.9, 0.98]}},
        "zero_optimization": zero,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def _param_groups(model: Any, groups: int) -> list[Any]:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if groups == 1:
        return [p for _, p in params]
    no_decay = [p for n, p in params if n.endswith("bias") or "norm" in n]
    return [{"params": [p for n, p in params if not (n.endswith("bias") or "norm" in n)], "weight_decay": 0.01},
            {"params": no_decay, "weight_decay": 0.0}]


def train_and_save(root: str, label: str, spec: tuple[int, str, bool, str, int]) -> None:
    """Two steps, then ``save_checkpoint(root, tag=TAG)``; rank 0 writes the engine's own full
    masters and moments (``reference.pt``) and ``config.json`` beside the tag."""
    import copy

    import deepspeed
    import torch
    import torch.distributed as dist

    from shardkit.engines.model_factory import synthetic_batch

    stage, dtype, offload, kind, groups = spec
    world, rank = dist.get_world_size(), dist.get_rank()
    model = build_model(kind)
    deepspeed.init_distributed(dist_backend=None, auto_mpi_discovery=False)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=_param_groups(model, groups),
                                      config=copy.deepcopy(ds_config(stage, dtype, offload, world)))
    per = GLOBAL_BATCH // world
    for step in range(2):
        rows = synthetic_batch(203, GLOBAL_BATCH, SEQ_LEN, step, rank=0)[rank * per:(rank + 1) * per]
        loss = engine(input_ids=rows, labels=rows).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(root, tag=TAG)
    reference = _engine_view(engine) if hasattr(engine.optimizer, "single_partition_of_fp32_groups") else {}
    if rank == 0:
        torch.save(reference, Path(root) / "reference.pt")
        engine.module.config.save_pretrained(root)
    dist.barrier()


def _engine_view(engine: Any) -> dict[str, dict[str, Any]]:
    """Every trainable parameter's full fp32 master and Adam moments as the live engine maps them: each
    rank's fragment (DeepSpeed's own ``_hp_mapping``: where in the parameter, where in the rank's flat
    partition) placed in a zero tensor, summed over the ranks. (``safe_get_full_optimizer_state`` raises
    "exp_avg not found" here for models with two param groups in DeepSpeed 0.19, so it is done by hand.)"""
    import torch
    import torch.distributed as dist

    opt = engine.optimizer
    out: dict[str, dict[str, Any]] = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        out[name] = {}
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            buf = torch.zeros(p.numel(), dtype=torch.float32)
            m = p._hp_mapping
            if m is not None:
                flat = opt.single_partition_of_fp32_groups[m.param_group_index]
                source = flat if key == "fp32" else opt.optimizer.state[flat][key]
                frag = source.narrow(0, m.hp_fragment_address.start, m.hp_fragment_address.numel)
                buf.narrow(0, m.lp_fragment_address.start, m.lp_fragment_address.numel).copy_(frag.float())
            dist.all_reduce(buf)
            out[name][key] = buf.view(p.shape)
    return out


def save_all(base: str, variants: dict[str, tuple[int, str, bool, str, int]]) -> None:
    """Every variant under ``base/<label>`` in one spawn (one process group, one engine after another)."""
    for label, spec in variants.items():
        train_and_save(f"{base}/{label}", label, spec)
