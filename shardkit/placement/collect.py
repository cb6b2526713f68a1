"""``collect_records``: this rank's placement records and RankReport, without a collective."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any, Mapping

from shardkit.config.loading import config_digest
from shardkit.core.errors import UsageError
from shardkit.placement.deepspeed import collect_deepspeed, engine_config
from shardkit.placement.expected import deepspeed_expected, torch_expected
from shardkit.placement.fsdp import collect_fsdp, fsdp_expected_for, fsdp_mesh_device, is_fsdp2
from shardkit.placement.records import EngineRecords, RankReport
from shardkit.placement.torch_state import collect_torch, scaler_records, scheduler_records
from shardkit.platform.device_rules import accelerator_device, module_compute_device
from shardkit.platform.dist import rank_env_problems
from shardkit.platform.versions import runtime_versions

if TYPE_CHECKING:
    import torch

def collect_records(
    engine: Any = None,
    *,
    model: "torch.nn.Module | None" = None,
    optimizer: Any = None,
    scaler: Any = None,
    lr_scheduler: Any = None,
    config: Mapping[str, Any] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    device: str | None = None,
) -> RankReport:
    """This rank's placement report: every tensor with its actual and expected device. No collective.

    Pass a DeepSpeed ``engine``, or a ``model`` (plain or FSDP2) with its ``optimizer`` (and
    ``scaler``/``lr_scheduler``). ``config`` is the DeepSpeed JSON dict or shardkit FSDP config the
    run uses; for an engine it defaults to the engine's own config.

    The compute device is what the run really uses: ``device`` when given, else the engine's
    ``device``, FSDP2's mesh device (from the module's own FSDP state), or for plain torch where the
    parameters are (``device_rules.module_compute_device``) - never just "an accelerator exists".
    """
    import torch.distributed as dist

    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if engine is not None:
        compute = device or _engine_device(engine) or str(accelerator_device())
        cfg = dict(config) if config is not None else engine_config(engine)
        collected = collect_deepspeed(engine, rank, deepspeed_expected(cfg, compute))
        collected.records += scaler_records(scaler, rank, compute)
        if lr_scheduler is not None and lr_scheduler is not getattr(engine, "lr_scheduler", None):
            # a client scheduler stepped outside the engine
            collected.records += scheduler_records(lr_scheduler, rank, getattr(engine.optimizer, "optimizer", None), compute)
    elif model is not None or optimizer is not None:
        cfg = dict(config) if config is not None else {}
        if model is not None and is_fsdp2(model):
            compute = device or fsdp_mesh_device(model) or str(accelerator_device())
            collected = collect_fsdp(model, optimizer, scaler, lr_scheduler, rank, fsdp_expected_for(model, cfg, compute))
        else:
            compute = device or module_compute_device(model, optimizer)
            exp = torch_expected(compute)
            collected = EngineRecords(engine="torch", records=collect_torch(model, optimizer, scaler, lr_scheduler, rank, exp))
            if model is not None:
                collected.param_numels = {n: p.numel() for n, p in model.named_parameters()}
    else:
        raise UsageError("preflight needs something to check: pass a DeepSpeed engine, or model= (and optimizer=)")

    return RankReport(
        rank=rank,
        world_size=world_size,
        host=socket.gethostname(),
        compute_device=compute,
        engine=collected.engine,
        versions=runtime_versions(),
        config_digest=config_digest(cfg) or "",
        records=collected.records,
        param_numels=collected.param_numels,
        zero3_partitions=collected.zero3_partitions,
        zero3_partition_ranks=collected.zero3_partition_ranks,
        unmanaged=collected.unmanaged,
        node_rank=int(os.environ["GROUP_RANK"]) if os.environ.get("GROUP_RANK", "").isdigit() else -1,
        problems=_env_problems(compute) + (model_problems(model) if engine is None and model is not None else []),
    )


def _env_problems(compute: str) -> list[list[str]]:
    """This rank's launcher variables against the process group and, on an accelerator run, the
    devices it sees (a CPU run picks no device by LOCAL_RANK, so an unset one is harmless there)."""
    import torch
    import torch.distributed as dist

    group = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else None
    on_accelerator = not compute.startswith("cpu") and torch.accelerator.is_available()
    found = rank_env_problems(os.environ, group=group, accelerators=torch.accelerator.device_count() if on_accelerator else 0)
    return [["environment", *_split_fix(problem)] for problem in found]


def _split_fix(problem: str) -> list[str]:
    message, _, fix = problem.partition(" Fix: ")
    return [message, fix]


def model_problems(model: Any) -> list[list[str]]:
    """A model the preflight cannot judge a training run of: no parameters at all (nothing to check,
    nothing to train), or every parameter frozen (the optimizer steps nothing; DeepSpeed ZeRO-3
    refuses such a model at initialize with a bare AssertionError)."""
    params = list(model.parameters())
    kind = type(model).__name__
    if not params:
        return [["model", f"the {kind} passed to the preflight has no parameters: there is nothing to place, check "
                 "or train (a wrapper whose real model is an attribute, or a model never built).",
                 "pass the module that holds the trained parameters (model=, or the DeepSpeed engine)"]]
    if not any(p.requires_grad for p in params):
        total = sum(int(getattr(p, "ds_numel", p.numel())) for p in params)  # ZeRO-3 leaves 0-element placeholders
        return [["model", f"every parameter of the {kind} is frozen ({len(params)} tensors, {total:,} elements with "
                 "requires_grad=False): the optimizer steps nothing, so this run would train nothing (DeepSpeed "
                 "ZeRO-3 refuses such a model at deepspeed.initialize with a bare AssertionError).",
                 "unfreeze what you mean to train (p.requires_grad_(True)), or add the trainable adapters (peft's "
                 "get_peft_model) before building the optimizer; an evaluation-only run needs no preflight"]]
    return []


def _engine_device(engine: Any) -> str | None:
    """The device DeepSpeed computes on (``engine.device``: ``cuda:<local rank>``, ``cpu`` on its CPU accelerator)."""
    import torch

    dev = getattr(engine, "device", None)
    return str(dev) if isinstance(dev, torch.device) else None
