"""Atomic DeepSpeed saves: ``engine.save_checkpoint`` into a staging directory, a manifest, a
rename, and only then the ``latest`` pointer.

DeepSpeed's own ``save_checkpoint`` writes straight into ``<root>/<tag>`` and rewrites ``latest``
in place (``open(..., 'w')``, no fsync), so a rank killed mid-save leaves a half-written tag and,
if rank 0 got that far, a ``latest`` naming it. Here ``latest`` keeps DeepSpeed's format (the bare
tag), so ``engine.load_checkpoint(root)`` still works unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkit.config.loading import config_digest
from shardkit.core.errors import CheckpointError
from shardkit.storage.staged_save import atomic_checkpoint

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine


def _device_name(offload: Any) -> str:
    if offload is None:
        return "none"
    dev = getattr(offload, "device", offload)
    return str(getattr(dev, "value", dev))


def engine_facts(engine: "DeepSpeedEngine") -> dict[str, Any]:
    """What the manifest records about a live engine."""
    import torch.distributed as dist

    dtype = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    return dict(
        world_size=dist.get_world_size() if dist.is_initialized() else 1,
        zero_stage=int(engine.zero_optimization_stage()),
        offload_optimizer=_device_name(engine.zero_offload_optimizer()),
        offload_param=_device_name(engine.zero_offload_param()),
        dtype=dtype,
        config_digest=config_digest(engine.config),
        step=int(engine.global_steps),
    )


def _refuse_unsupported_writers(engine: "DeepSpeedEngine") -> None:
    """The manifest hashes and the rename happen right after ``engine.save_checkpoint`` returns;
    both DeepSpeed modes below return before (or without) every file being on the shared disk."""
    ckpt_engine = getattr(engine, "checkpoint_engine", None)
    if ckpt_engine is not None and ckpt_engine.is_decoupled():
        raise CheckpointError(
            f"checkpoint.writer.decoupled (or datastates) is on: DeepSpeed's {type(ckpt_engine).__name__} writes "
            "in the background, so the files are not complete when save_checkpoint returns and shardkit would hash "
            "and publish a half-written checkpoint. Set checkpoint.writer.decoupled to false (or remove "
            "checkpoint.writer / datastates) for shardkit's atomic saves"
        )
    if engine.use_node_local_storage():
        raise CheckpointError(
            "checkpoint.use_node_local_storage is true: each node writes its rank files to its own disk, which the "
            "other nodes (and shardkit's manifest, hashed across ranks) cannot see. Set "
            "checkpoint.use_node_local_storage to false and save to storage every rank shares"
        )


def save_deepspeed_checkpoint(
    engine: "DeepSpeedEngine",
    root: str | Path,
    tag: str | None = None,
    client_state: dict[str, Any] | None = None,
    *,
    exclude_frozen_parameters: bool = False,
) -> Path:
    """Save ``engine`` atomically under ``root/<tag>`` and move ``root/latest`` to it last.

    Collective: every rank must call it (as with ``engine.save_checkpoint``). Returns the final
    tag directory. ``tag`` defaults to DeepSpeed's ``global_step<N>``. Needs one filesystem all
    ranks see (the manifest hashing is split across ranks) and a synchronous writer: DeepSpeed's
    node-local storage mode and decoupled/async checkpoint engines are refused.
    """
    _refuse_unsupported_writers(engine)
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    with atomic_checkpoint(root, tag, engine="deepspeed") as save:
        # save_latest=False: the pointer is ours to move, after the rename
        engine.save_checkpoint(str(root), tag=save.path.name, client_state=client_state or {}, save_latest=False,
                               exclude_frozen_parameters=exclude_frozen_parameters)
        save.facts.update(engine_facts(engine))
    return save.final
