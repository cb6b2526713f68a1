"""The checks a `shardkit launch` runs before anything starts: the config the script names (the
`shardkit check` rules and the known-bad version table), or the Accelerate config an `accelerate
launch` run reads with its command-line overrides (:mod:`shardkit.run.accelerate_config`), and the
launching shell's own launcher variables (:mod:`shardkit.run.launch_env`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from shardkit.checks import check_config, check_file
from shardkit.config.loading import is_fsdp_config, load_config
from shardkit.config.paths import auto_paths
from shardkit.core.findings import Finding, Report, Severity
from shardkit.platform.environment.facts import EnvironmentFacts, probe_environment, run_has_accelerator
from shardkit.run.accelerate_config import AccelerateRun, launch_findings
from shardkit.run.launch_env import launch_env_findings, per_node_ranks
from shardkit.run.launch_plan import LaunchPlan, names_hf_trainer_config

# A --config file is only checked when it is a DeepSpeed or shardkit FSDP2 config: `--config`
# often names the application's own settings.
_ENGINE_KEYS = {
    "zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "fp16", "bf16", "optimizer", "scheduler", "fsdp",
}


def check_launch_config(plan: LaunchPlan, facts: EnvironmentFacts | None = None) -> Report:
    """Static checks and the known-bad version table on the plan's config (an empty report when
    the script names none). Errors mean the launch must not start.

    ``facts``: the machine the ranks run on (default: this one, read with the plan's environment,
    so a DS_ACCELERATOR the ranks get counts). The ranks start here, so whether they have an
    accelerator is what DeepSpeed would pick here, the same answer `require_runnable_here` uses:
    an environment row (fp16 on a CPU-only machine) is then an error, not a "state --accelerator"
    warning.
    """
    facts = facts or probe_environment(plan.env)
    report = _check_config_of(plan, facts)
    # the launching shell's RANK/WORLD_SIZE/CUDA_VISIBLE_DEVICES against the launch (launch_env)
    report.extend(launch_env_findings(
        plan.env, launcher=plan.launcher, world_size=plan.world_size,
        per_node=per_node_ranks(plan.launcher, plan.launcher_args) if plan.accelerate is None else None,
        gpus=facts.cuda.device_count if facts.has_cuda else 0, config_failed=not report.ok,
    ))
    return report


def _check_config_of(plan: LaunchPlan, facts: EnvironmentFacts) -> Report:
    if plan.accelerate is not None:
        return _check_accelerate(plan, plan.accelerate, facts)
    if plan.config_path is None:
        return Report(subject="launch: no config named on the script's command line")
    checked = _check_script_config(plan, plan.config_path, facts)
    if checked is None:
        return Report(subject=plan.config_path)
    report, cfg = checked
    if plan.launcher == "deepspeed" and is_fsdp_config(cfg):
        report.add(
            Finding(
                Severity.WARNING, "--launcher", plan.launcher,
                f"{plan.config_path} is a shardkit FSDP2 config, launched with the deepspeed launcher",
                "use `shardkit launch --launcher torchrun ...` for FSDP2 scripts", rule="launch.launcher-kind",
            )
        )
    return report


def _check_script_config(plan: LaunchPlan, path: str, facts: EnvironmentFacts) -> tuple[Report, object] | None:
    """The config the script names on its own command line, checked with the `shardkit check`
    rules (None, with a note, when it is not an engine config); "auto" is accepted when the script
    got it as ``--deepspeed PATH`` (the HF Trainer fills it), and a note says so."""
    cfg = load_config(path)  # ConfigError: missing, empty, malformed
    if isinstance(cfg, dict) and not (_ENGINE_KEYS & set(cfg)):
        plan.notes.append(f"{path} is not a DeepSpeed or shardkit FSDP2 config; not checked")
        return None
    hf_auto = names_hf_trainer_config(plan.script_args, path)
    autos = auto_paths(cfg) if hf_auto and isinstance(cfg, dict) else []
    if autos:
        shown = ", ".join(autos[:3]) + (f" (+{len(autos) - 3} more)" if len(autos) > 3 else "")
        plan.notes.append(
            f'{path}: "auto" accepted in {shown} because `--deepspeed PATH` is the HF Trainer\'s flag (the Trainer '
            "fills them; its PreflightCallback checks them filled). A script that is not a Trainer and passes this file "
            'to deepspeed.initialize must fill them itself: DeepSpeed drops "auto" silently and uses its defaults'
        )
    report = check_file(
        path, world_size=plan.world_size, environment=facts, accelerator=run_has_accelerator(facts=facts),
        expect_hf_auto=hf_auto,
    )
    return report, cfg


def _check_accelerate(plan: LaunchPlan, run: AccelerateRun, facts: EnvironmentFacts | None) -> Report:
    """The Accelerate config the ranks get (file + command-line overrides): the Accelerate rules
    (its DeepSpeed section or file with the DeepSpeed rules), plus what accelerate would refuse or drop."""
    facts = facts or probe_environment(plan.env)
    accelerator = run_has_accelerator(facts=facts)
    source = run.config_file or "accelerate launch (no config file: accelerate's defaults and the command line)"
    report = Report(subject=source)
    if run.effective.get("distributed_type") in ("DEEPSPEED", "FSDP"):
        checked = run.effective
        section = checked.get("deepspeed_config")
        if isinstance(section, dict) and "deepspeed_config_file" in section and "mixed_precision" in checked:
            # launch_findings judges mixed_precision beside a config file as accelerate does: refused
            # only when it came from the YAML, not from a --mixed_precision on the command line
            checked = {k: v for k, v in checked.items() if k != "mixed_precision"}
        report = check_config(
            checked, source=source, world_size=plan.world_size, environment=facts, accelerator=accelerator,
            duplicate_keys=run.loaded.duplicate_keys if run.loaded else (),
            config_dir=Path(run.config_file).parent if run.config_file else None,
        )
    report.extend(launch_findings(run, accelerator=accelerator))
    script_cfg = plan.script_config_path
    if script_cfg is not None and not _same_file(script_cfg, _section_file(run)):
        # `accelerate launch train.py --deepspeed ds.json`: the Trainer hands this file to
        # deepspeed.initialize, whatever the YAML says; its findings carry the file's name
        script_checked = _check_script_config(plan, script_cfg, facts)
        if script_checked is not None:
            report.extend(replace(f, key=f"{script_cfg}:{f.key}") for f in script_checked[0].findings)
    return report


def _section_file(run: AccelerateRun) -> str | None:
    """The DeepSpeed JSON the Accelerate config names (deepspeed_config.deepspeed_config_file)."""
    section = run.effective.get("deepspeed_config")
    value = section.get("deepspeed_config_file") if isinstance(section, dict) else None
    return value if isinstance(value, str) else None


def _same_file(a: str, b: str | None) -> bool:
    return b is not None and Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
