"""What parsing alone hides: keys written twice (the last wins silently) and NaN/Infinity numbers
(not JSON, but Python's json module accepts the literals and DeepSpeed never checks them)."""

from __future__ import annotations

import math
from typing import Any, Iterable

from shardkit.config.paths import walk
from shardkit.core.findings import Finding, Severity


def duplicate_key_findings(duplicates: Iterable[tuple[str, Any, Any]]) -> list[Finding]:
    """One error per repeated key (path, key, the value that was kept), from loading.read_config."""
    return [
        Finding(
            Severity.ERROR,
            path,
            kept,
            f"key {key!r} is written more than once in the same mapping: the JSON/YAML parser (and so DeepSpeed, "
            f"Accelerate and the HF Trainer) keeps only the last value ({kept!r}) and drops the earlier one(s) "
            "without a word",
            f"keep a single {key!r} with the value you mean",
            "duplicate-key",
        )
        for path, key, kept in duplicates
    ]


def non_finite_findings(cfg: Any) -> list[Finding]:
    """Every NaN / +-Infinity number, wherever it is."""
    out = []
    for path, value in walk(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            text = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
            out.append(
                Finding(
                    Severity.ERROR,
                    path,
                    text,
                    f"{text} is not a number any setting can use: Python's json module accepts the NaN/Infinity "
                    "literals (they are not valid JSON) and DeepSpeed does not reject them; a NaN gradient_clipping "
                    "silently disables clipping (NaN > 0 is false), a NaN or infinite lr turns the weights into "
                    "NaN at the first step",
                    "write a finite number",
                    "non-finite-number",
                )
            )
    return out


def syntax_findings(syntax: str) -> list[Finding]:
    """A config that only hjson reads: fine for DeepSpeed, fatal where transformers or accelerate load it."""
    if syntax != "hjson":
        return []
    return [Finding(
        Severity.WARNING, "<syntax>", "hjson",
        "not JSON (comments, trailing commas or unquoted keys): DeepSpeed reads it (its loader is hjson), but "
        "transformers' and accelerate's HfDeepSpeedConfig read the file with json.load and fail on it "
        "(`--deepspeed ds.json` in the HF Trainer, `deepspeed_config_file` in an Accelerate config)",
        "remove the comments and trailing commas, and quote every key", "config-syntax-hjson")]
