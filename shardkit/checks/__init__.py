"""Static checks of DeepSpeed and shardkit-FSDP2 configs (`shardkit check`).

One module per concern: ``schema`` (DeepSpeed's own pydantic classes), ``auto`` ("auto" values),
``offload`` and ``offload_ratio`` (partial optimizer offload), ``training`` (precision, batch,
optimizer, saving), ``fsdp_rules``, ``accelerate_rules`` and ``accelerate_deepspeed`` (Accelerate
configs), ``environment_rule`` (what this machine does to a config, from
``shardkit.platform.environment``); ``runner`` ties them into a Report. Importing this package imports
neither torch nor deepspeed.
"""

from __future__ import annotations

from shardkit.checks.runner import check_config, check_file

__all__ = ["check_config", "check_file"]
