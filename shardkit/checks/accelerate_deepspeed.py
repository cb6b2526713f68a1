"""An Accelerate config with ``distributed_type: DEEPSPEED``, checked as the DeepSpeed config it
becomes.

Accelerate (1.15.0 source: ``commands/launch.py``, ``utils/launch.py`` prepare_deepspeed_cmd_env,
``utils/dataclasses.py`` DeepSpeedPlugin) turns the YAML's ``deepspeed_config`` section into
environment variables and the ranks' DeepSpeedPlugin builds a DeepSpeed config from them:
``zero_stage`` (default 2) -> zero_optimization.stage, ``offload_{optimizer,param}_device`` ->
zero_optimization.offload_*.device, ``offload_*_nvme_path`` -> .nvme_path (nvme only),
``zero3_save_16bit_model`` (default false) -> stage3_gather_16bit_weights_on_model_save,
``gradient_accumulation_steps`` / ``gradient_clipping`` (default "auto"), batch sizes "auto",
``mixed_precision`` -> bf16/fp16. With ``deepspeed_config_file`` that JSON is used instead (opened
by the ranks relative to the directory `accelerate launch` runs in) and the keys above are refused.
Either way the result is checked with the DeepSpeed rules, "auto" allowed (Accelerate fills it).
shardkit does not import accelerate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from shardkit.config.loading import read_config
from shardkit.config.parsing import duplicate_key_findings, non_finite_findings, syntax_findings
from shardkit.core.errors import ConfigError
from shardkit.core.findings import Finding, Severity

# Accelerate key (inside deepspeed_config) -> the DeepSpeed key path it sets (DeepSpeedPlugin's
# plugin_to_config_mapping).
TO_DEEPSPEED: dict[str, str] = {
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
}
_FROM_DEEPSPEED = {ds: f"deepspeed_config.{acc}" for acc, ds in TO_DEEPSPEED.items()}
_FROM_DEEPSPEED.update({"bf16.enabled": "mixed_precision", "fp16.enabled": "mixed_precision"})

DeepSpeedChecker = Callable[[dict[str, Any]], list[Finding]]


def is_deepspeed(cfg: dict[str, Any]) -> bool:
    return cfg.get("distributed_type") == "DEEPSPEED" or "deepspeed_config" in cfg


def deepspeed_findings(cfg: dict[str, Any], *, config_dir: Path | None, check: DeepSpeedChecker) -> list[Finding]:
    """Findings about the DeepSpeed side of an Accelerate config; ``check`` runs the DeepSpeed rules
    on a DeepSpeed config dict ("auto" allowed)."""
    section = cfg.get("deepspeed_config", {})
    if not isinstance(section, dict):
        return [
            Finding(Severity.ERROR, "deepspeed_config", section, "deepspeed_config must be a mapping of settings",
                    "regenerate it with `accelerate config`", "accelerate-schema")
        ]
    if "deepspeed_config_file" in section:
        out, ds = _file_findings(section, config_dir, check)
        if cfg.get("mixed_precision") is not None:
            out.insert(0, config_file_precision_clash(cfg["mixed_precision"], ds))
        return out
    out = _init_flag(section)
    out += [_inline(f) for f in check(build_deepspeed_config(cfg))]
    for kind in ("optimizer", "param"):
        path = section.get(f"offload_{kind}_nvme_path")
        if section.get(f"offload_{kind}_device") == "nvme" and isinstance(path, str) and path.strip():
            out.append(
                Finding(
                    Severity.WARNING,
                    f"deepspeed_config.offload_{kind}_nvme_path",
                    path,
                    "`accelerate launch` (1.15.0) does not pass offload_*_nvme_path on to the ranks: "
                    "prepare_deepspeed_cmd_env sets no ACCELERATE_DEEPSPEED_OFFLOAD_*_NVME_PATH, so DeepSpeedPlugin "
                    'falls back to the string "none" and DeepSpeed swaps into a directory named none',
                    "put the offload settings (with nvme_path) in a DeepSpeed JSON and name it in "
                    "deepspeed_config.deepspeed_config_file",
                    "accelerate-nvme-path-dropped",
                )
            )
    return out


def build_deepspeed_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config DeepSpeedPlugin builds from an inline ``deepspeed_config`` section."""
    section = cfg.get("deepspeed_config") or {}
    stage = section.get("zero_stage", 2)
    zero: dict[str, Any] = {"stage": stage}
    for kind in ("optimizer", "param"):
        device = section.get(f"offload_{kind}_device", "none")
        block: dict[str, Any] = {"device": device}
        if device == "nvme":
            block["nvme_path"] = section.get(f"offload_{kind}_nvme_path")
        zero[f"offload_{kind}"] = block
    zero["stage3_gather_16bit_weights_on_model_save"] = section.get("zero3_save_16bit_model", False)
    ds: dict[str, Any] = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": section.get("gradient_accumulation_steps", "auto"),
        "zero_optimization": zero,
    }
    clip = section.get("gradient_clipping", "auto")
    if clip:  # DeepSpeedPlugin: `if self.gradient_clipping:` (so 0 means no key at all)
        ds["gradient_clipping"] = clip
    precision = cfg.get("mixed_precision")
    if precision in ("bf16", "fp16"):
        ds[precision] = {"enabled": True}
    return ds


def config_file_precision_clash(value: Any, ds: dict[str, Any] | None = None) -> Finding:
    """``mixed_precision`` set in the YAML beside ``deepspeed_config_file``: `accelerate launch` passes it
    on as a DeepSpeed field taken from the YAML (commands/launch.py, any value but null, "no" included)
    and DeepSpeedPlugin._deepspeed_config_checks raises ValueError on every rank. ``ds``: the JSON, to
    say which precision it sets (the one that would have been used)."""
    json_says = ""
    if isinstance(ds, dict):
        json_says = f"; the DeepSpeed JSON sets {json_precision(ds)}"
        if value in ("bf16", "fp16", "no") and json_precision(ds) not in (value, "auto"):
            json_says += f", which disagrees with mixed_precision: {value}"
    return Finding(
        Severity.ERROR, "mixed_precision", value,
        f"with deepspeed_config_file, Accelerate refuses mixed_precision in the YAML (here {value!r}{json_says}): "
        "DeepSpeedPlugin raises ValueError ('When using `deepspeed_config_file`, the following accelerate config "
        "variables will be ignored') on every rank (`accelerate config` leaves it out for this reason)",
        "remove mixed_precision from the YAML and set bf16/fp16 in the DeepSpeed JSON",
        "accelerate-config-file-clash",
    )


def json_precision(ds: dict[str, Any]) -> str:
    """'bf16', 'fp16', 'no' (fp32) or 'auto', as the DeepSpeed JSON enables it."""
    for name in ("bf16", "fp16"):
        block = ds.get(name) or (ds.get("bfloat16") if name == "bf16" else None)
        enabled = block.get("enabled") if isinstance(block, dict) else None
        if enabled == "auto":
            return "auto"
        if enabled is True:
            return name
    return "no"


def _inline(f: Finding) -> Finding:
    """A DeepSpeed-rule finding about the built config, named by the Accelerate key that set it."""
    from dataclasses import replace

    key = _FROM_DEEPSPEED.get(f.key)
    if key is not None:
        return replace(
            f,
            key=key,
            message=f"{f.message} (Accelerate sets DeepSpeed's {f.key} from {key})",
            fix=f"{f.fix} (in this YAML: {key})",
        )
    return replace(
        f,
        key=f"deepspeed_config (DeepSpeed {f.key})",
        fix=f"{f.fix} (the Accelerate YAML has no key for {f.key}: put the DeepSpeed settings in a JSON file named "
        "by deepspeed_config.deepspeed_config_file)",
    )


def _init_flag(section: dict[str, Any]) -> list[Finding]:
    flag, stage = section.get("zero3_init_flag"), section.get("zero_stage", 2)
    if flag is True and stage != 3:
        return [
            Finding(
                Severity.WARNING,
                "deepspeed_config.zero3_init_flag",
                flag,
                f"zero3_init_flag only applies to ZeRO stage 3 and this config runs stage {stage!r}: DeepSpeedPlugin "
                "warns and switches it off, so the model is built whole on every rank",
                "set zero_stage: 3, or remove zero3_init_flag",
                "accelerate-zero3-init",
            )
        ]
    return []


def _file_findings(section: dict[str, Any], config_dir: Path | None,
                   check: DeepSpeedChecker) -> tuple[list[Finding], dict[str, Any] | None]:
    """Findings about a deepspeed_config_file section, and the DeepSpeed JSON it names (None when unreadable)."""
    out: list[Finding] = []
    key = "deepspeed_config.deepspeed_config_file"
    clashing = [k for k in TO_DEEPSPEED if k in section]
    if clashing:
        out.append(
            Finding(
                Severity.ERROR,
                f"deepspeed_config.{clashing[0]}",
                {k: section[k] for k in clashing},
                f"with deepspeed_config_file, Accelerate refuses {', '.join(clashing)} in the YAML: DeepSpeedPlugin "
                "raises ValueError ('When using `deepspeed_config_file`, the following accelerate config variables "
                "will be ignored') when the ranks start",
                f"remove {', '.join(clashing)} from deepspeed_config and set them in the DeepSpeed JSON",
                "accelerate-config-file-clash",
            )
        )
    value = section["deepspeed_config_file"]
    if not isinstance(value, str) or not value.strip():
        return out + [
            Finding(Severity.ERROR, key, value, "deepspeed_config_file must be a path to a DeepSpeed JSON file",
                    "set it to the DeepSpeed config's path", "accelerate-config-file-missing")
        ], None
    path = Path(value).expanduser()
    cwd_path = path if path.is_absolute() else Path.cwd() / path
    yaml_path = path if path.is_absolute() or config_dir is None else config_dir / path
    if cwd_path.is_file():
        target = cwd_path
    elif yaml_path.is_file():
        target = yaml_path
        out.append(
            Finding(
                Severity.WARNING,
                key,
                value,
                f"found next to the YAML ({yaml_path}) but not in the current directory: the ranks open the path as "
                "given, relative to the directory `accelerate launch` runs in, not the YAML's folder",
                f"use the absolute path {yaml_path.resolve()}, or launch from {yaml_path.parent.resolve()}",
                "accelerate-config-file-relative",
            )
        )
    else:
        looked = str(cwd_path) if cwd_path == yaml_path else f"{cwd_path} or {yaml_path}"
        return out + [
            Finding(
                Severity.ERROR,
                key,
                value,
                f"the DeepSpeed config file does not exist (looked for {looked}); the ranks fail at start-up "
                "opening it (HfDeepSpeedConfig)",
                "fix the path (an absolute path is safest), or write the file with `shardkit config zero3 --hf-auto -o FILE`",
                "accelerate-config-file-missing",
            )
        ], None
    try:
        loaded = read_config(target)
    except ConfigError as exc:
        return out + [Finding(Severity.ERROR, key, value, str(exc), "fix or regenerate that file",
                              "accelerate-config-file-unusable")], None
    ds = loaded.data
    prefix = f"{value}:"
    if "zero_optimization" not in ds:
        out.append(
            Finding(Severity.ERROR, f"{prefix}zero_optimization", None,
                    "Accelerate refuses a DeepSpeed config file without a zero_optimization section "
                    "('Please specify the ZeRO optimization config in the DeepSpeed config.')",
                    'add "zero_optimization": {"stage": ...}', "accelerate-config-file-zero")
        )
    from dataclasses import replace

    # Accelerate reads this file with json.load (HfDeepSpeedConfig): what only hjson takes is an error here
    found = (duplicate_key_findings(loaded.duplicate_keys) + non_finite_findings(ds)
             + syntax_findings(loaded.syntax, loaded.not_json, hf_trainer=True) + check(ds))
    out += [replace(f, key=prefix + f.key) for f in found]
    return out, ds
