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


def syntax_findings(syntax: str, not_json: str = "", *, hf_trainer: bool = False) -> list[Finding]:
    """A config that only hjson reads (``not_json``: what ``json.load`` refuses first, and where).

    DeepSpeed reads its config file with hjson (``runtime/config.py``: ``hjson.load``), which takes a
    UTF-8 BOM, comments, trailing commas and unquoted keys: for ``deepspeed.initialize`` that is a warning.
    The HF Trainer (transformers ``HfDeepSpeedConfig``, from accelerate) and Accelerate open the file as
    ``utf-8`` and ``json.load`` it, which refuses every one of them: where the file goes there
    (``hf_trainer``: ``check --hf-auto``, `shardkit launch` of ``--deepspeed PATH``), an error."""
    if syntax != "hjson":
        return []
    found = not_json or "comments, trailing commas or unquoted keys"
    bom = "byte order mark" in found
    fix = ("save the file as UTF-8 without a BOM (in an editor: encoding 'UTF-8', not 'UTF-8 with BOM'; or "
           "`sed -i '1s/^\\xEF\\xBB\\xBF//' FILE`)" if bom else "")
    rest = found.split(", then ", 1)[1] if bom and ", then " in found else ("" if bom else found)
    if rest:
        what, _, where = rest.rpartition(" at ")
        action = ("remove the comment" if "comment" in what else "remove the comma" if "trailing comma" in what else
                  "put the key in double quotes" if "key" in what else "fix the JSON")
        fix += (" and " if fix else "") + f"{action} at {where} (json.load takes no comments, trailing commas or " \
               "unquoted keys: check the rest of the file too)"
    readers = ("the HF Trainer and Accelerate read it with json.load (transformers/accelerate HfDeepSpeedConfig: "
               "`--deepspeed ds.json`, `deepspeed_config_file` in an Accelerate config)")
    if hf_trainer:
        return [Finding(
            Severity.ERROR, "<syntax>", "BOM" if bom else "not JSON",
            f"not JSON: {found}. {readers[0].upper() + readers[1:]}, which refuses it: the run stops at start "
            "with a JSONDecodeError (DeepSpeed's own loader, hjson, would accept it)",
            fix, "config-syntax-hjson")]
    return [Finding(
        Severity.WARNING, "<syntax>", "BOM" if bom else "hjson",
        f"not JSON: {found}. DeepSpeed reads it (its loader is hjson), but {readers} and fail on it",
        fix, "config-syntax-hjson")]
