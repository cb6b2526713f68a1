"""Placement records for a DeepSpeed engine, ZeRO stages 0-3 (read from 0.19.8's stage3.py and
stage_1_and_2.py; every attribute is read with getattr so an older/newer layout degrades to fewer
records, not a crash).

ZeRO-3: each managed parameter keeps its local shard in ``param.ds_tensor`` (``ds_numel`` elements
= ceil(numel / world)) on ``offload_param.device``, ``ds_persist`` parameters (below
``param_persistence_threshold``) included: they keep their *full* ``param.data`` on the accelerator,
but their partition follows the offload device like every other (recorded on an H100 with
DeepSpeed 0.19.8, tests/data/gpu_truth/z3_offparam_only.json; reading ``_partition_param`` alone
suggested otherwise, and that false alarm failed healthy offload runs). ``param.data`` is a
placeholder (empty, or whole for persistent parameters) on the accelerator. fp32 masters are
``optimizer.fp32_partitioned_groups_flat[i]`` on ``optimizer.device`` (cpu with optimizer offload,
``subgroup_to_device`` with a ``ratio``), gradient partitions live in ``grad_partitions_flat_buffer``
on the same device, and the inner optimizer's state is keyed by the fp32 partitions.
ZeRO-1/2: bit16 parameters stay on the accelerator (``bit16_groups_flat``); the fp32 master
partition ``single_partition_of_fp32_groups[i]`` and the state live on cpu with optimizer offload.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardkit.placement import records as R
from shardkit.placement.expected import ExpectedDevices
from shardkit.placement.records import EngineRecords
from shardkit.placement.tensor_records import iter_tensors, tensor_record
from shardkit.placement.torch_state import module_records, optimizer_records, scheduler_records
from shardkit.placement.zero_attrs import expected_for, rule_for

if TYPE_CHECKING:
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine


def engine_config(engine: "DeepSpeedEngine") -> dict[str, Any]:
    """The config dict the engine was built from (``engine.config``; older releases keep it in
    ``engine._config._param_dict``)."""
    cfg = getattr(engine, "config", None)
    if isinstance(cfg, dict):
        return cfg
    inner = getattr(getattr(engine, "_config", None), "_param_dict", None)
    return inner if isinstance(inner, dict) else {}


def zero_stage(engine: "DeepSpeedEngine") -> int:
    try:
        return int(engine.zero_optimization_stage())
    except Exception:  # pragma: no cover - engines without ZeRO support
        return 0


def _inner_optimizer(engine: "DeepSpeedEngine") -> Any:
    import torch

    opt = getattr(engine, "optimizer", None)
    inner = getattr(opt, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    return opt if isinstance(opt, torch.optim.Optimizer) else None


def zero3_group_partitions(zopt: Any) -> "tuple[torch.optim.Optimizer, dict[int, list[torch.Tensor]]] | None":
    """For a ZeRO-3 optimizer wrapper: its inner optimizer and, per param group, the fp32 partitions
    that optimizer steps, in step order (None for anything else).

    Between steps ZeRO-3 leaves the inner optimizer's ``param_groups[i]['params']`` empty: it puts
    one sub-group's fp32 partition there for each step and clears it after (0.19.8
    ``stage3.py:1235-1262``, ``_optimizer_step``), so a param group's tensors (prodigy-plus-schedule-
    free's ``running_d_numerator``) cannot be placed from its parameters. The partition stepped first
    is where such an optimizer uses them first (prodigyplus moves them there on its step). Under
    partial offload the inner optimizer steps only the CPU sub-groups (the accelerator ones go to
    ``backup_optimizer``).
    """
    import torch

    inner = getattr(zopt, "optimizer", None)
    flats = list(getattr(zopt, "fp32_partitioned_groups_flat", None) or [])
    owners = getattr(zopt, "sub_group_to_group_id", None)
    if not isinstance(inner, torch.optim.Optimizer) or not flats or not isinstance(owners, dict):
        return None
    on_device = getattr(zopt, "subgroup_to_device", None) if getattr(zopt, "offload_optimizer", False) else None
    groups: dict[int, list[torch.Tensor]] = {}
    for j, flat in enumerate(flats):
        if isinstance(on_device, dict) and on_device.get(j, "cpu") != "cpu":
            continue  # stepped by backup_optimizer, not by the inner optimizer
        groups.setdefault(int(owners.get(j, 0)), []).append(flat)
    return inner, groups


def _torch_step_rule(optimizer: Any) -> bool:
    # torch's own optimizers keep `step` on cpu unless fused/capturable; DeepSpeed's (FusedAdam,
    # DeepSpeedCPUAdam ...) keep whatever they keep next to their partition.
    return type(optimizer).__module__.startswith("torch.optim")


def collect_deepspeed(engine: "DeepSpeedEngine", rank: int, expected: ExpectedDevices) -> EngineRecords:
    stage = zero_stage(engine)
    out = EngineRecords(engine=f"deepspeed-zero{stage}")
    if stage == 3:
        _zero3(engine, rank, expected, out)
    else:
        _zero012(engine, rank, expected, stage, out)
    out.records += scheduler_records(getattr(engine, "lr_scheduler", None), rank, _inner_optimizer(engine), expected.compute)
    return out


def _zero3(engine: Any, rank: int, expected: ExpectedDevices, out: EngineRecords) -> None:
    from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus

    module = engine.module
    for name, p in module.named_parameters():
        full = f"module.{name}"
        if not hasattr(p, "ds_id"):
            # Created after deepspeed.initialize (a replaced head): ZeRO-3 neither partitions nor
            # gathers nor updates it - a finding of its own whatever its device.
            out.unmanaged.append(full)
            out.param_numels[full] = p.numel()
            out.records.append(tensor_record(rank, full, R.ZERO_UNMANAGED, p, expected.compute, "a parameter ZeRO-3 does not manage must at least be on the compute device"))
            continue
        out.param_numels[full] = int(p.ds_numel)
        # The placeholder is gathered into on the compute device.
        out.records.append(tensor_record(rank, full, R.PARAM, p, expected.compute, "ZeRO-3 gathers parameters on the compute device"))
        shard = getattr(p, "ds_tensor", None)
        if shard is None:
            continue
        out.zero3_partitions[full] = int(getattr(shard, "ds_numel", shard.numel()))
        if not out.zero3_partition_ranks:
            out.zero3_partition_ranks = _partition_ranks(p)
        dev, why = expected.param_shard, expected.param_shard_why
        if getattr(shard, "status", None) == PartitionedParamStatus.NOT_AVAILABLE:
            # Swapped out to NVMe: nothing in memory to check.
            n = int(getattr(shard, "ds_numel", 0))
            out.records.append(R.PlacementRecord(rank, f"{full}.ds_tensor", R.ZERO_PARAM_SHARD, "nvme", "nvme" if expected.param_nvme else dev, 0, n, why))
        else:
            out.records.append(tensor_record(rank, f"{full}.ds_tensor", R.ZERO_PARAM_SHARD, shard, dev, why))
    for name, b in module.named_buffers():
        if b is not None:
            out.records.append(tensor_record(rank, f"module.{name}", R.BUFFER, b, expected.compute, "buffers are used in forward: compute device"))

    zopt = engine.optimizer
    fp32 = list(getattr(zopt, "fp32_partitioned_groups_flat", []) or [])
    devs: dict[int, str] = {}
    labels: dict[int, str] = {}
    for i, t in enumerate(fp32):
        dev, why = expected.fp32_subgroup(i, len(fp32))
        devs[id(t)] = dev
        labels[id(t)] = str(i)
        out.records.append(tensor_record(rank, f"zero.fp32_partition[{i}]", R.ZERO_FP32_PARTITION, t, dev, why))
        if t.grad is not None:
            out.records.append(tensor_record(rank, f"zero.fp32_partition[{i}].grad", R.ZERO_GRAD_PARTITION, t.grad, dev, why))
    flat = getattr(zopt, "grad_partitions_flat_buffer", None)
    if flat is not None:
        out.records.append(tensor_record(rank, "zero.grad_partitions", R.ZERO_GRAD_PARTITION, flat, expected.optimizer, expected.optimizer_why))
    inner = _inner_optimizer(engine)
    if inner is not None:
        out.records += _state_records(inner, rank, devs, labels, expected)
    out.records += _backup_state_records(zopt, rank, devs, labels, expected)
    out.records += _attr_records(zopt, rank, expected)


def _backup_state_records(zopt: Any, rank: int, devs: dict[int, str], labels: dict[int, str], expected: ExpectedDevices) -> list[R.PlacementRecord]:
    """Partial offload (``ratio < 1``): the sub-groups kept on the accelerator are stepped by a plain
    torch AdamW, ``zopt.backup_optimizer`` (stage3.py:313-326, 1249-1258), whose Adam state lives
    beside their fp32 partitions. It is not the inner optimizer, so without this its state would go
    unchecked. Named by sub-group, like the inner optimizer's (``zero.backup_optimizer.state[2].exp_avg``)."""
    import torch

    backup = getattr(zopt, "backup_optimizer", None)
    if not isinstance(backup, torch.optim.Optimizer):
        return []
    why = (f"accelerator-side AdamW of partial offload (ratio={expected.offload_ratio:g}): its state follows "
           "its sub-group's fp32 partition")
    return optimizer_records(backup, rank, devs, expected.compute, why=why, prefix="zero.backup_optimizer", state_index=labels)


def _attr_records(zopt: Any, rank: int, expected: ExpectedDevices) -> list[R.PlacementRecord]:
    """The ZeRO optimizer's other tensors (staging buffers, overflow flags ...) by the shared table."""
    out: list[R.PlacementRecord] = []
    for attr, value in sorted(vars(zopt).items()):
        rule = rule_for(attr)
        if rule is None or not rule.live:
            continue
        entries = list(iter_tensors(value, ""))
        for i, (sub, t) in enumerate(entries):
            dev, why = expected_for(rule, expected, i, len(entries))
            out.append(tensor_record(rank, f"zero.{attr}{sub}", R.ZERO_STATE_BUFFER, t, dev, why))
    return out


def _partition_ranks(param: Any) -> int:
    # MiCS / hierarchical setups partition over a sub-group, not the whole world.
    import torch.distributed as dist

    group = getattr(param, "ds_process_group", None)
    try:
        return dist.get_world_size(group=group) if dist.is_initialized() else 1
    except Exception:  # pragma: no cover - a group this rank is not part of
        return 0


def _zero012(engine: Any, rank: int, expected: ExpectedDevices, stage: int, out: EngineRecords) -> None:
    module = engine.module
    out.records += module_records(module, rank, expected, prefix="module.")
    out.param_numels.update({f"module.{n}": p.numel() for n, p in module.named_parameters()})
    zopt = engine.optimizer
    inner = _inner_optimizer(engine)
    if stage == 0:
        if inner is not None:
            out.records += optimizer_records(inner, rank, {}, expected.compute)
        out.records += _attr_records(zopt, rank, expected)
        return
    for i, t in enumerate(getattr(zopt, "bit16_groups_flat", []) or []):
        out.records.append(tensor_record(rank, f"zero.bit16_flat[{i}]", R.ZERO_BIT16_FLAT, t, expected.compute, "bit16 weights are computed with: accelerator"))
    devs: dict[int, str] = {}
    labels: dict[int, str] = {}
    for i, t in enumerate(getattr(zopt, "single_partition_of_fp32_groups", []) or []):
        devs[id(t)] = expected.optimizer
        labels[id(t)] = str(i)
        out.records.append(tensor_record(rank, f"zero.fp32_partition[{i}]", R.ZERO_FP32_PARTITION, t, expected.optimizer, expected.optimizer_why))
        if t.grad is not None:
            out.records.append(tensor_record(rank, f"zero.fp32_partition[{i}].grad", R.ZERO_GRAD_PARTITION, t.grad, expected.optimizer, expected.optimizer_why))
    if inner is not None:
        out.records += _state_records(inner, rank, devs, labels, expected)
    out.records += _attr_records(zopt, rank, expected)


def _state_records(inner: Any, rank: int, devs: dict[int, str], labels: dict[int, str], expected: ExpectedDevices) -> list[R.PlacementRecord]:
    recs = optimizer_records(inner, rank, devs, expected.optimizer, why=expected.optimizer_why, prefix="zero.optimizer", state_index=labels)
    if _torch_step_rule(inner):
        return recs
    # DeepSpeed's own optimizers keep any tensor `step` beside the partition it counts for.
    fixed = []
    for r in recs:
        if r.kind == R.OPTIMIZER_STEP:
            label = r.name.split("[", 1)[1].split("]", 1)[0]
            dev = next((d for k, d in devs.items() if labels.get(k) == label), expected.optimizer)
            r = R.PlacementRecord(**{**r.to_dict(), "expected": dev, "why": "DeepSpeed optimizer: step beside its partition"})
        fixed.append(r)
    return fixed
