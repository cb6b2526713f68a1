"""The "auto" rule. DeepSpeed's config base (DeepSpeedConfigModel.__init__) silently drops every key
whose value is "auto" and uses its default instead; only the HF Trainer / Accelerate replace them
with real values first. So "auto" in a config that goes straight to deepspeed.initialize means
"some default you did not choose" (and at the top level, e.g. train_batch_size, a crash).
"""

from __future__ import annotations

from typing import Any

from shardkit.config.paths import auto_paths
from shardkit.core.findings import Finding, Severity


def auto_findings(cfg: dict[str, Any], *, expect_hf_auto: bool) -> list[Finding]:
    """One finding for all "auto" values: they share one cause (a file written for the HF
    Trainer/Accelerate) and one fix, so twelve near-identical rows would only hide the rest."""
    if expect_hf_auto:
        return []
    paths = auto_paths(cfg)
    if not paths:
        return []
    key = paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} more)"
    return [
        Finding(
            Severity.ERROR,
            key,
            paths,
            f'"auto" in {len(paths)} key(s): {", ".join(paths)}. Only the HF Trainer / Accelerate fill "auto" in; '
            "DeepSpeed itself drops each such key silently and uses its default (DeepSpeedConfigModel.__init__), "
            "or fails for the top-level batch keys",
            "if this file is handed to the HF Trainer/Accelerate, check it with `shardkit check --hf-auto`; "
            "for deepspeed.initialize set concrete values (`shardkit config ...` without --hf-auto writes them)",
            "auto-value",
        )
    ]
