"""Placement records for FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each managed parameter is a DTensor whose local shard lives on the mesh's device, or on the CPU
under ``CPUOffloadPolicy`` (which also keeps its gradient and the optimizer state there: the step
runs on the CPU). A plain (non-DTensor) parameter inside a sharded model was added after
``fully_shard`` and is neither sharded nor reduced - a finding of its own, like ZeRO-3's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from shardkit.placement import records as R
from shardkit.placement.expected import ExpectedDevices, fsdp_expected
from shardkit.placement.records import EngineRecords
from shardkit.placement.tensor_records import tensor_record
from shardkit.placement.torch_state import optimizer_records, scaler_records, scheduler_records

if TYPE_CHECKING:
    import torch


def is_fsdp2(model: Any) -> bool:
    """True when ``model`` (or any submodule) was sharded with fully_shard."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _param_groups(model: "torch.nn.Module") -> list[Any]:
    """Every FSDPParamGroup under ``model``. torch 2.11 keeps one per module (``_fsdp_param_group``),
    torch 2.13 a list (``_fsdp_param_groups``); reading only one of them made an H100 run with
    CPUOffloadPolicy look unoffloaded (84 false alarms)."""
    from torch.distributed.fsdp import FSDPModule

    groups: list[Any] = []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        many = getattr(state, "_fsdp_param_groups", None)
        if many is None:
            one = getattr(state, "_fsdp_param_group", None)
            many = [one] if one is not None else []
        groups.extend(g for g in many if g is not None)
    return groups


def module_offloads(model: "torch.nn.Module") -> bool | None:
    """Whether fully_shard was given a CPUOffloadPolicy, read from the module's own FSDP state
    (each param group's ``offload_policy``); None when no group says."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    seen: list[bool] = []
    for group in _param_groups(model):
        policy = getattr(group, "offload_policy", None)
        if policy is not None:
            seen.append(isinstance(policy, CPUOffloadPolicy))
        else:
            seen.extend(bool(getattr(fp, "offload_to_cpu", False)) for fp in getattr(group, "fsdp_params", []))
    return any(seen) if seen else None


def fsdp_mesh_device(model: "torch.nn.Module") -> str | None:
    """The device FSDP2 computes on (the param group's ``device``: the mesh's accelerator even when
    the shards are offloaded to the CPU)."""
    for group in _param_groups(model):
        dev = getattr(group, "device", None)
        if dev is not None:
            return str(dev) if dev.index is not None or dev.type == "cpu" else f"{dev.type}:0"
    return None


def fsdp_expected_for(model: "torch.nn.Module", config: Mapping[str, Any] | None, compute: str) -> ExpectedDevices:
    """The policy fully_shard was given decides (the module knows whether it is offloaded); the
    config decides only when the module's state does not say. A config that disagrees with the
    module is named in every record's reason, and the records fail where the tensors disagree."""
    block = (config or {}).get("fsdp") if isinstance(config, Mapping) else None
    configured = bool(block["cpu_offload"]) if isinstance(block, Mapping) and "cpu_offload" in block else None
    on = module_offloads(model)
    if on is None:
        on = bool(configured)
        why = f"fsdp.cpu_offload={str(on).lower()}" if configured is not None else "fully_shard without CPU offload"
    else:
        why = "fully_shard(offload_policy=CPUOffloadPolicy)" if on else "fully_shard without CPU offload"
        if configured == on:
            why = f"fsdp.cpu_offload={str(on).lower()}"
        elif configured is not None:
            # The run is not the run the config describes: expect what the config says, so every
            # tensor the module put elsewhere is named.
            why = f"fsdp.cpu_offload={str(configured).lower()} (but the module was sharded {why})"
            on = configured
    return fsdp_expected(on, compute, why)


def collect_fsdp(
    model: "torch.nn.Module", optimizer: Any, scaler: Any, lr_scheduler: Any, rank: int, expected: ExpectedDevices
) -> EngineRecords:
    from torch.distributed.tensor import DTensor

    out = EngineRecords(engine="fsdp2")
    devs: dict[int, str] = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            out.param_numels[name] = p.numel()  # DTensor.numel() is the global size
            out.records.append(tensor_record(rank, name, R.FSDP_SHARD, p, expected.param_shard, expected.param_shard_why))
            if p.grad is not None:
                out.records.append(tensor_record(rank, f"{name}.grad", R.GRAD, p.grad, expected.param_shard, expected.param_shard_why))
            devs[id(p)] = expected.param_shard
        else:
            out.unmanaged.append(name)
            out.param_numels[name] = p.numel()
            out.records.append(tensor_record(rank, name, R.PARAM, p, expected.compute, "not sharded by fully_shard: must be on the compute device"))
            devs[id(p)] = expected.compute
    for name, b in model.named_buffers():
        if b is not None:
            out.records.append(tensor_record(rank, name, R.BUFFER, b, expected.compute, "buffers are used in forward: compute device"))
    if optimizer is not None:
        out.records += optimizer_records(optimizer, rank, devs, expected.optimizer, why=expected.optimizer_why)
    out.records += scaler_records(scaler, rank, expected.compute)
    out.records += scheduler_records(lr_scheduler, rank, optimizer, expected.compute)
    return out
