"""check_config / check_file: config dict -> typed view -> rules -> Report."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable

from shardkit.checks import accelerate_deepspeed
from shardkit.checks.accelerate_rules import accelerate_findings, is_accelerate_config
from shardkit.checks.auto import auto_findings
from shardkit.checks.environment_rule import environment_rule_findings
from shardkit.checks.fsdp_rules import fsdp_findings
from shardkit.checks.offload import offload_findings
from shardkit.checks.schema import deepspeed_schema_findings
from shardkit.checks.training import training_findings
from shardkit.config.loading import config_kind, read_config
from shardkit.config.parsing import duplicate_key_findings, non_finite_findings, syntax_findings
from shardkit.config.view import deepspeed_view
from shardkit.core.errors import UsageError
from shardkit.core.findings import Finding, Report, Severity
from shardkit.engines.model_factory import resolve_model_factory
from shardkit.platform.environment.facts import probe_environment
from shardkit.platform.versions import installed_versions, known_bad_findings, parse_version


def check_config(
    cfg: dict[str, Any],
    *,
    source: str = "<config>",
    world_size: int | None = None,
    deepspeed_version: str | None = None,
    accelerator: bool | None = None,
    expect_hf_auto: bool = False,
    model: Any = None,
    torch_version: str | None = None,
    environment: Any = None,
    duplicate_keys: Iterable[tuple[str, Any, Any]] = (),
    config_dir: Path | None = None,
    syntax: str = "json",
    not_json: str = "",
) -> Report:
    """Every static finding about a DeepSpeed or shardkit-FSDP2 config.

    ``deepspeed_version``: evaluate against that release (default: the installed one, if any).
    ``accelerator``: whether the run will have one (None = unknown). ``expect_hf_auto``: "auto"
    values are fine (the HF Trainer/Accelerate fills them). ``model``: an nn.Module, a model spec
    ("llama:tiny", "pkg.module:factory") or class names, to check FSDP wrap classes against.
    ``torch_version``: for table rows that depend on torch (default: the installed one).
    ``environment``: shardkit.platform.environment.facts.EnvironmentFacts of the machine the run will
    use, for the table's environment rows (None: the config alone; check_file probes this machine).
    ``duplicate_keys``: what loading.read_config saw repeated (check_file passes it).
    ``config_dir``: the config file's folder (for files an Accelerate config names).
    ``syntax``: how the file was parsed (``LoadedConfig.syntax``): hjson gets a warning, an error with
    ``expect_hf_auto`` (the HF Trainer's json.load refuses it). ``not_json``: ``LoadedConfig.not_json``.
    """
    if world_size is not None and world_size < 1:
        raise UsageError(f"world_size {world_size}: must be at least 1 (the number of data-parallel ranks)")
    report = Report(subject=source)
    if not isinstance(cfg, dict):
        report.add(
            Finding(Severity.ERROR, "<top level>", type(cfg).__name__, "a config must be a mapping", "", "schema")
        )
        return report
    # what parsing hid applies to every kind of config
    report.extend(map(_compact, duplicate_key_findings(duplicate_keys) + non_finite_findings(cfg)
                                 + syntax_findings(syntax, not_json, hf_trainer=expect_hf_auto)))
    if is_accelerate_config(cfg):
        report.extend(map(_compact, accelerate_findings(cfg, model_classes=_model_classes(model))))
        if accelerate_deepspeed.is_deepspeed(cfg):

            def check_deepspeed(ds: dict[str, Any]) -> list[Finding]:
                # Accelerate fills "auto" itself, so the HF rules apply; the machine's rows as for DeepSpeed JSON
                return _deepspeed_findings(ds, world_size, deepspeed_version, torch_version, accelerator, True) + (
                    _environment(ds, environment, deepspeed_version, accelerator, "deepspeed")
                )

            found = accelerate_deepspeed.deepspeed_findings(cfg, config_dir=config_dir, check=check_deepspeed)
            report.extend(map(_compact, found))
        return report
    if config_kind(cfg) == "fsdp":
        report.extend(map(_compact, fsdp_findings(cfg, accelerator=accelerator, model_classes=_model_classes(model))))
        report.extend(_environment(cfg, environment, deepspeed_version, accelerator, "fsdp"))
        return report
    report.extend(
        map(_compact, _deepspeed_findings(cfg, world_size, deepspeed_version, torch_version, accelerator, expect_hf_auto))
    )
    report.extend(_environment(cfg, environment, deepspeed_version, accelerator, "deepspeed"))
    return report


def _environment(
    cfg: dict[str, Any], facts: Any, deepspeed_version: str | None, accelerator: bool | None, engine: str
) -> list[Finding]:
    return environment_rule_findings(
        cfg, facts=facts, deepspeed_version=deepspeed_version, accelerator=accelerator, engine=engine
    )


def _deepspeed_findings(
    cfg: dict[str, Any],
    world_size: int | None,
    deepspeed_version: str | None,
    torch_version: str | None,
    accelerator: bool | None,
    expect_hf_auto: bool,
) -> list[Finding]:
    if deepspeed_version is not None:
        version = str(parse_version(deepspeed_version))
    else:
        version = installed_versions().get("deepspeed")
    if torch_version is None:
        torch_version = installed_versions().get("torch")
    else:
        torch_version = str(parse_version(torch_version, "torch_version"))
    # "auto" first: the schema parse below sees the config the way DeepSpeed does, without them.
    findings = auto_findings(cfg, expect_hf_auto=expect_hf_auto)
    findings += deepspeed_schema_findings(cfg)
    view = deepspeed_view(cfg)
    findings += offload_findings(view, deepspeed_version=version, accelerator=accelerator)
    findings += training_findings(view, world_size=world_size, expect_hf_auto=expect_hf_auto)
    if version is not None:
        # behaviour changes (pin_memory default, client optimizer) have their own rules above
        findings += known_bad_findings(cfg, version, torch_version, kinds=("bug",))
    return _dedupe(findings)


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of dicts/lists, counted only up to ``limit``."""
    if limit <= 0 or not isinstance(value, (dict, list)):
        return 0
    items = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(v, limit - 1) for v in items), default=0)


def _compact(finding: Finding) -> Finding:
    """Keep reports small and serializable: a deeply nested or huge value becomes a short summary
    (a hostile 1000-deep section would otherwise overflow the stack when the report is rendered)."""
    value = finding.value
    if not isinstance(value, (dict, list)):
        return finding
    if _depth(value, 8) >= 8:
        summary = f"<{type(value).__name__} nested more than 8 levels>"
    else:
        try:
            text = json.dumps(value, default=repr)
        except (TypeError, ValueError, RecursionError):
            text = None
        if text is not None and len(text) <= 2000:
            return finding
        summary = (text[:200] + "...") if text else f"<{type(value).__name__}>"
    return dataclasses.replace(finding, value=summary)


def _dedupe(findings: list[Finding]) -> list[Finding]:
    """One finding per (key, rule, message); a specific rule wins over DeepSpeed's generic refusal
    of the same key (e.g. ratio < 1 outside stage 3)."""
    seen: set[tuple[str, str, str]] = set()
    generic = ("schema", "schema-section", "deepspeed-warning")
    specific = {f.key for f in findings if f.rule not in generic}
    out = []
    for f in findings:
        ident = (f.key, f.rule, f.message)
        if ident in seen:
            continue
        seen.add(ident)
        if f.rule == "schema" and f.key in specific:
            continue
        # a section-level refusal (a DeepSpeed model validator) already explained by a specific rule
        if f.rule == "schema-section" and any(k.startswith(f.key + ".") for k in specific):
            continue
        out.append(f)
    return out


def _model_classes(model: Any) -> Iterable[str] | None:
    if model is None:
        return None
    if isinstance(model, str):
        model = resolve_model_factory(model)()
    modules = getattr(model, "modules", None)
    if callable(modules):
        return {type(m).__name__ for m in modules()}
    return set(model)


_PROBE: Any = object()


def check_file(
    path: str | Path,
    *,
    source: str | None = None,
    world_size: int | None = None,
    deepspeed_version: str | None = None,
    accelerator: bool | None = None,
    expect_hf_auto: bool = False,
    model: Any = None,
    torch_version: str | None = None,
    environment: Any = _PROBE,
    config_dir: Path | None = None,
) -> Report:
    """Load a JSON/YAML config (ConfigError with one clear line when unusable) and check it; the
    keywords are check_config's. ``environment`` defaults to probing this machine: a file is
    checked for a run here unless told otherwise (None: the config alone)."""
    loaded = read_config(path)
    if environment is _PROBE:
        environment = probe_environment()
    return check_config(
        loaded.data,
        source=str(path) if source is None else source,
        world_size=world_size,
        deepspeed_version=deepspeed_version,
        accelerator=accelerator,
        expect_hf_auto=expect_hf_auto,
        model=model,
        torch_version=torch_version,
        environment=environment,
        duplicate_keys=loaded.duplicate_keys,
        config_dir=Path(path).parent if config_dir is None else config_dir,
        syntax=loaded.syntax,
        not_json=loaded.not_json,
    )
