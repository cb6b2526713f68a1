"""The known-bad table's environment rows evaluated against this machine's facts: which rows hold
for a config and a run (``matching_environment_rows``, ``condition_holds``) and the finding each
one gives, with the value seen here, DeepSpeed's symptom and the fix (``environment_findings``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from shardkit.config.view import deepspeed_view
from shardkit.core.findings import Finding, Severity
from shardkit.platform.environment.arch_list import arch_list_fix, deepspeed_arch_list_error
from shardkit.platform.environment.facts import EnvironmentFacts, probe_environment
from shardkit.platform.environment.fp16 import fp16_support
from shardkit.platform.environment.memlock import nvme_optimizer_buffer_estimate, nvme_param_buffer_bytes
from shardkit.platform.versions import (
    KnownBad,
    cite,
    installed_versions,
    known_bad_table,
    parse_version,
    pin_memory_default,
    trigger_holds,
)

if TYPE_CHECKING:
    from packaging.version import Version


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


@dataclass(frozen=True)
class RunEnvironment:
    """The machine facts plus what the caller knows about the run."""

    facts: EnvironmentFacts
    accelerator: bool | None = None
    """Whether the run will have an accelerator (check --accelerator/--no-accelerator; None unknown)."""
    engine: str = "deepspeed"
    """"deepspeed" or "fsdp": rows about DeepSpeed's ops do not apply to FSDP2 runs."""

    @property
    def cpu_run(self) -> bool | None:
        """True when DeepSpeed will run on its CPU accelerator (stated, or this machine has no GPU)."""
        if self.accelerator is False:
            return True
        if self.accelerator is True:
            return False
        return self.facts.deepspeed_accelerator == "cpu"


# The table's environment triggers, in the order that names a row's finding (its first one).
ENVIRONMENT_CONDITIONS = (
    "arch_list_unparseable", "cuda_build_without_driver", "cpu_fp16_unsupported", "memlock_nvme",
    "memlock_native_pinning",
)


def _pinned_offload(cfg: Mapping[str, Any], dsv: Version) -> bool:
    """Some active offload block pins memory (explicitly, or by the release's default)."""
    default = pin_memory_default(dsv)
    return any(
        o.pin_memory is True or (o.pin_memory is None and default) for o in deepspeed_view(dict(cfg)).active_offloads
    )


def condition_holds(name: str, want: Any, cfg: Mapping[str, Any] | None, run: RunEnvironment, dsv: Version) -> bool:
    """One environment trigger of a table row. Config-dependent ones need a config (no config: no)."""
    facts = run.facts
    if name == "arch_list_unparseable":
        if run.accelerator is False:
            # a stated CPU run: DeepSpeed's CPU accelerator hands out CPU op builders, which never
            # read TORCH_CUDA_ARCH_LIST (only CUDAOpBuilder.compute_capability_args does, PR #7977)
            return not bool(want)
        return (deepspeed_arch_list_error(facts.torch_cuda_arch_list) is not None) == bool(want)
    if name == "cuda_build_without_driver":
        visible = facts.cuda_visible_devices
        hidden = visible is not None and visible.strip() in ("", "-1")
        if hidden and run.accelerator is not True:
            return not bool(want)  # every GPU hidden on purpose: a CPU run was asked for
        return (facts.cuda.build is not None and not facts.has_cuda) == bool(want)
    if name == "cpu_fp16_unsupported":
        if cfg is None or run.cpu_run is not True:
            return False
        return (not fp16_support(facts, str(dsv), device="cpu").supported) == bool(want)
    if name == "memlock_nvme":
        if cfg is None or facts.memlock_bytes is None:
            return False
        # parameter buffers have a known size; optimizer buffers depend on the model (an estimate
        # bounds them: a limit above both is enough, whatever the model)
        need = nvme_param_buffer_bytes(cfg)
        optimizer = nvme_optimizer_buffer_estimate(cfg)
        short = (need or 0) + (optimizer or 0) > facts.memlock_bytes
        return short == bool(want)
    if name == "memlock_native_pinning":
        if cfg is None or facts.memlock_bytes is None or facts.pin_memory_backend != "native":
            return False
        return _pinned_offload(cfg, dsv) == bool(want)
    raise ValueError(f"deepspeed_known_bad.json: unknown environment condition {name!r}")


def environment_finding(row: KnownBad, cfg: Mapping[str, Any] | None, run: RunEnvironment, dsv: Version) -> Finding:
    """A finding for one environment row that applies: the value seen on this machine, DeepSpeed's
    symptom with its sources, and the exact command or setting that fixes it."""
    facts = run.facts
    sources = cite(row.sources)
    severity = row.severity
    trigger = next(c for c in ENVIRONMENT_CONDITIONS if c in row.when)
    if trigger == "arch_list_unparseable":
        value = facts.torch_cuda_arch_list
        error = deepspeed_arch_list_error(value)
        fix = arch_list_fix(value)
        if facts.cuda.build is None:
            where = "(harmless here: a CPU build of torch builds no CUDA ops)"
            severity = Severity.WARNING
        elif run.accelerator is None and run.cpu_run:
            # condition_holds drops a stated CPU run; an unstated one may still be meant for a GPU
            where = ("(harmless for a CPU run here: DeepSpeed's CPU op builders never read it; state --accelerator "
                     "if the run is on a GPU machine)")
            severity = Severity.WARNING
        else:
            where = "on this machine"
        message = (
            f"TORCH_CUDA_ARCH_LIST={value!r} {where}: deepspeed {dsv}'s JIT op builder cannot parse it and every "
            f"CUDA op build (FusedAdam at deepspeed.initialize, ...) fails with `{error}`. {row.symptom} [{sources}]"
        )
        return Finding(severity, "env:TORCH_CUDA_ARCH_LIST", value, message, fix, f"known-bad:{row.id}")
    if trigger == "cuda_build_without_driver":
        cuda = facts.cuda
        if run.accelerator is True:
            severity = Severity.ERROR
        message = (
            f"torch {cuda.build and 'is a CUDA ' + cuda.build + ' build'} but cannot use a GPU here "
            f"({cuda.reason or 'torch.cuda.is_available() is False'}). {row.symptom} [{sources}]"
        )
        return Finding(severity, "env:torch.cuda", f"cuda {cuda.build}, available={cuda.available}", message,
                       row.config_fix or "", f"known-bad:{row.id}")
    if trigger == "cpu_fp16_unsupported":
        fp16 = fp16_support(facts, str(dsv), device="cpu")
        stated = "the run has no accelerator" if run.accelerator is False else "this machine has no GPU"
        if run.accelerator is None:
            severity = Severity.WARNING
            stated += "; state --accelerator if the run is on another machine"
        message = f"fp16 on a CPU run ({stated}): {fp16.reason}. {row.symptom} [{sources}]"
        return Finding(severity, "fp16.enabled", True, message, row.config_fix or "", f"known-bad:{row.id}")
    if trigger == "memlock_nvme":
        need = nvme_param_buffer_bytes(cfg or {})
        optimizer = nvme_optimizer_buffer_estimate(cfg or {})
        limit = facts.memlock_bytes or 0
        parts = []
        if need is not None:
            parts.append(f"this config's NVMe parameter swap buffers need {_human(need)} (offload_param.buffer_count x "
                         "buffer_size x dtype bytes)")
        if optimizer is not None:
            parts.append("this config's NVMe optimizer swap buffers need an unknown size (offload_optimizer.buffer_count x the "
                         f"largest ZeRO sub-group of the model x 4 bytes: up to about {_human(optimizer)} with this "
                         "sub_group_size)")
        if need is not None and need > limit:
            severity = Severity.ERROR  # known to fail; the unknown optimizer part stays a warning
        else:
            parts.append(f"so it may or may not fit: a limit of {_human((need or 0) + (optimizer or 0))} is enough "
                         "unless one partitioned parameter is larger than sub_group_size")
        message = (f"ulimit -l (RLIMIT_MEMLOCK) is {_human(limit)} and {'; '.join(parts)}: deepspeed {dsv} mlocks "
                   f"them. {row.symptom} [{sources}]")
        over = need is not None and (need > limit or optimizer is None)
        key = "zero_optimization.offload_param.device" if over else "zero_optimization.offload_optimizer.device"
        return Finding(severity, key, "nvme", message, row.config_fix or "", f"known-bad:{row.id}")
    if trigger == "memlock_native_pinning":
        limit = facts.memlock_bytes or 0
        message = (f"DS_PIN_MEMORY_BACKEND=native with pinned offload and ulimit -l (RLIMIT_MEMLOCK) of {_human(limit)}: "
                   f"{row.symptom} [{sources}]")
        blocks = deepspeed_view(dict(cfg or {})).active_offloads
        key = f"{blocks[0].key}.pin_memory" if blocks else "zero_optimization"
        return Finding(severity, key, blocks[0].pin_memory if blocks else None, message, row.config_fix or "",
                       f"known-bad:{row.id}")
    raise ValueError(f"deepspeed_known_bad.json: no finding text for environment trigger {trigger!r}")


def matching_environment_rows(
    cfg: Mapping[str, Any] | None, run: RunEnvironment, dsv: Version | None
) -> list[KnownBad]:
    """Environment rows whose release range holds (any row whose range is empty when DeepSpeed is
    not installed) and whose every trigger holds. Config triggers (fp16, offload ...) are read the
    way the bug rows read them, but without a config they do not hold."""
    out = []
    for row in known_bad_table():
        if row.kind != "environment":
            continue
        if dsv is None and str(row.deepspeed):
            continue
        if dsv is not None and not row.affects(dsv):
            continue
        if run.engine != "deepspeed" and "cuda_build_without_driver" not in row.when:
            continue  # the other rows are about DeepSpeed's ops and accelerator
        ok = True
        for name, want in row.when.items():
            if name in ENVIRONMENT_CONDITIONS:
                ok = condition_holds(name, want, cfg, run, dsv)
            else:
                ok = cfg is not None and trigger_holds(name, want, deepspeed_view(dict(cfg)), None)
            if not ok:
                break
        if ok:
            out.append(row)
    return out


def environment_rule_ids() -> frozenset[str]:
    """The ``Finding.rule`` of every environment row ("known-bad:<id>"): findings about the machine
    a config runs on, not about the config."""
    return frozenset(f"known-bad:{row.id}" for row in known_bad_table() if row.kind == "environment")


def environment_findings(
    cfg: Mapping[str, Any] | None = None,
    *,
    facts: EnvironmentFacts | None = None,
    deepspeed_version: str | None = None,
    accelerator: bool | None = None,
    engine: str = "deepspeed",
) -> list[Finding]:
    """Findings for every environment row of the known-bad table that applies on this machine (or
    on ``facts``), for ``cfg`` when given (rows that need a config do not apply without one).

    ``deepspeed_version``: the release to evaluate (default: the installed one). ``accelerator``:
    whether the run will have one (None: what this machine has). ``engine``: "fsdp" leaves out
    the rows about DeepSpeed's ops and accelerator.
    """
    run = RunEnvironment(facts or probe_environment(), accelerator=accelerator, engine=engine)
    ds = deepspeed_version or installed_versions().get("deepspeed")
    dsv = parse_version(ds, "deepspeed version") if ds else None
    return [environment_finding(row, cfg, run, dsv) for row in matching_environment_rows(cfg, run, dsv)]
