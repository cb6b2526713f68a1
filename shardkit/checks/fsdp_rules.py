"""Rules for shardkit's FSDP2 config (top-level "fsdp" key, applied by shardkit.engines.fsdp.apply_fsdp)."""

from __future__ import annotations

from typing import Any, Iterable

from pydantic import ValidationError

from shardkit.config.fsdp import FSDP1_ONLY_OPTIONS, FSDPConfig, FSDPOptions, validation_problems
from shardkit.core.findings import Finding, Severity


def fsdp_findings(
    cfg: dict[str, Any], *, accelerator: bool | None, model_classes: Iterable[str] | None = None
) -> list[Finding]:
    block = cfg.get("fsdp")
    if not isinstance(block, dict):
        return [
            Finding(
                Severity.ERROR,
                "fsdp",
                block,
                f"the fsdp section must be a mapping of options, got {type(block).__name__}",
                "generate one with `shardkit config fsdp -o fsdp.json`",
                "fsdp-schema",
            )
        ]
    out: list[Finding] = []
    for key in block:
        if key in FSDP1_ONLY_OPTIONS:
            out.append(
                Finding(
                    Severity.ERROR,
                    f"fsdp.{key}",
                    block[key],
                    f"{key} is an FSDP1 (FullyShardedDataParallel) option that FSDP2's fully_shard does not have: "
                    f"{FSDP1_ONLY_OPTIONS[key]}",
                    f"remove fsdp.{key}",
                    "fsdp1-option",
                )
            )
    rest = {**cfg, "fsdp": {k: v for k, v in block.items() if k not in FSDP1_ONLY_OPTIONS}}
    try:
        parsed: FSDPConfig | None = FSDPConfig.model_validate(rest)
    except ValidationError as exc:
        parsed = None
        for key, value, msg in validation_problems(exc):
            fix = "remove it" if msg == "unknown key" else "use a value of the stated type/choice"
            if msg == "unknown key" and key.startswith("fsdp."):
                fix += f" (fsdp options: {', '.join(FSDPOptions.model_fields)})"
            out.append(Finding(Severity.ERROR, key, value, f"invalid FSDP config: {msg}", fix, "fsdp-schema"))
    if parsed is None:
        return out
    opts = parsed.fsdp
    if opts.cpu_offload and opts.pin_memory and accelerator is False:
        out.append(
            Finding(
                Severity.ERROR,
                "fsdp.pin_memory",
                True,
                "CPU offload with pinned memory on a run without an accelerator: pinning needs one, so "
                "CPUOffloadPolicy(pin_memory=True) fails (torch's default is True, which is why shardkit's is false)",
                'set "fsdp.pin_memory": false',
                "fsdp-pin-no-accelerator",
            )
        )
    if opts.pin_memory and not opts.cpu_offload:
        out.append(
            Finding(
                Severity.WARNING,
                "fsdp.pin_memory",
                True,
                "pin_memory only matters with cpu_offload, which is off: it has no effect",
                'remove it or set "fsdp.cpu_offload": true',
                "fsdp-pin-without-offload",
            )
        )
    if not opts.wrap:
        out.append(
            Finding(
                Severity.WARNING,
                "fsdp.wrap",
                [],
                "no wrap classes: only the root is sharded, so the whole model is all-gathered at once and peak "
                "memory is that of the unsharded model",
                'list the transformer block class, e.g. "wrap": ["LlamaDecoderLayer"]',
                "fsdp-wrap-empty",
            )
        )
    if model_classes is not None:
        present = set(model_classes)
        missing = [w for w in opts.wrap if w not in present]
        if missing:
            out.append(
                Finding(
                    Severity.ERROR,
                    "fsdp.wrap",
                    opts.wrap,
                    f"{missing} not found in the model; apply_fsdp refuses it. Classes in the model: "
                    f"{', '.join(sorted(present))}",
                    "list the model's transformer block class (e.g. LlamaDecoderLayer)",
                    "fsdp-wrap-missing",
                )
            )
    if opts.mixed_precision == "fp16":
        out.append(
            Finding(
                Severity.WARNING,
                "fsdp.mixed_precision",
                "fp16",
                "fp16 compute needs loss scaling (torch.amp.GradScaler) or small gradients underflow to zero; "
                "bf16 has fp32's range and needs none",
                'use "bf16" where the hardware supports it, or scale the loss with torch.amp.GradScaler',
                "fsdp-fp16-scaler",
            )
        )
    return out
