"""shardkit: make DeepSpeed ZeRO and PyTorch FSDP training start right and resume right.

The public API is loaded lazily so ``shardkit check config.json`` never imports torch or deepspeed.
"""

from __future__ import annotations

import importlib
from typing import Any

from shardkit._version import __version__

# public name -> module that defines it
_LAZY: dict[str, str] = {
    "ShardkitError": "shardkit.errors",
    "ConfigError": "shardkit.errors",
    "PreflightError": "shardkit.errors",
    "CheckpointError": "shardkit.errors",
    "UsageError": "shardkit.errors",
    "DistributedError": "shardkit.errors",
    "load_config": "shardkit.config.loading",
    "config_digest": "shardkit.config.loading",
    "check_config": "shardkit.checks",
    "check_file": "shardkit.checks",
    "FSDPConfig": "shardkit.config.fsdp",
    "fsdp_config_from_dict": "shardkit.config.fsdp",
    "apply_fsdp": "shardkit.engines.fsdp",
    "known_bad_findings": "shardkit.versions",
    "installed_versions": "shardkit.versions",
    "load_zero3_checkpoint": "shardkit.checkpoint.zero3.resume",
    "restore_cpu_adam_kernel_state": "shardkit.checkpoint.zero3.cpu_adam_kernel",
    "open_zero3_checkpoint": "shardkit.checkpoint.zero3.reader",
    "consolidate_zero3": "shardkit.checkpoint.zero3.consolidate",
    "reshard_zero3": "shardkit.checkpoint.zero3.reshard",
    "safe_torch_load": "shardkit.checkpoint.safe_load",
    "preflight": "shardkit.placement.preflight",
    "record_snapshot": "shardkit.placement.snapshot",
    "judge_snapshot": "shardkit.placement.observed",
    "collect_records": "shardkit.placement",
    "PlacementReport": "shardkit.placement.report",
    "verify_checkpoint": "shardkit.checkpoint.verify",
    "check_resumable": "shardkit.checkpoint.verify",
    "check_resumable_distributed": "shardkit.checkpoint.verify",
    "load_dcp_state": "shardkit.checkpoint.dcp.safe_load",
    "save_deepspeed_checkpoint": "shardkit.checkpoint.zero3.save",
    "replace_optimizer_state": "shardkit.resume.replace",
    "plan_optimizer_moves": "shardkit.resume.replace",
    "register_extra_state": "shardkit.resume.replace",
    "StateSlot": "shardkit.resume.replace",
    "Move": "shardkit.resume.replace",
    "resume_training": "shardkit.checkpoint.torch_training",
    "save_training": "shardkit.checkpoint.torch_training",
    "save_fsdp_checkpoint": "shardkit.checkpoint.dcp.checkpoint",
    "load_fsdp_checkpoint": "shardkit.checkpoint.dcp.checkpoint",
    "export_safetensors": "shardkit.checkpoint.dcp.checkpoint",
    "run_smoke": "shardkit.smoke",
    "SmokeOptions": "shardkit.smoke",
    "build_launch": "shardkit.launch",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
