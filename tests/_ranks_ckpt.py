"""Rank targets for the atomic-checkpoint tests (spawned processes import them by module name)."""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SEQ_LEN = 8


def ds_config() -> dict[str, Any]:
    """Tiny ZeRO-3 AdamW fp32 config for 2 ranks on CPU."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10_000,
    }


def _engine():
    from shardkit.engines.deepspeed import initialize
    from shardkit.engines.model_factory import tiny_llama

    return initialize(tiny_llama("tiny", seed=0), ds_config())


def _steps(engine, start: int, n: int) -> None:
    from shardkit.engines.deepspeed import train_step
    from shardkit.engines.model_factory import synthetic_batch

    for step in range(start, start + n):
        train_step(engine, synthetic_batch(engine.module.config.vocab_size, 1, SEQ_LEN, step, dist.get_rank()))


def fp32_fingerprint(engine) -> str:
    """sha256 of this rank's fp32 master partitions and Adam moments (bit-exact comparison)."""
    h = hashlib.sha256()
    opt = engine.optimizer
    for flat in opt.fp32_partitioned_groups_flat:
        h.update(flat.detach().cpu().numpy().tobytes())
    for state in opt.optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            h.update(state[key].detach().cpu().numpy().tobytes())
    return h.hexdigest()


def save_then_die_in_second_save(root: str, record_dir: str, kill_rank: int) -> None:
    """Save 'step2' with shardkit, then SIGKILL ``kill_rank`` right after it wrote the first file of
    the 'step4' save (a real kill: no exception handling, no atexit)."""
    from shardkit.checkpoint.ops.save_zero3 import save_deepspeed_checkpoint

    engine = _engine()
    rank = dist.get_rank()
    _steps(engine, 0, 2)
    save_deepspeed_checkpoint(engine, root, tag="step2")
    Path(record_dir, f"fingerprint{rank}").write_text(fp32_fingerprint(engine))
    _steps(engine, 2, 2)
    if rank == kill_rank:
        ckpt_engine = engine.checkpoint_engine
        original = ckpt_engine.save

        def save_and_die(state_dict, path):
            original(state_dict, path)
            Path(record_dir, "killed_after").write_text(os.path.basename(path))
            os.kill(os.getpid(), signal.SIGKILL)

        ckpt_engine.save = save_and_die
    save_deepspeed_checkpoint(engine, root, tag="step4")


def load_and_fingerprint(root: str) -> dict[str, Any]:
    """check_resumable, then DeepSpeed's own load_checkpoint on the root; train one more step."""
    from shardkit.storage.verify import check_resumable

    report = check_resumable(root, world_size=dist.get_world_size(), engine="deepspeed")
    engine = _engine()
    load_path, _ = engine.load_checkpoint(root)
    out = {"tag_dir": report.tag_dir, "load_path": load_path, "fingerprint": fp32_fingerprint(engine),
           "global_steps": engine.global_steps}
    _steps(engine, engine.global_steps, 1)
    return out



# ---- FSDP2 / DCP ---------------------------------------------------------------------------------
# Every step sees the same *global* batch whatever the world size: GLOBAL_BATCH rows split evenly,
# so runs at 1, 2 and 3 ranks follow the same trajectory up to float reduction order.
GLOBAL_BATCH = 6


def fsdp_model(cpu_offload: bool = False):
    from shardkit.engines.fsdp import apply_fsdp
    from shardkit.engines.model_factory import tiny_llama

    model = tiny_llama("tiny", seed=0)
    cfg = {"fsdp": {"wrap": ["LlamaDecoderLayer"], "mixed_precision": "none", "cpu_offload": cpu_offload,
                    "pin_memory": False}}  # CPUOffloadPolicy's default pin_memory=True needs an accelerator
    apply_fsdp(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return model, opt


def _fsdp_step(model, opt, step: int) -> float:
    from shardkit.engines.fsdp import train_step
    from shardkit.engines.model_factory import synthetic_batch

    world, rank = dist.get_world_size(), dist.get_rank()
    rows = synthetic_batch(model.config.vocab_size, GLOBAL_BATCH, SEQ_LEN, step, rank=0)
    per = GLOBAL_BATCH // world
    t = torch.tensor(train_step(model, opt, rows[rank * per:(rank + 1) * per]), dtype=torch.float32)
    dist.all_reduce(t)
    return t.item() / world


def _full_state(model, opt) -> dict[str, Any]:
    from shardkit.checkpoint.ops.fsdp_checkpoint import full_model_state_dict, full_optimizer_state_dict

    return {"model": full_model_state_dict(model), "optim": full_optimizer_state_dict(model, opt)}


def fsdp_train_save_continue(root: str, export: str) -> dict[str, Any] | None:
    """Train 2 steps, save 'step2' (DCP) and export safetensors, train 2 more: the reference run."""
    from shardkit.checkpoint.ops.fsdp_checkpoint import export_safetensors, save_fsdp_checkpoint

    model, opt = fsdp_model()
    for s in range(2):
        _fsdp_step(model, opt, s)
    save_fsdp_checkpoint(model, opt, root, step=2, config={"lr": 1e-3}, extra={"epoch": 0, "sample": 12})
    snapshot = _full_state(model, opt)
    export_safetensors(model, export)
    losses = [_fsdp_step(model, opt, s) for s in (2, 3)]
    return {"state": snapshot, "losses": losses, "listing": sorted(os.listdir(root))} if dist.get_rank() == 0 else None


def fsdp_resume_continue(root: str, cpu_offload: bool = False) -> dict[str, Any] | None:
    """Resume at this world size, snapshot the full state, train steps 2 and 3."""
    from shardkit.checkpoint.ops.fsdp_checkpoint import load_fsdp_checkpoint

    model, opt = fsdp_model(cpu_offload)
    report = load_fsdp_checkpoint(model, opt, root)
    snapshot = _full_state(model, opt)
    losses = [_fsdp_step(model, opt, s) for s in (2, 3)]
    if dist.get_rank() != 0:
        return None
    return {"state": snapshot, "losses": losses, "step": report.manifest.step,
            "user": report.manifest.extra["user"], "findings": [f.rule for f in report.findings]}


# ---- plain torch ---------------------------------------------------------------------------------


def torch_save_then_die(root: str) -> None:
    """save_training 'step1' completes; the 'step2' save is SIGKILLed while optimizer.pt is written."""
    from shardkit.checkpoint.ops.torch_training import save_training

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    save_training(root, model=model, optimizer=opt, step=1)
    real_save = torch.save

    def save_and_die(obj, f, *a, **kw):
        real_save(obj, f, *a, **kw)
        if "param_groups" in obj:  # the optimizer state: half of the checkpoint is on disk
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save_and_die
    opt.step()
    save_training(root, model=model, optimizer=opt, step=2)


def _ddp_parts(seed: int):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)  # same initial weights on every rank, as DDP expects
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    torch.manual_seed(seed + dist.get_rank())  # per-rank dropout / data streams
    return model, opt, sched


def _ddp_steps(model, opt, sched, n: int) -> list[float]:
    out = []
    for _ in range(n):
        x = torch.randn(4, 8)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        out.append(loss.item())
    return out


def ddp_save_continue(root: str) -> list[float]:
    """2 steps, save_training from every rank (each saves its RNG), 3 more steps: the reference."""
    from shardkit.checkpoint.ops.torch_training import save_training

    model, opt, sched = _ddp_parts(seed=1)
    _ddp_steps(model, opt, sched, 2)
    save_training(root, model=model, optimizer=opt, lr_scheduler=sched, step=2)
    return _ddp_steps(model, opt, sched, 3)


def ddp_resume_continue(root: str) -> dict[str, Any]:
    from shardkit.checkpoint.ops.torch_training import resume_training

    model, opt, sched = _ddp_parts(seed=99)
    res = resume_training(root, model=model, optimizer=opt, lr_scheduler=sched)
    return {"losses": _ddp_steps(model, opt, sched, 3), "notes": res.notes, "step": res.step}


def torch_save_when_rank0_cannot_finish(root: str) -> str:
    """save_training at N ranks where only rank 0's final step fails ('latest' is a directory, so
    replacing it fails): every rank must return the same CheckpointError, none may hang."""
    from shardkit.checkpoint.ops.torch_training import save_training
    from shardkit.core.errors import CheckpointError

    model = torch.nn.Linear(4, 4)
    try:
        save_training(root, model=model, step=1)
    except CheckpointError as exc:
        return f"CheckpointError: {exc}"
    return "saved"


def torch_save_when_rank1_fails_writing(root: str) -> str:
    """Rank 1's write raises inside the save: every rank raises, none waits in a barrier."""
    from shardkit.checkpoint.ops.torch_training import save_training
    from shardkit.core.errors import CheckpointError

    class Unsaveable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this extra object")

    try:
        # extra is written by rank 0 only; make rank 1 fail by handing it a model it cannot save
        if dist.get_rank() == 1:
            import shardkit.checkpoint.ops.torch_training as tr

            tr.rng_state = lambda: {"bad": Unsaveable()}
        save_training(root, model=torch.nn.Linear(4, 4), step=1)
    except (CheckpointError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def ds_save_with_checkpoint_config(root: str, checkpoint_cfg: dict[str, Any]) -> str:
    """Build a ZeRO-3 engine whose config has ``checkpoint: checkpoint_cfg`` and try a shardkit save."""
    from shardkit.checkpoint.ops.save_zero3 import save_deepspeed_checkpoint
    from shardkit.core.errors import CheckpointError
    from shardkit.engines.deepspeed import initialize
    from shardkit.engines.model_factory import tiny_llama

    engine = initialize(tiny_llama("tiny", seed=0), {**ds_config(), "checkpoint": checkpoint_cfg})
    try:
        save_deepspeed_checkpoint(engine, root, tag="step0")
    except CheckpointError as exc:
        return f"CheckpointError: {exc}"
    return "saved"
