"""The Trainer's own config, checked once the Trainer has filled its ``"auto"`` values: the DeepSpeed
config it hands to ``deepspeed.initialize`` (``HfTrainerDeepSpeedConfig``, kept by Accelerate's
plugin) judged by the `shardkit check` rules and this machine's environment rows, an ``"auto"`` the
Trainer never fills, and FSDP asked for in ``TrainingArguments`` that Accelerate did not turn on.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from shardkit.checks import check_config
from shardkit.config.paths import auto_paths
from shardkit.core.findings import Finding, Report, Severity
from shardkit.platform.environment.facts import probe_environment, run_has_accelerator

_SUBJECT = 'HF Trainer DeepSpeed config ("auto" values filled by the Trainer)'


def trainer_config_report(trainer: Any, *, final: bool, facts: Any = None) -> Report:
    """`shardkit check` findings (environment rows included) on the config the Trainer really
    uses, read after it filled the "auto" values, plus FSDP asked for but not enabled."""
    fsdp = _fsdp_not_enabled(trainer)
    if not getattr(trainer, "is_deepspeed_enabled", False):
        report = Report(subject="HF Trainer FSDP settings")
        report.extend(fsdp)
        return report
    world_size = int(getattr(trainer.args, "world_size", 0) or 0) or None
    report = filled_config_report(filled_deepspeed_config(trainer), world_size=world_size, final=final, facts=facts)
    report.extend(fsdp)
    return report


def filled_config_report(cfg: dict[str, Any], *, world_size: int | None, final: bool, facts: Any = None) -> Report:
    """The checks on a DeepSpeed config the Trainer filled (``filled_deepspeed_config``).

    ``final``: the Trainer has also filled what ``deepspeed_init`` fills (bucket sizes, scheduler
    steps), so an "auto" still there is one it never fills and DeepSpeed drops silently. ``facts``:
    shardkit.platform.environment.facts.EnvironmentFacts (default: this machine, with this process's environment)."""
    facts = facts or probe_environment()
    report = check_config(
        cfg, source=_SUBJECT, world_size=world_size, accelerator=run_has_accelerator(facts=facts),
        environment=facts, expect_hf_auto=True,
    )
    if final:
        report.extend(_unfilled_auto(cfg))
    return report


def filled_deepspeed_config(trainer: Any) -> dict[str, Any]:
    """A copy of the DeepSpeed config the Trainer passes to deepspeed.initialize (Accelerate's
    plugin holds the HfTrainerDeepSpeedConfig's dict, filled in place)."""
    plugin = trainer.accelerator.state.deepspeed_plugin
    cfg = copy.deepcopy(dict(plugin.deepspeed_config))
    # Accelerate's DeepSpeedPlugin always overwrites steps_per_print with float("inf") to silence
    # DeepSpeed's own logging (accelerate/utils/dataclasses.py): not the user's value, and not a
    # NaN/Infinity typo the non-finite rule is there to catch.
    if isinstance(cfg.get("steps_per_print"), float) and math.isinf(cfg["steps_per_print"]):
        del cfg["steps_per_print"]
    return cfg


def _unfilled_auto(cfg: dict[str, Any]) -> list[Finding]:
    paths = auto_paths(cfg)
    if not paths:
        return []
    return [
        Finding(
            Severity.ERROR,
            paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} more)",
            paths,
            f'"auto" left in {len(paths)} key(s) after the Trainer filled its values: {", ".join(paths)}. The Trainer '
            "fills only the keys it knows (HfTrainerDeepSpeedConfig.trainer_config_process/finalize); DeepSpeed drops "
            "every other \"auto\" silently and uses its default (DeepSpeedConfigModel.__init__)",
            "set a concrete value for these keys (`shardkit config zero3 --hf-auto` writes \"auto\" only where the Trainer fills it)",
            "hf-auto-unfilled",
        )
    ]


def _fsdp_not_enabled(trainer: Any) -> list[Finding]:
    """FSDP asked for in TrainingArguments, but the Trainer runs without it.

    Accelerate 1.15's AcceleratorState turns an FSDP plugin on only for accelerator process
    groups (MULTI_GPU, MULTI_XPU, MULTI_NPU, ...); on CPU ranks (MULTI_CPU) it keeps the plugin
    off and the Trainer wraps the model in DDP, silently: every rank holds the whole model."""
    args = trainer.args
    wanted = bool(getattr(args, "fsdp", None)) or getattr(args, "fsdp_plugin_args", None) is not None
    if not wanted or getattr(trainer, "is_fsdp_enabled", False):
        return []
    dist_type = getattr(getattr(trainer.accelerator, "state", None), "distributed_type", None)
    seen = getattr(dist_type, "value", dist_type)
    return [
        Finding(
            Severity.ERROR,
            "TrainingArguments.fsdp",
            getattr(args, "fsdp", None),
            f"FSDP was asked for, but Accelerate did not enable it (distributed_type {seen}): the Trainer trains "
            "the unsharded model (DDP on several ranks), so memory and checkpoints are not what the FSDP config "
            "says. Accelerate enables FSDP only on accelerator ranks (GPU/XPU/NPU/HPU ...), never on CPU ranks",
            "run on GPUs (or another accelerator); to test FSDP2 on CPU ranks use shardkit's own FSDP2 path "
            "(`shardkit smoke --engine fsdp2`, shardkit.apply_fsdp), which runs on gloo",
            "hf-fsdp-not-enabled",
        )
    ]
