"""FSDP2 engine glue: apply shardkit's FSDP2 config to a model with ``fully_shard``, build its
optimizer, clip its gradients.

torch is imported only inside functions, so importing this module stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardkit.config.fsdp import FSDPConfig, fsdp_config_from_dict
from shardkit.core.errors import ConfigError
from shardkit.platform import versions
from shardkit.platform.device_rules import accelerator_device
from shardkit.platform.versions import (
    cpu_stream_events_supported,
    fsdp2_cpu_reshard_supported,
    fsdp2_root_reshard_none_supported,
)

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh


def _dtype(name: str) -> "torch.dtype | None":
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}[name]


def mixed_precision_policy(cfg: FSDPConfig) -> Any:
    """FSDP2 MixedPrecisionPolicy: compute in the chosen dtype, reduce gradients in fp32."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = _dtype(cfg.fsdp.mixed_precision)
    # Reducing bf16/fp16 gradients across many ranks loses precision; torchtitan defaults to fp32 too.
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)


def offload_policy(cfg: FSDPConfig) -> Any:
    """CPUOffloadPolicy with pin_memory taken from the config (torch's default True needs an accelerator)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not cfg.fsdp.cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=cfg.fsdp.pin_memory)


def _has_accelerator() -> bool:
    import torch

    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return bool(torch.cuda.is_available())


def _no_cpu_event(stream: object, event: object = None) -> None:
    """CPU work runs in program order: there is no event to record or wait for."""


def backport_cpu_stream_events() -> None:
    """On torch < 2.7, give ``torch.cpu.Stream`` the no-op ``record_event``/``wait_event`` that 2.7
    added (pytorch PR #145935) and FSDP2's collectives call on CPU ranks. The methods 2.7 ships are
    these same no-ops (record_event returns None, and FSDP2 treats a None event as nothing to wait
    for), so a 2.6 run takes the code path a 2.7 run does. A method torch already has is kept."""
    if cpu_stream_events_supported():
        return
    import torch.cpu

    for name in ("record_event", "wait_event"):
        if not hasattr(torch.cpu.Stream, name):
            setattr(torch.cpu.Stream, name, _no_cpu_event)


def apply_fsdp(model: "torch.nn.Module", cfg: FSDPConfig | dict[str, Any], mesh: "DeviceMesh | None" = None) -> "torch.nn.Module":
    """Shard ``model`` in place: fully_shard on every module whose class is in ``cfg.fsdp.wrap``
    (bottom-up), then on the root. Returns the same module (now an FSDPModule).

    Needs an initialized process group (and ``mesh`` for HSDP / a sub-group); without ``mesh``
    fully_shard builds a 1-D mesh over the default group on the current accelerator, or CPU.
    """
    from torch.distributed.fsdp import fully_shard

    if isinstance(cfg, dict):
        cfg = fsdp_config_from_dict(cfg)
    opts = cfg.fsdp
    if opts.cpu_offload and opts.pin_memory and not _has_accelerator():
        raise ConfigError(
            "fsdp.pin_memory=true with fsdp.cpu_offload=true, but this process has no accelerator: pinned "
            "host memory needs one (CPUOffloadPolicy would fail). Set fsdp.pin_memory to false."
        )
    # without a mesh fully_shard shards on the current accelerator, or on CPU when there is none
    cpu_ranks = mesh.device_type == "cpu" if mesh is not None else not _has_accelerator()
    if opts.reshard_after_forward and cpu_ranks and not fsdp2_cpu_reshard_supported():
        raise ConfigError(
            f"fsdp.reshard_after_forward=true on CPU ranks with torch {versions.package_version('torch')}: torch 2.6's FSDP2 "
            "re-gathers resharded parameters for backward with a copy that, on CPU, bumps the autograd version of "
            "the tensors forward saved (pytorch issue #132014), so the first backward would fail with 'modified by an "
            "inplace operation'. Set fsdp.reshard_after_forward to false for CPU runs on this torch, or upgrade torch "
            "(2.13 is verified, docs/versions.md)."
        )
    present = {type(m).__name__ for m in model.modules()}
    missing = [name for name in opts.wrap if name not in present]
    if missing:
        raise ConfigError(
            f"fsdp.wrap={opts.wrap!r}: {missing} not found in {type(model).__name__}. Classes in the model: "
            f"{', '.join(sorted(present))}. Put the transformer block class there (e.g. LlamaDecoderLayer)."
        )
    backport_cpu_stream_events()
    kwargs: dict[str, Any] = {"mp_policy": mixed_precision_policy(cfg), "offload_policy": offload_policy(cfg)}
    if mesh is not None:
        kwargs["mesh"] = mesh
    wrap = set(opts.wrap)
    # Bottom-up: fully_shard groups the parameters not already claimed by a sharded submodule, so
    # children must be sharded before their parents (reversed pre-order visits children first).
    for module in reversed(list(model.modules())):
        if module is not model and type(module).__name__ in wrap:
            fully_shard(module, reshard_after_forward=opts.reshard_after_forward, **kwargs)
    # Root: None lets torch keep it unsharded after forward (backward needs it first) when
    # resharding is on (torch >= 2.7; 2.6 takes only a bool, and True is its default); False keeps
    # SHARD_GRAD_OP semantics for everything.
    root_reshard: bool | None = (None if fsdp2_root_reshard_none_supported() else True) if opts.reshard_after_forward else False
    fully_shard(model, reshard_after_forward=root_reshard, **kwargs)
    return model


def build_optimizer(model: "torch.nn.Module", cfg: FSDPConfig | dict[str, Any]) -> "torch.optim.Optimizer":
    """AdamW over the (sharded) parameters with the config's lr, betas and weight decay.

    Build it after apply_fsdp so it holds the DTensor shards, not the original full parameters.
    """
    import torch

    if isinstance(cfg, dict):
        cfg = fsdp_config_from_dict(cfg)
    t = cfg.train
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=t.lr,
        betas=t.betas,
        weight_decay=t.weight_decay,
    )


def clip_grad_norm(model: "torch.nn.Module", cfg: FSDPConfig) -> float | None:
    """Clip gradients to ``train.clip`` (global norm across ranks); returns the norm, or None when off."""
    import torch

    if not cfg.train.clip:
        return None
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip)
    full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return float(full)


def initialize(
    model: "torch.nn.Module", cfg: FSDPConfig | dict[str, Any], mesh: "DeviceMesh | None" = None
) -> "tuple[torch.nn.Module, torch.optim.Optimizer]":
    """The FSDP2 counterpart of ``deepspeed.initialize``: shard ``model`` in place (apply_fsdp), then
    build its AdamW over the shards (build_optimizer). Returns (model, optimizer)."""
    if isinstance(cfg, dict):
        cfg = fsdp_config_from_dict(cfg)
    apply_fsdp(model, cfg, mesh)
    return model, build_optimizer(model, cfg)


def train_step(
    model: "torch.nn.Module", optimizer: "torch.optim.Optimizer", input_ids: "torch.Tensor", cfg: FSDPConfig | None = None
) -> float:
    """One causal-LM step on an FSDP2 model: forward on this rank's accelerator, backward, clip to
    ``cfg.train.clip`` (no clipping without ``cfg``), optimizer step, gradients freed; returns this
    rank's loss as a float. The one FSDP2 step the smoke, preflight runs and tests take."""
    input_ids = input_ids.to(accelerator_device())
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    if cfg is not None:
        clip_grad_norm(model, cfg)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach().float().item())
