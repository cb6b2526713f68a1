"""The config an ``accelerate launch`` command line will use, worked out before anything starts.

accelerate 1.15 (``accelerate/commands/launch.py``): ``launch_command_parser`` splits accelerate's
own options from the script and its arguments; ``_validate_launch_command`` reads the YAML (or
JSON) named by ``--config_file``, else the default file when it exists (and ``--cpu`` is not
given); a command-line paradigm flag (``--use_deepspeed``, ``--use_fsdp`` ...) replaces the file's
``distributed_type``; other explicit options win over the file's values, inside ``deepspeed_config``
and ``fsdp_config`` too. :func:`parse_accelerate_args` and :func:`effective_config` do the same,
so shardkit checks what the ranks will get. accelerate's own parser is reused (its options are
many and change between releases); accelerate is imported only when this launcher is used.

:func:`launch_findings` adds what the generic Accelerate checks do not see: keys accelerate
refuses or silently ignores (a misspelled ``offload_optimizer_devic`` is set as an attribute nothing
reads: the run trains without offload), ``mixed_precision`` beside ``deepspeed_config_file``, and
Accelerate's FSDP2 settings checked with shardkit's FSDP2 rules.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from shardkit.checks.accelerate_deepspeed import config_file_precision_clash
from shardkit.checks.fsdp_rules import fsdp_findings
from shardkit.config.loading import LoadedConfig, read_config
from shardkit.core.errors import ConfigError, UsageError
from shardkit.core.findings import Finding, Severity

# Command-line paradigm flag -> the distributed_type it selects (_validate_launch_command).
PARADIGMS: dict[str, str] = {
    "use_deepspeed": "DEEPSPEED", "use_fsdp": "FSDP", "multi_gpu": "MULTI_GPU", "tpu": "XLA",
    "use_megatron_lm": "MEGATRON_LM",
}
# Parser destinations that are not config values.
_NOT_CONFIG = {
    "config_file", "training_script", "training_script_args", "help", "cpu", "module", "no_python", "quiet", *PARADIGMS,
}
# Old top-level keys ClusterConfig.process_config still converts (fp16 -> mixed_precision, dynamo_backend
# -> dynamo_config) before it refuses unknown keys.
_LEGACY_KEYS = {"fp16", "dynamo_backend"}
# DeepSpeedPlugin reads these from the environment; with deepspeed_config_file they must not come
# from the YAML (DeepSpeedPlugin._deepspeed_config_checks; mixed_precision counts when the YAML sets it).
_FILE_CLASH = "mixed_precision"


@dataclass
class AccelerateRun:
    """An ``accelerate launch`` command line, taken apart the way accelerate takes it apart."""

    accelerate_args: list[str]
    """accelerate's own options, as given (everything before the script)."""
    script: str
    """The training script (or module with -m/--module)."""
    script_args: list[str]
    """The script's arguments, untouched."""
    is_module: bool
    """-m/--module or --no_python: no file to check."""
    overrides: dict[str, Any]
    """Options given explicitly on the command line (accelerate's ``nondefault``), by destination."""
    config_file: str | None
    """The Accelerate config file the run reads: --config_file, else the default file when it exists."""
    config_source: str
    """How it was found, for messages ('--config_file', "accelerate's default location")."""
    loaded: LoadedConfig | None = None
    """The file as parsed (None: no file; accelerate's built-in defaults)."""
    effective: dict[str, Any] = field(default_factory=dict)
    """The file with the command-line overrides applied, in the file's shape."""
    option_groups: dict[str, set[str]] = field(default_factory=dict)
    """accelerate's option destinations by argument group, from the parser built once per launch
    (building it imports accelerate's launch machinery: ~0.1 s each time)."""

    @property
    def world_size(self) -> int | None:
        """num_processes (total over all machines, as accelerate counts it), when known."""
        n = self.effective.get("num_processes")
        return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


def default_config_file(environ: Mapping[str, str]) -> Path:
    """accelerate's default config path for the environment ``environ``.

    Same lookup as ``accelerate.commands.config.config_args`` (1.15): ``$HF_HOME/accelerate``, else
    ``$XDG_CACHE_HOME/huggingface/accelerate``, else ``~/.cache/huggingface/accelerate``, file
    ``default_config.yaml``. Computed here because accelerate computes it once, at import, from the
    importing process's environment; there is no ACCELERATE_CONFIG_FILE variable in 1.15.
    """
    cache = environ.get("XDG_CACHE_HOME", "~/.cache")
    hf_home = environ.get("HF_HOME", os.path.join(cache, "huggingface"))
    return Path(os.path.expanduser(hf_home)) / "accelerate" / "default_config.yaml"


def _parser() -> argparse.ArgumentParser:
    try:
        from accelerate.commands.launch import launch_command_parser
    except ImportError as exc:
        raise UsageError(
            f"--launcher accelerate: accelerate is not importable here ({exc}); install it in this environment "
            "(`pip install accelerate`) or use --launcher torchrun"
        ) from exc
    parser: argparse.ArgumentParser = launch_command_parser()
    return parser


def _groups(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """Option destinations of accelerate's argument groups, by group title."""
    return {
        str(g.title): {a.dest for a in g._group_actions}  # argparse keeps no public list of a group's actions
        for g in parser._action_groups
    }


def parse_accelerate_args(args: Sequence[str], environ: Mapping[str, str]) -> AccelerateRun:
    """``[accelerate args] script.py [script args]`` -> the parts and the config file the run reads.

    Nothing is read yet (see :func:`load_run`). A usage error accelerate would print is a UsageError."""
    args = list(args)
    parser = _parser()

    def error(message: str) -> None:  # argparse would print usage and exit 2
        if "training_script" in message:
            message = "no training script"
        raise UsageError(
            f"accelerate launch arguments {' '.join(args) or '(nothing)'}: {message}; expected `shardkit launch "
            "--launcher accelerate [accelerate args] train.py [script args]` (`accelerate launch --help` lists them)"
        )

    parser.error = error  # type: ignore[method-assign,assignment]
    ns = parser.parse_args(args)
    script_args = list(ns.training_script_args)
    own = _before_script(args, str(ns.training_script), script_args)
    overrides = {dest: getattr(ns, dest) for dest in sorted(getattr(ns, "nondefault", set())) if dest not in ("help",)}
    for flag in ("cpu", *PARADIGMS):
        if getattr(ns, flag, False):
            overrides[flag] = True
    chosen = [f"--{f}" for f in ("cpu", *PARADIGMS) if overrides.get(f)]
    if len(chosen) > 1:
        raise UsageError(
            f"accelerate launch takes one of --cpu, --multi_gpu, --tpu, --use_deepspeed, --use_fsdp at a time, got "
            f"{' and '.join(chosen)} (accelerate refuses it); keep the one this run needs"
        )
    if ns.config_file is not None:
        config_file: str | None = str(ns.config_file)
        source = "--config_file"
    else:
        default = default_config_file(environ)
        # accelerate: `args.config_file is not None or os.path.isfile(default_config_file) and not args.cpu`
        config_file = str(default) if default.is_file() and not ns.cpu else None
        source = "accelerate's default location"
    return AccelerateRun(
        accelerate_args=own, script=str(ns.training_script), script_args=script_args,
        is_module=bool(ns.module or ns.no_python), overrides=overrides, config_file=config_file,
        config_source=source, option_groups=_groups(parser),
    )


def _before_script(args: list[str], script: str, script_args: list[str]) -> list[str]:
    """accelerate's own options: everything before the training script. Sliced at the script's
    index, not counted back from the end: argparse drops a ``--`` separator (before or after the
    script) from what it hands over, so the lengths do not add up when one was given."""
    for i in range(len(args) - 1, -1, -1):
        if args[i] == script and args[i + 1 :] in (script_args, ["--", *script_args]):
            own = args[:i]
            return own[:-1] if own[-1:] == ["--"] else own
    return args[: len(args) - len(script_args) - 1]  # pragma: no cover - argparse found the script in args


def load_run(run: AccelerateRun) -> AccelerateRun:
    """Read the run's config file (ConfigError with one line when missing, unreadable or malformed)
    and apply the command-line overrides."""
    if run.config_file is not None:
        try:
            run.loaded = read_config(run.config_file)
        except ConfigError as exc:
            raise ConfigError(f"the Accelerate config ({run.config_source}) cannot be used: {exc}") from exc
    run.effective = effective_config(run.loaded.data if run.loaded else None, run.overrides, run.option_groups)
    return run


def effective_config(
    file_cfg: dict[str, Any] | None, overrides: Mapping[str, Any], groups: Mapping[str, set[str]] | None = None
) -> dict[str, Any]:
    """The Accelerate config the ranks get: ``file_cfg`` with the command line's explicit options
    applied, the way _validate_launch_command applies them. ``groups``: :func:`_groups` of
    accelerate's parser (built here when not given)."""
    cfg = copy.deepcopy(file_cfg) if file_cfg else {}
    cfg.setdefault("compute_environment", "LOCAL_MACHINE")  # ClusterConfig.process_config's default
    groups = groups if groups is not None else _groups(_parser())
    deepspeed_dests = groups.get("DeepSpeed Arguments", set())
    fsdp_dests = groups.get("FSDP Arguments", set())
    paradigm = next((PARADIGMS[f] for f in PARADIGMS if overrides.get(f)), None)
    if paradigm is not None:  # a paradigm flag replaces the file's distributed_type
        cfg["distributed_type"] = paradigm
    if overrides.get("cpu"):
        cfg["use_cpu"] = True
    ds_file = _section(cfg, "deepspeed_config").get("deepspeed_config_file") or overrides.get("deepspeed_config_file")
    for dest, value in overrides.items():
        if dest in _NOT_CONFIG:
            continue
        if dest in deepspeed_dests:
            if ds_file and dest != "deepspeed_config_file" and dest != "zero3_init_flag":
                # With a DeepSpeed config file, these fill only its "auto" entries (DeepSpeedPlugin
                # fill_match(must_match=False)); they are no YAML field, so no clash either.
                continue
            _set(cfg, "deepspeed_config", dest, _plain(value, numbers=False))
        elif dest in fsdp_dests:
            _set(cfg, "fsdp_config", dest, _plain(value, numbers=True))
        else:
            cfg[dest] = value
    return cfg


def _set(cfg: dict[str, Any], section: str, key: str, value: Any) -> None:
    """cfg[section][key] = value; a section that is not a mapping is left as it is (the checks refuse it)."""
    block = cfg.setdefault(section, {})
    if isinstance(block, dict):
        block[key] = value


def _plain(value: Any, *, numbers: bool) -> Any:
    """accelerate's string-typed options ("true", "2": --zero3_init_flag, --fsdp_version ...) as the
    YAML holds them (bools, ints)."""
    if isinstance(value, str):
        if value.lower() in ("true", "false"):
            return value.lower() == "true"
        if numbers and value.isdigit():
            return int(value)
    return value


def _section(cfg: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = cfg.get(name)
    return value if isinstance(value, dict) else {}


def launch_findings(run: AccelerateRun, *, accelerator: bool | None) -> list[Finding]:
    """What `accelerate launch` would refuse or silently drop in this run's config, and its FSDP2
    settings under shardkit's FSDP2 rules. ``accelerator``: whether the ranks have one."""
    file_cfg = run.loaded.data if run.loaded else {}
    out = _unknown_keys(file_cfg, run.option_groups or _groups(_parser()))
    section = _section(run.effective, "deepspeed_config")
    if (
        run.effective.get("distributed_type") == "DEEPSPEED"
        and section.get("deepspeed_config_file")
        and _FILE_CLASH in file_cfg
        and _FILE_CLASH not in run.overrides
        and file_cfg[_FILE_CLASH] is not None
    ):
        out.append(config_file_precision_clash(file_cfg[_FILE_CLASH]))
    if run.effective.get("distributed_type") == "FSDP":
        out += fsdp2_findings(run.effective, accelerator=accelerator)
    return out


def _unknown_keys(file_cfg: Mapping[str, Any], groups: Mapping[str, set[str]]) -> list[Finding]:
    from accelerate.commands.config.config_args import ClusterConfig, SageMakerConfig

    out: list[Finding] = []
    # load_config_from_file picks the class by compute_environment, then from_yaml_file refuses extra keys
    kind = SageMakerConfig if file_cfg.get("compute_environment") == "AMAZON_SAGEMAKER" else ClusterConfig
    top = set(kind.__dataclass_fields__) | _LEGACY_KEYS
    for key in file_cfg:
        if key not in top:
            out.append(_unknown(str(key), file_cfg[key], str(key), top, "accelerate launch refuses the file ('had unknown keys')"))
    sections = (("deepspeed_config", "DeepSpeed Arguments", ""), ("fsdp_config", "FSDP Arguments", "fsdp_"))
    for name, title, prefix in sections:
        known = groups.get(title, set())
        for key, value in _section(file_cfg, name).items():
            # _validate_launch_command: fsdp_config keys get an fsdp_ prefix when they lack one
            dest = str(key) if str(key).startswith(prefix) else prefix + str(key)
            if dest not in known:
                why = (
                    "accelerate launch sets it as an attribute nothing reads, so the setting is silently ignored and "
                    "the run uses the default"
                )
                out.append(_unknown(f"{name}.{key}", value, dest, known, why))
    return out


def _unknown(key: str, value: Any, name: str, known: set[str], why: str) -> Finding:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    fix = f"did you mean {close[0]!r}? " if close else ""
    return Finding(
        Severity.ERROR, key, value, f"unknown Accelerate config key {key.rpartition('.')[2]!r}: {why}",
        f"{fix}fix the spelling or remove it (`accelerate config` writes a valid file)", "accelerate-unknown-key",
    )


# Accelerate fsdp_config key -> shardkit FSDP2 key, and back for the findings' names.
_TO_SHARDKIT = {
    "fsdp_reshard_after_forward": "reshard_after_forward",
    "fsdp_offload_params": "cpu_offload",
}


def fsdp2_findings(cfg: Mapping[str, Any], *, accelerator: bool | None) -> list[Finding]:
    """Accelerate's FSDP2 settings (fsdp_version 2) checked with shardkit's FSDP2 rules.

    Accelerate's FSDP2 offload is ``CPUOffloadPolicy()`` (utils/dataclasses.py, 1.15), whose
    pin_memory is True: on ranks without an accelerator the pinning fails.
    """
    section = _section(cfg, "fsdp_config")
    if section.get("fsdp_version") not in (2, "2"):
        return []  # FSDP1: the generic Accelerate rules already say shardkit's checks target FSDP2
    offload = section.get("fsdp_offload_params") in (True, "true", "True")
    reshard = section.get("fsdp_reshard_after_forward", True)
    view = {
        "fsdp": {
            "reshard_after_forward": reshard if isinstance(reshard, bool) else True,
            "cpu_offload": offload,
            "pin_memory": offload,
            "mixed_precision": cfg.get("mixed_precision") if cfg.get("mixed_precision") in ("bf16", "fp16") else "none",
            # the wrap classes are matched by Accelerate's auto-wrap policy, not fsdp.wrap: not checked here
            "wrap": ["(auto-wrap policy)"],
        }
    }
    out: list[Finding] = []
    for f in fsdp_findings(view, accelerator=accelerator):
        if f.rule == "fsdp-pin-no-accelerator":
            out.append(
                replace(
                    f, key="fsdp_config.fsdp_offload_params", value=section.get("fsdp_offload_params"),
                    message=f"{f.message}. Accelerate's FSDP2 offload is CPUOffloadPolicy() with pin_memory=True",
                    fix="set fsdp_offload_params: false on a machine without an accelerator, or build the plugin in "
                    "code: FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=CPUOffloadPolicy(pin_memory=False))",
                )
            )
        elif f.key == "fsdp.mixed_precision":
            out.append(replace(f, key="mixed_precision"))
    return out
