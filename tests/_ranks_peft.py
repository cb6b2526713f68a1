"""Rank targets for the LoRA tests (spawned processes import them by module name): a real peft
LoRA model (``get_peft_model`` on the tiny Llama, built from a config, no downloads) trained, saved
and resumed under ZeRO-3 and FSDP2 on gloo, with the placement preflight run on a model whose
parameters are mostly frozen, then with a frozen base weight or a LoRA weight put on the wrong
device (``meta`` plays the wrong device on a CPU-only machine, as in tests/_ranks_preflight.py).

Every step sees the same global batch (the helpers of _ranks_zero3 / _ranks_ckpt), so the loss
curves of a resumed run and an uninterrupted one can be compared bit for bit.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist

from shardkit.core.errors import PreflightError

SAVE_AT = 3
CONTINUE = 3
# LoRA on the attention projections: ~2% of the tiny Llama's parameters train, the rest are frozen.
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
FROZEN = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
LORA_WEIGHT = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"


def lora_llama() -> torch.nn.Module:
    """The tiny Llama with LoRA adapters, identical on every rank and in every run."""
    from peft import LoraConfig, get_peft_model

    from shardkit.engines.model_factory import tiny_llama

    model = tiny_llama("tiny", seed=0)
    torch.manual_seed(1)  # the adapters' init
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))


def _counts(model: torch.nn.Module) -> dict[str, int]:
    # ZeRO-3 leaves empty placeholders in the module: count its full sizes (ds_numel) instead
    def numel(p: torch.nn.Parameter) -> int:
        return int(getattr(p, "ds_numel", p.numel()))

    return {"trainable": sum(numel(p) for p in model.parameters() if p.requires_grad),
            "total": sum(numel(p) for p in model.parameters())}


def _outcome(fn: Any) -> dict[str, Any]:
    try:
        rep = fn()
        return {"ok": True, "text": rep.render()}
    except PreflightError as exc:
        return {"ok": False, "text": str(exc)}


@contextmanager
def _swapped(obj: Any, attr: str, on_rank: int) -> Iterator[None]:
    """``obj.<attr>`` replaced by an empty copy on the meta device on one rank, restored after."""
    saved = getattr(obj, attr)
    if dist.get_rank() == on_rank:
        setattr(obj, attr, torch.empty_like(saved, device="meta"))
    try:
        yield
    finally:
        setattr(obj, attr, saved)


def _replace_plans(engine: Any) -> dict[str, Any]:
    """``replace_optimizer_state(engine.optimizer)`` after a load, planned (nothing allocated): what
    it moves here, and (key, target) pairs if every fp32 partition were on cuda:0."""
    from shardkit.placement.replace import plan_optimizer_moves

    to_gpu = plan_optimizer_moves(engine.optimizer, device_for=lambda p: torch.device("cuda:0"))
    return {"here": [m.name for m in plan_optimizer_moves(engine.optimizer)],
            "to_gpu": sorted({(m.name.rsplit(".", 1)[1], m.to_device) for m in to_gpu}),
            "optimizer": type(engine.optimizer.optimizer).__name__}


# ---- ZeRO-3 ---------------------------------------------------------------------------------------


def _zero3_engine() -> Any:
    from shardkit.engines.deepspeed import initialize
    from tests._ranks_zero3 import ds_config

    return initialize(lora_llama(), ds_config("fp32", False, dist.get_world_size()))


def zero3_lora(root: str) -> dict[str, Any]:
    """Train SAVE_AT steps, save with shardkit, continue CONTINUE steps (the reference); preflight
    healthy, then a frozen base weight's and a LoRA weight's partition misplaced; then resume with
    shardkit's loader and with DeepSpeed's own ``load_checkpoint`` and continue the same steps."""
    import shardkit
    from shardkit.checkpoint.ops.resume_zero3 import load_checkpoint_resharded
    from shardkit.checkpoint.ops.save_zero3 import save_deepspeed_checkpoint
    from tests._ranks_zero3 import _global_step

    engine = _zero3_engine()
    out: dict[str, Any] = {"counts": _counts(engine.module)}
    before = [_global_step(engine, s) for s in range(SAVE_AT)]
    save_deepspeed_checkpoint(engine, root, tag=f"global_step{SAVE_AT}")
    out["reference"] = before + [_global_step(engine, s) for s in range(SAVE_AT, SAVE_AT + CONTINUE)]
    out["clean"] = _outcome(lambda: shardkit.preflight(engine, timeout=60))
    params = dict(engine.module.named_parameters())
    out["trainable_in_optimizer"] = sum(int(f.numel()) for f in engine.optimizer.fp32_partitioned_groups_flat)
    with _swapped(params[FROZEN], "ds_tensor", on_rank=1):
        out["frozen_misplaced"] = _outcome(lambda: shardkit.preflight(engine, timeout=60))
    with _swapped(params[LORA_WEIGHT], "ds_tensor", on_rank=0):
        out["lora_misplaced"] = _outcome(lambda: shardkit.preflight(engine, timeout=60))

    resumed = _zero3_engine()
    result = load_checkpoint_resharded(resumed, root)
    out["shardkit"] = {"placement_checked": result.placement_checked, "notes": result.notes,
                       "replace": _replace_plans(resumed)}
    out["shardkit"]["losses"] = [_global_step(resumed, s) for s in range(SAVE_AT, SAVE_AT + CONTINUE)]
    plain = _zero3_engine()
    path, _ = plain.load_checkpoint(root)
    out["plain"] = {"losses": [_global_step(plain, s) for s in range(SAVE_AT, SAVE_AT + CONTINUE)],
                    "path": str(path)}
    return out


# ---- FSDP2 ----------------------------------------------------------------------------------------

FSDP = {"fsdp": {"wrap": ["LlamaDecoderLayer"], "mixed_precision": "none", "cpu_offload": False, "pin_memory": False}}


def _fsdp_parts() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from shardkit.engines.fsdp import apply_fsdp

    model = apply_fsdp(lora_llama(), FSDP)
    # only the adapters train: the optimizer holds (and DCP saves state for) the LoRA shards alone
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    return model, opt


def fsdp2_lora(root: str) -> dict[str, Any]:
    """The FSDP2 counterpart of ``zero3_lora``: DCP save and load through shardkit."""
    import shardkit
    from shardkit.checkpoint.ops.fsdp_checkpoint import load_fsdp_checkpoint, save_fsdp_checkpoint
    from tests._ranks_ckpt import _fsdp_step

    model, opt = _fsdp_parts()
    out: dict[str, Any] = {"counts": _counts(model)}
    before = [_fsdp_step(model, opt, s) for s in range(SAVE_AT)]
    save_fsdp_checkpoint(model, opt, root, step=SAVE_AT)
    out["reference"] = before + [_fsdp_step(model, opt, s) for s in range(SAVE_AT, SAVE_AT + CONTINUE)]
    out["clean"] = _outcome(lambda: shardkit.preflight(model=model, optimizer=opt, config=FSDP, timeout=60))
    out["state_entries"] = len(opt.state)
    params = dict(model.named_parameters())
    # a DTensor keeps its shard in _local_tensor: swapping it is the CPU analog of a shard left on the host
    with _swapped(params[FROZEN], "_local_tensor", on_rank=1):
        out["frozen_misplaced"] = _outcome(lambda: shardkit.preflight(model=model, optimizer=opt, config=FSDP, timeout=60))
    with _swapped(params[LORA_WEIGHT], "_local_tensor", on_rank=0):
        out["lora_misplaced"] = _outcome(lambda: shardkit.preflight(model=model, optimizer=opt, config=FSDP, timeout=60))

    model2, opt2 = _fsdp_parts()
    report = load_fsdp_checkpoint(model2, opt2, root)
    out["resumed"] = {"losses": [_fsdp_step(model2, opt2, s) for s in range(SAVE_AT, SAVE_AT + CONTINUE)],
                      "step": report.manifest.step, "findings": [f.rule for f in report.findings]}
    return out
