"""FSDP2 checkpoints through ``torch.distributed.checkpoint`` (DCP): sharded, atomic, reshardable.

- Save: ``get_state_dict`` (sharded DTensor state keyed by parameter FQN, so it reshards), then
  ``dcp.save`` inside ``atomic_checkpoint`` (staging folder, manifest with files, sizes, sha256 and
  world size, rename to ``root/<tag>``, ``root/latest`` moved last).
- Load: ``check_resumable_distributed`` first (each rank hashes its share of the files), then
  ``load_dcp_state`` (``dcp.load`` through a restricted ``.metadata`` unpickler and a
  weights_only planner) in place into this run's shards (any world size: DCP reads the slices
  each rank now owns), then ``set_model_state_dict`` and
  ``set_optimizer_state_dict`` *separately*. Never ``set_state_dict(...,
  broadcast_from_rank0=True)``: with an empty model dict on non-zero ranks it deadlocks.
- Export: the full, unsharded model state dict gathered to rank 0 and written as safetensors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkit.checkpoint.dcp.reader import METADATA_NAME, load_dcp_state, read_dcp_metadata
from shardkit.checkpoint.io.atomic import atomic_open
from shardkit.checkpoint.io.staged_save import atomic_checkpoint
from shardkit.checkpoint.io.verify import CheckpointReport, check_resumable_distributed
from shardkit.config.loading import config_digest
from shardkit.core.errors import CheckpointError
from shardkit.platform.dist import barrier, rank_world

if TYPE_CHECKING:
    import torch

MODEL_KEY = "model"
OPTIM_KEY = "optim"


def _param_dtype(model: "torch.nn.Module") -> str | None:
    for p in model.parameters():
        return str(p.dtype).removeprefix("torch.")
    return None


def save_fsdp_checkpoint(
    model: "torch.nn.Module",
    optimizer: "torch.optim.Optimizer | None",
    root: str | os.PathLike[str],
    *,
    step: int | None = None,
    tag: str | None = None,
    config: Any = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save an FSDP2 model (and optimizer) as a DCP checkpoint under ``root/<tag>``, atomically.

    Collective: every rank calls it. ``extra`` (JSON data: epoch, data-loader position ...) is kept
    in the manifest and returned by ``load_fsdp_checkpoint``. Returns the final tag directory.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    tag = tag or (f"step{step}" if step is not None else "checkpoint")
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {MODEL_KEY: model_sd, OPTIM_KEY: optim_sd}
    else:
        state = {MODEL_KEY: get_model_state_dict(model)}
    # Buffers named: `shardkit convert --to zero3` must tell a frozen parameter from a buffer, and
    # in a 1-rank save both are one unsplit tensor.
    buffers = [n for n, _ in model.named_buffers() if n in state[MODEL_KEY]]
    facts = dict(step=step, dtype=_param_dtype(model), config_digest=config_digest(config),
                 extra={"format": "torch.distributed.checkpoint", "keys": sorted(state), "user": extra or {},
                        "buffers": buffers})
    with atomic_checkpoint(root, tag, engine="fsdp2", **facts) as save:
        dcp.save(state, checkpoint_id=str(save.path))
    return save.final


def load_fsdp_checkpoint(
    model: "torch.nn.Module",
    optimizer: "torch.optim.Optimizer | None",
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    checksums: bool = True,
) -> CheckpointReport:
    """Load a checkpoint ``save_fsdp_checkpoint`` wrote (root or tag dir) into this run's shards, at
    this run's world size (2 -> 1, 2 -> 3 ... DCP reshards). Collective. Returns the verified
    report; ``report.manifest.step`` and ``report.manifest.extra["user"]`` hold what was saved."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    _, world = rank_world()
    report = check_resumable_distributed(path, engine="fsdp2", world_size=world, checksums=checksums)
    assert report.tag_dir is not None and report.manifest is not None  # check_resumable_distributed raised otherwise
    saved_keys = set(report.manifest.extra.get("keys", [MODEL_KEY]))
    if optimizer is not None and OPTIM_KEY not in saved_keys:
        raise CheckpointError(f"{report.tag_dir}: saved without optimizer state, but an optimizer was passed; "
                              "pass optimizer=None to load the model only")
    if optimizer is not None:
        _check_param_group_count(report.tag_dir, optimizer)
    # The templates are this run's own shards: dcp.load fills them in place, reading from the
    # saved shards whatever world size wrote them. (get_state_dict also creates the optimizer's
    # state with a zero-lr step when it is empty, so there is somewhere to load into.)
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {MODEL_KEY: model_sd, OPTIM_KEY: optim_sd}
    else:
        state = {MODEL_KEY: get_model_state_dict(model)}
    load_dcp_state(state, report.tag_dir)  # never plain dcp.load: it unpickles .metadata unrestricted
    opts = StateDictOptions(strict=strict)
    # Separately, never set_state_dict(broadcast_from_rank0=True): that deadlocks when non-zero
    # ranks hold an empty model dict.
    set_model_state_dict(model, state[MODEL_KEY], options=opts)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state[OPTIM_KEY], options=opts)
    return report


def _check_param_group_count(tag_dir: str | os.PathLike[str], optimizer: "torch.optim.Optimizer") -> None:
    """DCP fills this run's param groups by index (``optim.param_groups.<i>.<key>``): with fewer
    groups than were saved, the parameters of the groups left out would silently train with another
    group's lr and weight decay (seen with a converted 2-group ZeRO-3 checkpoint). Count the saved
    groups in ``.metadata`` and refuse a mismatch."""
    prefix = f"{OPTIM_KEY}.param_groups."
    keys = read_dcp_metadata(Path(tag_dir) / METADATA_NAME).state_dict_metadata
    saved = len({k[len(prefix):].split(".", 1)[0] for k in keys if k.startswith(prefix)})
    if saved and saved != len(optimizer.param_groups):
        raise CheckpointError(
            f"{tag_dir}: the checkpoint's optimizer has {saved} param group(s), this optimizer "
            f"{len(optimizer.param_groups)}; loading would give the parameters of the groups that do not match another "
            f"group's lr and weight decay (DCP fills param groups by index). Build the optimizer with the same {saved} "
            "group(s) over the same parameters (shardkit convert prints them)"
        )


def _storage_ptrs(tensors: Any) -> set[int]:
    """Storage addresses of live tensors (the local shard of a DTensor)."""
    import torch

    out: set[int] = set()
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            out.add(local.untyped_storage().data_ptr())
    return out


def _unalias(value: Any, live: set[int]) -> Any:
    """Clone tensors that share storage with live training state. get_*_state_dict(full_state_dict,
    cpu_offload) returns plain (non-DTensor) tensors such as Adam's ``step`` as they are, and at
    world size 1 on CPU every tensor, so the next optimizer step would rewrite the "snapshot"."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone() if value.untyped_storage().data_ptr() in live else value
    if isinstance(value, dict):
        return {k: _unalias(v, live) for k, v in value.items()}
    if isinstance(value, list):
        return [_unalias(v, live) for v in value]
    return value


def full_model_state_dict(model: "torch.nn.Module") -> dict[str, "torch.Tensor"]:
    """The unsharded model state dict on rank 0's CPU (empty dict on other ranks), never aliasing
    the live parameters. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return _unalias(sd, _storage_ptrs([*model.parameters(), *model.buffers()]))


def full_optimizer_state_dict(model: "torch.nn.Module", optimizer: "torch.optim.Optimizer") -> dict[str, Any]:
    """The unsharded optimizer state dict (keyed by parameter FQN) on rank 0's CPU, never aliasing
    the live state. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    live = _storage_ptrs(v for st in optimizer.state.values() for v in st.values())
    return _unalias(sd, live)


def export_safetensors(model: "torch.nn.Module", out: str | os.PathLike[str], *, metadata: dict[str, str] | None = None) -> Path | None:
    """Gather the full model state dict and write it as one safetensors file from rank 0, atomically
    (temporary name, fsync, rename). Collective; returns the path on rank 0, None elsewhere."""
    full = full_model_state_dict(model)
    rank, _ = rank_world()
    if rank != 0:
        barrier()
        return None
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, Any] = {}
    seen: set[int] = set()
    for name, t in full.items():
        t = t.detach().contiguous()
        if t.untyped_storage().data_ptr() in seen:  # safetensors refuses shared storage (tied weights)
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    from safetensors.torch import save_file

    with atomic_open(out, "wb") as fh:
        # save_file writes by path (streaming, no second in-memory copy): into atomic_open's own
        # temporary, which atomic_open then fsyncs and renames over ``out``
        save_file(tensors, fh.name, metadata={"format": "pt", **(metadata or {})})
    barrier()
    return out
