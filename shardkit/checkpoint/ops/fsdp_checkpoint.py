"""FSDP2 checkpoints through ``torch.distributed.checkpoint`` (DCP): sharded, atomic, reshardable.

- Save: ``get_state_dict`` (sharded DTensor state keyed by parameter FQN, so it reshards), then
  ``dcp.save`` inside ``atomic_checkpoint`` (staging folder, manifest with files, sizes, digests and
  world size, rename to ``root/<tag>``, ``root/latest`` moved last).
- Load: ``check_resumable_distributed`` first (each rank hashes its share of the files), then
  ``load_dcp_state`` (``dcp.load`` through a restricted ``.metadata`` unpickler and a
  weights_only planner) in place into this run's shards (any world size: DCP reads the slices
  each rank now owns), then ``set_model_state_dict`` and
  ``set_optimizer_state_dict`` *separately*. Never ``set_state_dict(...,
  broadcast_from_rank0=True)``: with an empty model dict on non-zero ranks it deadlocks.
- param_group values that differ between ranks (a Prodigy's D statistics; DCP saves each entry
  once) are kept per rank in the manifest and handed back at the saved world size.
- Export: the full, unsharded model state dict gathered to rank 0 and written as safetensors.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkit.checkpoint.dcp.plain_metadata import METADATA_NAME
from shardkit.checkpoint.dcp.safe_load import load_dcp_state, read_dcp_metadata
from shardkit.checkpoint.readers.zero3_rank_values import RankDisagreement, is_number
from shardkit.checkpoint.writers.dcp import MODEL_KEY, OPTIM_KEY
from shardkit.config.loading import config_digest
from shardkit.core.errors import CheckpointError
from shardkit.platform.dist import all_gather_object, barrier, rank_world
from shardkit.storage.atomic import atomic_open
from shardkit.storage.staged_save import atomic_checkpoint
from shardkit.storage.verify import CheckpointReport, check_resumable_distributed

if TYPE_CHECKING:
    import torch


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

    tag = tag or (f"step{step}" if step is not None else "checkpoint")
    state = _state_dicts(model, optimizer)
    # Buffers named: `shardkit convert --to zero3` must tell a frozen parameter from a buffer, and
    # in a 1-rank save both are one unsplit tensor.
    buffers = [n for n, _ in model.named_buffers() if n in state[MODEL_KEY]]
    layout_extra: dict[str, Any] = {"format": "torch.distributed.checkpoint", "keys": sorted(state),
                                    "user": extra or {}, "buffers": buffers}
    if optimizer is not None:
        per_rank = per_rank_param_group_values(optimizer)
        if per_rank:
            layout_extra[PER_RANK_GROUPS_KEY] = per_rank
    with atomic_checkpoint(root, tag, engine="fsdp2", step=step, dtype=_param_dtype(model),
                           config_digest=config_digest(config), extra=layout_extra) as save:
        dcp.save(state, checkpoint_id=str(save.path))
    return save.final


def _state_dicts(model: "torch.nn.Module", optimizer: "torch.optim.Optimizer | None") -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` from ``get_state_dict`` (sharded DTensor state keyed by parameter FQN),
    the model's alone without an optimizer: what ``dcp.save`` writes, and the templates ``dcp.load`` fills."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {MODEL_KEY: get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {MODEL_KEY: model_sd, OPTIM_KEY: optim_sd}


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
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

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
    state = _state_dicts(model, optimizer)
    load_dcp_state(state, report.tag_dir)  # never plain dcp.load: it unpickles .metadata unrestricted
    opts = StateDictOptions(strict=strict)
    # Separately, never set_state_dict(broadcast_from_rank0=True): that deadlocks when non-zero
    # ranks hold an empty model dict.
    set_model_state_dict(model, state[MODEL_KEY], options=opts)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state[OPTIM_KEY], options=opts)
        restore_per_rank_param_group_values(optimizer, report.manifest.extra.get(PER_RANK_GROUPS_KEY) or {},
                                            saved_world_size=report.manifest.world_size, where=report.tag_dir)
    return report


# --- param_group values that differ between ranks ---------------------------------------------------
#
# DCP saves each ``optim.param_groups.<i>.<key>`` once (its planner de-duplicates the item and keeps
# the copy of whichever rank balances storage best) and gives that one value to every rank at load.
# Right for hyperparameters; wrong for an optimizer that computes statistics from each rank's own
# shards (prodigyopt's Prodigy: d, d_numerator ... differ per rank under FSDP2). shardkit compares a
# digest of every value across ranks at save (one small dict per rank), and only where they differ
# gathers the values themselves into the manifest, per rank, and puts them back at load.

#: Manifest ``extra`` key: ``{"<group>.<key>": {"kind": ..., "dtype": ..., "values": [per rank]}}``.
PER_RANK_GROUPS_KEY = "per_rank_param_groups"


class PerRankParamGroupWarning(UserWarning):
    """Ranks hold different values of an optimizer param_group entry that a DCP checkpoint keeps
    only once: some ranks' values are lost (or, at another world size, cannot be handed back)."""


def _group_values(optimizer: "torch.optim.Optimizer") -> dict[str, Any]:
    """``{"<group>.<key>": value}`` of every param_group entry but ``params`` (a DTensor is sharded
    by design and left out)."""
    import torch

    out: dict[str, Any] = {}
    for g, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if key == "params" or (torch.is_tensor(value) and hasattr(value, "to_local")):
                continue
            out[f"{g}.{key}"] = value
    return out


def _digest(value: Any) -> str:
    import hashlib

    import torch

    if torch.is_tensor(value):
        t = value.detach().cpu().contiguous()
        body = f"{t.dtype}{tuple(t.shape)}".encode() + t.view(torch.uint8).numpy().tobytes()
    else:
        body = f"{type(value).__name__}:{value!r}".encode()
    return hashlib.sha256(body).hexdigest()[:16]


def _encode(value: Any) -> tuple[str, str | None, Any] | None:
    """``(kind, tensor dtype or None, JSON-exact value)`` for a number or a one-element tensor (floats
    as ``float.hex``: exact, NaN/inf included); None for anything else."""
    import torch

    if not is_number(value):
        return None
    dtype, value = (str(value.dtype).removeprefix("torch."), value.item()) if torch.is_tensor(value) else (None, value)
    return ("float", dtype, float(value).hex()) if isinstance(value, float) else ("int", dtype, int(value))


def per_rank_param_group_values(optimizer: "torch.optim.Optimizer") -> dict[str, Any]:
    """The param_group entries whose values differ between ranks, each as ``{"kind", "dtype",
    "values": [one per rank]}`` for the manifest. Collective. Entries that differ but are not numbers
    (DCP keeps one rank's) are named in a ``PerRankParamGroupWarning`` on rank 0."""
    rank, world = rank_world()
    if world == 1:
        return {}
    values = _group_values(optimizer)
    digests = all_gather_object({k: _digest(v) for k, v in values.items()})
    keys = list(dict.fromkeys(k for d in digests for k in d))
    differing = [k for k in keys if len({d.get(k) for d in digests}) > 1]
    if not differing:
        return {}
    # every rank saw the same digests, so every rank enters this second, detail-only collective
    encoded = all_gather_object({k: _encode(values[k]) if k in values else None for k in differing})
    kept: dict[str, Any] = {}
    lost: list[str] = []
    for key in differing:
        per_rank = [e.get(key) for e in encoded]
        if all(x is not None for x in per_rank) and len({(x[0], x[1]) for x in per_rank}) == 1:
            kept[key] = {"kind": per_rank[0][0], "dtype": per_rank[0][1], "values": [x[2] for x in per_rank]}
        else:
            lost.append(key)
    if lost and rank == 0:
        shown = "; ".join(f"param_groups[{k.split('.', 1)[0]}].{k.split('.', 1)[1]}" for k in lost[:8])
        warnings.warn(
            f"optimizer param_group entries differ between the {world} ranks and are not numbers shardkit can keep per "
            f"rank: {shown}{'; ...' if len(lost) > 8 else ''}. DCP saves each entry once, so every rank but one "
            "loses its value at load. Keep such values in the optimizer's per-parameter state instead (register it "
            "with shardkit.register_extra_state so it is placed and checked), or make them equal on every rank",
            PerRankParamGroupWarning, stacklevel=3)
    return kept


def _decode(entry: dict[str, Any], value: Any, template: Any) -> Any:
    import torch

    number = float.fromhex(value) if entry["kind"] == "float" else int(value)
    if entry.get("dtype") is None:
        return number
    device = template.device if torch.is_tensor(template) else "cpu"
    shape = template.shape if torch.is_tensor(template) else ()
    return torch.tensor(number, dtype=getattr(torch, entry["dtype"]), device=device).reshape(shape)


def restore_per_rank_param_group_values(optimizer: "torch.optim.Optimizer", per_rank: dict[str, Any], *,
                                        saved_world_size: int, where: Any) -> None:
    """Give this rank back its own value of each entry ``per_rank_param_group_values`` kept, after
    ``set_optimizer_state_dict`` gave every rank DCP's one copy. At another world size there is no
    mapping of ranks: DCP's value stays, and a ``PerRankParamGroupWarning`` names what was not restored."""
    if not per_rank:
        return
    rank, world = rank_world()
    places = {key: _checked_entry(key, entry, saved_world_size, len(optimizer.param_groups), where)
              for key, entry in per_rank.items()}
    if world != saved_world_size:
        if rank == 0:
            shown = "; ".join(RankDisagreement(f"param_groups[{places[k][0]}].{places[k][1]}",
                                               [_decode(e, v, None) for v in e["values"]]).render()
                              for k, e in list(per_rank.items())[:8])
            warnings.warn(
                f"{where}: the {saved_world_size} saved ranks kept different values of {shown}; loading at world size "
                f"{world}, every rank resumes with the one DCP saved (one saved rank's statistics cannot be mapped to "
                f"the new shards; the optimizer re-estimates them as it steps). Resume at world size {saved_world_size} "
                "to keep each rank's own", PerRankParamGroupWarning, stacklevel=3)
        return
    for key, entry in per_rank.items():
        g, name = places[key]
        group = optimizer.param_groups[g]
        if name in group:  # as DCP: only keys this optimizer has (Prodigy writes d_denom at each step)
            group[name] = _decode(entry, entry["values"][rank], group[name])


def _checked_entry(key: Any, entry: Any, world: int, n_groups: int, where: Any) -> tuple[int, str]:
    """``(group index, key)`` of a manifest entry, refusing one shardkit did not write (the manifest
    is read from a checkpoint that may come from elsewhere)."""
    import torch

    g, _, name = str(key).partition(".")
    ok = (g.isdigit() and int(g) < n_groups and name and isinstance(entry, dict)
          and entry.get("kind") in ("float", "int") and isinstance(entry.get("values"), list)
          and len(entry["values"]) == world
          and (entry.get("dtype") is None or isinstance(getattr(torch, str(entry["dtype"]), None), torch.dtype)))
    if ok:
        try:
            for v in entry["values"]:
                float.fromhex(v) if entry["kind"] == "float" else int(v)
        except (TypeError, ValueError):
            ok = False
    if not ok:
        raise CheckpointError(
            f"{where}: manifest extra.{PER_RANK_GROUPS_KEY}[{key!r}] is {str(entry)[:120]!r}, not what shardkit writes "
            f"(kind float/int, a torch dtype or null, one value per saved rank, {world}; a param group index below "
            f"{n_groups}). The manifest was edited or damaged; restore it from the checkpoint's source")
    return int(g), name


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

    with atomic_open(out, "wb", output=True) as fh:
        # save_file writes by path (streaming, no second in-memory copy): into atomic_open's own
        # temporary, which atomic_open then fsyncs and renames over ``out``
        save_file(tensors, fh.name, metadata={"format": "pt", **(metadata or {})})
    barrier()
    return out
