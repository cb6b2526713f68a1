"""Rules for an Accelerate config file (what `accelerate config` and `shardkit config fsdp --format
accelerate` write): its FSDP section, and its DeepSpeed section, which is turned into the DeepSpeed
config Accelerate would build and checked with the same rules as a DeepSpeed JSON file."""

from __future__ import annotations

from typing import Any, Iterable

from shardkit.config.fsdp import FSDP1_ONLY_OPTIONS
from shardkit.core.findings import Finding, Severity


def is_accelerate_config(cfg: dict[str, Any]) -> bool:
    return (
        "fsdp_config" in cfg
        or ("distributed_type" in cfg and "compute_environment" in cfg)
        or ("distributed_type" in cfg and "deepspeed_config" in cfg)
    )


def accelerate_findings(cfg: dict[str, Any], *, model_classes: Iterable[str] | None = None) -> list[Finding]:
    """Findings about the FSDP section (the DeepSpeed section: accelerate_deepspeed.deepspeed_findings)."""
    section = cfg.get("fsdp_config")
    if section is None:
        return []
    if not isinstance(section, dict):
        return [
            Finding(Severity.ERROR, "fsdp_config", section, "fsdp_config must be a mapping", "regenerate it", "accelerate-schema")
        ]
    out: list[Finding] = []
    version = section.get("fsdp_version", 1)
    if version != 2:
        out.append(
            Finding(
                Severity.WARNING,
                "fsdp_config.fsdp_version",
                version,
                "this Accelerate config uses FSDP1 (FullyShardedDataParallel, the default when fsdp_version is "
                "absent); shardkit's FSDP checks and DCP resharding target FSDP2 (fully_shard)",
                'set "fsdp_version: 2" (and drop the FSDP1-only options), e.g. `shardkit config fsdp --format accelerate`',
                "accelerate-fsdp1",
            )
        )
        return out
    for key, value in section.items():
        name = key[len("fsdp_") :] if key.startswith("fsdp_") else key
        if name in ("auto_wrap_policy", "transformer_layer_cls_to_wrap", "cpu_ram_efficient_loading",
                    "activation_checkpointing", "state_dict_type", "offload_params"):
            continue  # Accelerate maps these onto FSDP2 itself
        if name in FSDP1_ONLY_OPTIONS:
            out.append(
                Finding(
                    Severity.ERROR,
                    f"fsdp_config.{key}",
                    value,
                    f"{key} is an FSDP1 option; with fsdp_version 2 it has no effect or is refused: "
                    f"{FSDP1_ONLY_OPTIONS[name]}",
                    f"remove fsdp_config.{key}",
                    "fsdp1-option",
                )
            )
    wrap = section.get("fsdp_transformer_layer_cls_to_wrap")
    if model_classes is not None and isinstance(wrap, str) and wrap:
        present = set(model_classes)
        missing = [w.strip() for w in wrap.split(",") if w.strip() and w.strip() not in present]
        if missing:
            out.append(
                Finding(
                    Severity.ERROR,
                    "fsdp_config.fsdp_transformer_layer_cls_to_wrap",
                    wrap,
                    f"{missing} not found in the model. Classes in the model: {', '.join(sorted(present))}",
                    "list the model's transformer block class (e.g. LlamaDecoderLayer)",
                    "fsdp-wrap-missing",
                )
            )
    return out
