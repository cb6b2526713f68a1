"""The rank side of `shardkit smoke`: build the tiny Llama under one engine, maybe resume, train
steps [start, stop), maybe save; module-level functions because ``run_ranks`` sends its target by
name. torch and deepspeed are imported only when a rank runs (inside these functions and the
engine functions they call), after its environment is set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.checkpoint.ops.fsdp_checkpoint import load_fsdp_checkpoint, save_fsdp_checkpoint
from shardkit.checkpoint.ops.resume_zero3 import load_checkpoint_resharded
from shardkit.checkpoint.ops.save_zero3 import save_deepspeed_checkpoint
from shardkit.config.fsdp import fsdp_config_from_dict
from shardkit.engines.deepspeed import initialize as deepspeed_initialize
from shardkit.engines.deepspeed import train_step as deepspeed_step
from shardkit.engines.fsdp import initialize as fsdp_initialize
from shardkit.engines.fsdp import train_step as fsdp_step
from shardkit.engines.model_factory import synthetic_batch, tiny_llama
from shardkit.placement.preflight import preflight
from shardkit.platform.device_rules import accelerator_device
from shardkit.run.spawn.process import redirect_output
from shardkit.storage.verify import check_resumable


@dataclass
class RunSpec:
    """One run on every rank (pickled to the spawned ranks)."""

    engine: str
    config: dict[str, Any]
    model: str
    seed: int
    batch: int
    seq_len: int
    start: int
    """First step index (data and schedule are functions of the step)."""
    stop: int
    """One past the last step index."""
    checkpoint_root: str
    save: bool = False
    """Save a checkpoint tagged step<stop> after the last step."""
    resume: bool = False
    """Load the latest checkpoint before the first step, then run the preflight."""
    log_dir: str | None = None
    """Each rank's stdout/stderr goes to ``log_dir/rank<r>.log`` (engines are chatty)."""


def rank_run(spec: RunSpec) -> dict[str, Any]:
    """Rank target: build, maybe resume, train steps [start, stop), maybe save; return losses."""
    import torch
    import torch.distributed as dist

    if spec.log_dir is not None:
        redirect_output(Path(spec.log_dir) / f"rank{dist.get_rank()}.log")
    # Same init on every rank and run; the data never touches the global RNG.
    torch.manual_seed(spec.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if spec.engine == "zero3":
        return _zero3_run(spec)
    return _fsdp2_run(spec)


def _batch(vocab: int, spec: RunSpec, step: int) -> Any:
    import torch.distributed as dist

    return synthetic_batch(vocab, spec.batch, spec.seq_len, step, dist.get_rank())


def _preflight(**kwargs: Any) -> str:
    """Run shardkit's placement preflight; PreflightError propagates (the run fails, naming it)."""
    preflight(**kwargs)
    return "passed"


def _zero3_run(spec: RunSpec) -> dict[str, Any]:
    if spec.resume:
        _zero3_verify(spec.checkpoint_root)
    model = tiny_llama(spec.model, spec.seed)
    vocab = int(getattr(model, "config").vocab_size)
    engine = deepspeed_initialize(model, spec.config)
    checkpoint = "-"
    preflight = "not run"
    if spec.resume:
        checkpoint = _zero3_load(engine, spec.checkpoint_root)
        preflight = _preflight(engine=engine, config=spec.config)
    losses = [deepspeed_step(engine, _batch(vocab, spec, step)) for step in range(spec.start, spec.stop)]
    if spec.save:
        checkpoint = _zero3_save(engine, spec.checkpoint_root, f"step{spec.stop}")
    return {"losses": losses, "preflight": preflight, "checkpoint": checkpoint, "device": str(engine.device)}


def _zero3_save(engine: Any, root: str, tag: str) -> str:
    save_deepspeed_checkpoint(engine, root, tag)
    return "shardkit atomic"


def _zero3_verify(root: str) -> None:
    """Check the checkpoint against its manifest before anything is built (a damaged file is named,
    never a raw unpickling traceback)."""
    import torch.distributed as dist

    # sizes, checksums, rank files, engine and world size, before any tensor is unpickled
    check_resumable(root, world_size=dist.get_world_size(), engine="deepspeed")


def _zero3_load(engine: Any, root: str) -> str:
    """shardkit's ZeRO-3 reader (restricted unpickling), not engine.load_checkpoint (plain torch.load)."""
    # verify=False: _zero3_verify checked the manifest before the engine was built;
    # preflight=False: the smoke runs it itself, with the config, and reports it.
    load_checkpoint_resharded(engine, root, verify=False, preflight=False)
    return "verified zero3"


def _fsdp2_run(spec: RunSpec) -> dict[str, Any]:
    import torch

    cfg = fsdp_config_from_dict(spec.config)
    device = accelerator_device()
    model = tiny_llama(spec.model, spec.seed)
    vocab = int(getattr(model, "config").vocab_size)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
        model.to(device)
    model, optimizer = fsdp_initialize(model, cfg)
    checkpoint = "-"
    preflight = "not run"
    if spec.resume:
        checkpoint = _fsdp2_load(model, optimizer, spec.checkpoint_root)
        preflight = _preflight(model=model, optimizer=optimizer, config=spec.config)
    losses = [fsdp_step(model, optimizer, _batch(vocab, spec, step), cfg) for step in range(spec.start, spec.stop)]
    if spec.save:
        checkpoint = _fsdp2_save(model, optimizer, spec.checkpoint_root, f"step{spec.stop}", spec.config)
    return {"losses": losses, "preflight": preflight, "checkpoint": checkpoint, "device": str(device)}


def _fsdp2_save(model: Any, optimizer: Any, root: str, tag: str, config: dict[str, Any]) -> str:
    save_fsdp_checkpoint(model, optimizer, root, tag=tag, config=config)
    return "shardkit atomic dcp"


def _fsdp2_load(model: Any, optimizer: Any, root: str) -> str:
    # verifies the manifest (sizes, checksums) before reading a tensor, and reads DCP's .metadata
    # through a restricted unpickler (never plain dcp.load)
    load_fsdp_checkpoint(model, optimizer, root)
    return "verified dcp"
