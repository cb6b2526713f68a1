"""Record where every tensor of a live run is, in the format of the GPU ground truth
(``tests/data/gpu_truth/*.json``), so anyone with GPUs can add a case and shardkit can judge it
offline (``shardkit preflight --observed``).

The walk reads the objects directly, as the H100 recordings did (their ``capture.py``), never
through shardkit's placement records: a snapshot is evidence about DeepSpeed and FSDP2, not about
shardkit. Entries (one dict per tensor):

- ``param NAME``: ``device`` of the parameter; under ZeRO-3 also ``ds_tensor`` (the partition's
  device), ``ds_numel``, ``ds_persist``, ``ds_status``; under FSDP2 ``local`` (the local shard's device);
- ``grad NAME``: the parameter's gradient (its local shard for a DTensor);
- ``opt.ATTR[i]...``: every tensor attribute of the (ZeRO) optimizer object, as DeepSpeed names it;
- ``state[k].KEY`` / ``param_groups[g].KEY``: the inner torch optimizer's state and group tensors.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from shardkit.core.errors import UsageError
from shardkit.core.files import FileReadError, read_regular_file
from shardkit.placement.collect import collect_records
from shardkit.placement.deepspeed import engine_config
from shardkit.placement.fsdp import is_fsdp2, module_offloads
from shardkit.platform.versions import runtime_versions
from shardkit.storage.atomic import atomic_open

if TYPE_CHECKING:
    import torch

# Nesting depth the walk follows inside optimizer attributes (lists of lists of tensors).
_MAX_DEPTH = 2
FORMAT = 1
"""Snapshot format version written as ``format``; recordings without it are format 1."""


def _dev(t: "torch.Tensor") -> str:
    return str(t.device)


def _dtype(t: "torch.Tensor") -> str:
    return str(t.dtype).replace("torch.", "")


def _walk(prefix: str, value: Any, out: list[dict[str, Any]], depth: int = 0) -> None:
    import torch

    if torch.is_tensor(value):
        local = value.to_local() if hasattr(value, "to_local") else value
        out.append({"name": prefix, "device": _dev(local), "dtype": _dtype(local), "numel": local.numel()})
        return
    if depth < _MAX_DEPTH and isinstance(value, (list, tuple)):
        for k, x in enumerate(value):
            _walk(f"{prefix}[{k}]", x, out, depth + 1)
    if depth < _MAX_DEPTH and isinstance(value, dict):
        for k, x in value.items():
            _walk(f"{prefix}[{k}]", x, out, depth + 1)


def snapshot_entries(module: "torch.nn.Module | None", optimizer: Any) -> list[dict[str, Any]]:
    """Every tensor of ``module`` and ``optimizer`` with its device, in the ground-truth format."""
    import torch

    out: list[dict[str, Any]] = []
    for n, p in (module.named_parameters() if module is not None else []):
        entry: dict[str, Any] = {"name": f"param {n}", "device": _dev(p), "dtype": _dtype(p), "numel": p.numel()}
        shard = getattr(p, "ds_tensor", None)
        if shard is not None:
            entry.update(ds_tensor=_dev(shard), ds_numel=shard.numel(), ds_persist=bool(getattr(p, "ds_persist", False)),
                         ds_status=str(getattr(p, "ds_status", "")))
        if hasattr(p, "to_local"):
            entry["local"] = _dev(p.to_local())
        out.append(entry)
        if p.grad is not None:
            _walk(f"grad {n}", p.grad, out)
    if optimizer is None:
        return out
    for attr, val in sorted(vars(optimizer).items()):
        if attr in ("state", "param_groups", "defaults"):
            continue
        _walk(f"opt.{attr}", val, out)
    inner = getattr(optimizer, "optimizer", optimizer)
    if isinstance(inner, torch.optim.Optimizer):
        for k, (_, st) in enumerate(inner.state.items()):
            for s, t in st.items():
                if torch.is_tensor(t):
                    _walk(f"state[{k}].{s}", t, out)
        for g, grp in enumerate(inner.param_groups):
            for key, v in grp.items():
                if key != "params" and torch.is_tensor(v):
                    _walk(f"param_groups[{g}].{key}", v, out)
    return out


def optimizer_info(optimizer: Any) -> dict[str, Any]:
    """The inner optimizer's class and the flags torch's ``step`` rule reads (fused/capturable)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    groups = getattr(inner, "param_groups", None) or [{}]
    cls = type(inner)
    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "fused": bool(groups[0].get("fused") or False),
        "capturable": bool(groups[0].get("capturable") or False),
    }


def spec_for(engine: Any = None, model: Any = None, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A spec in the ground truth's terms: what the judge needs to know about the run."""
    if engine is not None:
        return {"engine": "deepspeed", "config": dict(config) if config is not None else engine_config(engine)}
    if model is not None and is_fsdp2(model):
        spec: dict[str, Any] = {"engine": "fsdp2"}
        offload = module_offloads(model)
        if offload:
            spec["offload"] = True
        return spec
    return {"engine": "torch"}


def record_phase(engine: Any = None, *, model: Any = None, optimizer: Any = None) -> list[dict[str, Any]]:
    """One phase's entries for a DeepSpeed engine, or a model (plain or FSDP2) and its optimizer."""
    if engine is not None:
        return snapshot_entries(engine.module, engine.optimizer)
    return snapshot_entries(model, optimizer)


def snapshot_header(
    name: str, engine: Any = None, *, model: Any = None, optimizer: Any = None, config: Mapping[str, Any] | None = None,
    device: str | None = None,
) -> dict[str, Any]:
    """Everything a snapshot says besides its phases: spec, versions, the rank and its compute device."""
    import torch

    rank_report = collect_records(engine, model=model, optimizer=optimizer, config=config, device=device)
    versions = runtime_versions()
    head: dict[str, Any] = {
        "format": FORMAT,
        "name": name,
        "spec": spec_for(engine, model, config),
        "torch": versions.get("torch", ""),
        "host": platform.node(),
        "rank": rank_report.rank,
        "world_size": rank_report.world_size,
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "compute_device": rank_report.compute_device,
        "optimizer": optimizer_info(engine.optimizer if engine is not None else optimizer),
    }
    if "deepspeed" in versions:
        head["deepspeed"] = versions["deepspeed"]
    if torch.cuda.is_available():
        head["gpu"] = torch.cuda.get_device_name(0)
    return head


def record_snapshot(
    path: str | Path,
    engine: Any = None,
    *,
    model: Any = None,
    optimizer: Any = None,
    config: Mapping[str, Any] | None = None,
    phase: str = "after_init",
    name: str | None = None,
    device: str | None = None,
) -> dict[str, Any]:
    """Add ``phase`` (``after_init``, ``after_step`` ...) of this run to the snapshot at ``path``.

    Call it after initialize and again after a step: the file then holds both phases, like the
    recordings in ``tests/data/gpu_truth/``. The file is replaced atomically each time. Returns the
    snapshot written.
    """
    target = Path(path)
    existing = check_record_target(target)
    head = snapshot_header(name or target.stem, engine, model=model, optimizer=optimizer, config=config, device=device)
    # A later phase joins the snapshot of the same run (same spec and rank); "after_init" or another
    # run's file starts afresh, so phases of two runs are never judged under one spec.
    same_run = existing is not None and phase != "after_init" and all(
        existing.get(k) == head[k] for k in ("spec", "rank", "world_size", "compute_device"))
    snap = existing if same_run else head
    snap[phase] = record_phase(engine, model=model, optimizer=optimizer)
    with atomic_open(target, "w") as f:
        json.dump(snap, f, indent=1)
    return snap


def check_record_target(path: str | Path) -> dict[str, Any] | None:
    """Refuse a ``--record`` target that is not ours to replace: anything but a missing path or an
    earlier snapshot (a config file, a checkpoint, a device). Returns the earlier snapshot, if any."""
    target = Path(path)
    if not target.exists() and not target.is_symlink():
        return None
    if not target.is_file() or target.is_symlink():
        raise UsageError(f"--record {target}: exists and is not a regular file; a snapshot never replaces it "
                         "(pick a new file name)")
    try:
        data = json.loads(read_regular_file(target, 64 * 1024 * 1024) or b"null")
    except (FileReadError, ValueError, RecursionError):
        data = None
    if not (isinstance(data, dict) and isinstance(data.get("spec"), dict) and any(isinstance(v, list) for v in data.values())):
        raise UsageError(f"--record {target}: exists and is not a placement snapshot (a config? a checkpoint?); "
                         "shardkit replaces only earlier snapshots: pick a new file name or remove it")
    return data
