"""What this machine can run: environment facts that make DeepSpeed fail before (or instead of)
the first step whatever the config says, probed once, and the known-bad table's "environment"
rows evaluated against them (shardkit/data/deepspeed_known_bad.json).

Every probe can be replaced: ``probe_environment(environ=..., memlock_bytes=..., cuda=...,
cpu_fp16=...)`` takes the facts instead of asking the machine, so tests force each path. Nothing
here imports torch unless a fact needs it (the CUDA probe only for a CUDA build of torch, the fp16
probe only for an fp16 config on a CPU run).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Mapping

from shardkit.config.loading import config_kind
from shardkit.config.view import as_int, deepspeed_view
from shardkit.core.errors import ShardkitError
from shardkit.core.findings import Finding, Report, Severity
from shardkit.platform.versions import (
    SUPPORTED_DEEPSPEED,
    KnownBad,
    cite,
    installed_versions,
    known_bad_findings,
    known_bad_table,
    parse_version,
    pin_memory_default,
    support_status,
    trigger_holds,
)

if TYPE_CHECKING:
    from packaging.version import Version

_UNSET: Any = object()

# DeepSpeed's CPU accelerator only allows fp16 when oneDNN can run it (PR #7207, 0.16.8); before
# that it always refused fp16 (the engine's check is PR #4843, 0.13.0).
CPU_FP16_PROBE_SINCE = "0.16.8"


@dataclass(frozen=True)
class CudaProbe:
    """What torch says about CUDA on this machine."""

    build: str | None
    """torch.version.cuda: the CUDA release torch was built for (None: a CPU or ROCm build)."""
    available: bool | None
    """torch.cuda.is_available() (None: not asked, because torch is not a CUDA build)."""
    device_count: int = 0
    reason: str | None = None
    """Why CUDA is not usable, in torch's words (its 'CUDA initialization: ...' warning)."""


@dataclass(frozen=True)
class EnvironmentFacts:
    """The facts the environment rows of the known-bad table are evaluated against."""

    torch_cuda_arch_list: str | None
    """TORCH_CUDA_ARCH_LIST as set (None when unset): DeepSpeed >= 0.19.0 parses it itself."""
    memlock_bytes: int | None
    """Soft RLIMIT_MEMLOCK (`ulimit -l`) in bytes; None when it does not bind: unlimited, unknown,
    or the process holds CAP_IPC_LOCK (root usually does; mlock(2) then ignores the limit)."""
    pin_memory_backend: str
    """DS_PIN_MEMORY_BACKEND ("torch" by default; "native" pins with mlock, DeepSpeed >= 0.19.6)."""
    ds_accelerator: str | None
    """DS_ACCELERATOR: forces DeepSpeed's accelerator choice (None: auto-detect)."""
    cuda_visible_devices: str | None
    """CUDA_VISIBLE_DEVICES as set: "" or "-1" hide every GPU on purpose."""
    cuda: CudaProbe
    cpu_fp16: bool | None = None
    """torch.ops.mkldnn._is_mkldnn_fp16_supported(); None = not probed yet (probed on first need)."""

    @property
    def has_cuda(self) -> bool:
        return bool(self.cuda.available and self.cuda.device_count > 0)

    @property
    def deepspeed_accelerator(self) -> str:
        """The accelerator DeepSpeed's get_accelerator() picks here: DS_ACCELERATOR, else cuda when
        torch.cuda has devices, else its CPU accelerator (the catch-all, real_accelerator.py)."""
        if self.ds_accelerator:
            return self.ds_accelerator
        return "cuda" if self.has_cuda else "cpu"


def run_has_accelerator(stated: bool | None = None, facts: EnvironmentFacts | None = None) -> bool:
    """Whether a DeepSpeed run has an accelerator: ``stated`` (--accelerator/--no-accelerator) when
    given, else whether DeepSpeed picks one here (``deepspeed_accelerator``: DS_ACCELERATOR, else
    CUDA). The one answer `config`, `smoke`, `preflight`/`launch` and require_runnable_here use, so a
    machine whose torch sees MPS/XPU, or DS_ACCELERATOR=cpu, is a CPU run for all of them alike."""
    if stated is not None:
        return bool(stated)
    return (facts or probe_environment()).deepspeed_accelerator != "cpu"


class EnvironmentCheckError(ShardkitError, RuntimeError):
    """This machine cannot run what was asked (a known-bad environment row at error level)."""


# --- probes --------------------------------------------------------------------------------------


def _torch_cuda_build_without_import() -> str | None:
    """torch.version.cuda read from torch/version.py without importing torch (None: CPU/ROCm build
    or torch absent): most machines then never pay for a CUDA probe."""
    import importlib.util
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text("utf-8")
    except OSError:
        return None
    m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return m.group(1) if m else None


@lru_cache(maxsize=1)
def probe_cuda() -> CudaProbe:
    """Is this torch a CUDA build, and can it reach a GPU? The reason is torch's own warning
    ('The NVIDIA driver on your system is too old', 'Found no NVIDIA driver')."""
    build = _torch_cuda_build_without_import()
    if build is None:
        return CudaProbe(build=None, available=None)
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            available = bool(torch.cuda.is_available())
            count = torch.cuda.device_count() if available else 0
        except Exception as exc:  # noqa: BLE001 - a broken driver install raises here; that is the finding
            return CudaProbe(build=torch.version.cuda, available=False, reason=f"{type(exc).__name__}: {exc}")
    reason = None
    if not available:
        texts = [str(w.message).strip() for w in caught if "cuda" in str(w.message).lower()]
        reason = texts[0].splitlines()[0] if texts else "torch.cuda.is_available() is False"
    return CudaProbe(build=torch.version.cuda, available=available, device_count=count, reason=reason)


@lru_cache(maxsize=1)
def probe_cpu_fp16() -> bool:
    """DeepSpeed's CPU accelerator test for fp16 (cpu_accelerator.is_fp16_supported): oneDNN fp16,
    i.e. a CPU with AVX512-FP16 or AMX-FP16. Any exception counts as 'no', as it does there."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # noqa: BLE001 - DeepSpeed treats a failing probe as unsupported too
        return False


CAP_IPC_LOCK = 14  # linux/capability.h


def has_cap_ipc_lock(status_text: str | None = None) -> bool:
    """Whether this process may lock memory past RLIMIT_MEMLOCK (CAP_IPC_LOCK in CapEff of
    /proc/self/status). ``status_text``: that file's content (read when None)."""
    if status_text is None:
        try:
            with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
                status_text = fh.read()
        except OSError:
            return False
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", status_text, re.M)
    return bool(m and (int(m.group(1), 16) >> CAP_IPC_LOCK) & 1)


def probe_memlock() -> int | None:
    """The soft RLIMIT_MEMLOCK in bytes where it binds; None when unlimited, when this process
    holds CAP_IPC_LOCK (root in most containers: mlock ignores the limit then), or not POSIX."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or has_cap_ipc_lock():
        return None
    return int(soft)


def probe_environment(
    environ: Mapping[str, str] | None = None,
    *,
    memlock_bytes: int | None = _UNSET,
    cuda: CudaProbe | None = None,
    cpu_fp16: bool | None = None,
) -> EnvironmentFacts:
    """This machine's facts; each argument replaces one probe (tests force every path with them).

    ``environ``: the environment variables to read (default os.environ). ``memlock_bytes``: the
    RLIMIT_MEMLOCK to assume (None = unlimited). ``cuda``: what torch says about CUDA.
    ``cpu_fp16``: whether oneDNN runs fp16 here (None: probed when a rule needs it).
    """
    env = os.environ if environ is None else environ
    return EnvironmentFacts(
        torch_cuda_arch_list=env.get("TORCH_CUDA_ARCH_LIST"),
        memlock_bytes=probe_memlock() if memlock_bytes is _UNSET else memlock_bytes,
        pin_memory_backend=(env.get("DS_PIN_MEMORY_BACKEND") or "torch").strip().lower(),
        ds_accelerator=(env.get("DS_ACCELERATOR") or "").strip().lower() or None,
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        cuda=probe_cuda() if cuda is None else cuda,
        cpu_fp16=cpu_fp16,
    )


# --- fp16: one answer for the product and the test suite ----------------------------------------


@dataclass(frozen=True)
class Fp16Support:
    """Whether DeepSpeed accepts fp16 on the accelerator a run here would use, and why not."""

    supported: bool
    device: str
    reason: str = ""


def fp16_support(
    facts: EnvironmentFacts | None = None, deepspeed_version: str | None = None, device: str | None = None
) -> Fp16Support:
    """Will ``deepspeed.initialize`` accept an fp16 config on this machine? The same test its
    engine applies (``_do_sanity_check``: "Type fp16 is not supported on your device").

    Used by ``shardkit check`` and by the test suite, which skips exactly the fp16 variants here.
    ``device``: "cpu" or "cuda" (default: the accelerator DeepSpeed picks on this machine).
    """
    from packaging.version import Version

    facts = facts or probe_environment()
    device = device or facts.deepspeed_accelerator
    if device != "cpu":
        # CUDA accepts fp16 from compute capability 7.0 (6.x with DS_ALLOW_DEPRECATED_FP16); every
        # GPU a current torch supports is 7.0+, so the CUDA case is not probed further.
        return Fp16Support(True, device)
    ds = deepspeed_version or installed_versions().get("deepspeed")
    if ds is not None and parse_version(ds, "deepspeed version") < Version(CPU_FP16_PROBE_SINCE):
        return Fp16Support(
            False, "cpu",
            f"deepspeed {ds}'s CPU accelerator refuses fp16 on every CPU (oneDNN fp16 is used from "
            f"{CPU_FP16_PROBE_SINCE}, DeepSpeed PR #7207)",
        )
    ok = facts.cpu_fp16 if facts.cpu_fp16 is not None else probe_cpu_fp16()
    if ok:
        return Fp16Support(True, "cpu")
    return Fp16Support(
        False, "cpu",
        "this CPU has no fp16 support in oneDNN (torch.ops.mkldnn._is_mkldnn_fp16_supported() is False: "
        "it needs AVX512-FP16 or AMX-FP16), so DeepSpeed's CPU accelerator refuses fp16",
    )


# --- TORCH_CUDA_ARCH_LIST: DeepSpeed's own parsing rule ------------------------------------------


def deepspeed_arch_list_error(value: str | None) -> str | None:
    """The exception DeepSpeed >= 0.19.0's JIT builder raises for this TORCH_CUDA_ARCH_LIST, or None
    when it parses. A replay of ``CUDAOpBuilder.compute_capability_args`` (jit_mode): entries split
    on ';' and whitespace, sorted by ``int()`` of every '.'-part (before any '+'), the last one
    given '+PTX', then ``int(major)`` and ``int(minor.split('+')[0])``. So torch's own '9.0a',
    '10.0f' or 'sm_90' fail with ValueError (DeepSpeed PR #7977 made JIT builds read the variable;
    PR #8619, open, would accept the suffixes)."""
    if value is None or not value.strip():
        return None  # unset or blank: DeepSpeed asks the visible GPUs instead
    ccs = [cc.strip() for cc in value.strip().replace(" ", ";").split(";") if cc.strip()]
    try:
        ccs = sorted(ccs, key=lambda cc: tuple(int(part.split("+")[0]) for part in cc.split(".")))
        if not any("+PTX" in cc for cc in ccs):
            ccs[-1] += "+PTX"
        for parts in (cc.split(".") for cc in ccs):
            int(parts[0])
            int(parts[1].split("+")[0])
    except (ValueError, IndexError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


_ARCH_DOTTED = re.compile(r"^(\d+)\.(\d+)[A-Za-z]*(\+PTX)?$")
_ARCH_SM = re.compile(r"^(?:sm_|compute_)(\d+)(\d)[A-Za-z]*$")


def fixed_arch_list(value: str) -> str | None:
    """The same architectures in the plain 'X.Y[+PTX]' form DeepSpeed parses ('9.0a' -> '9.0',
    '8.0;9.0a+PTX' -> '8.0;9.0+PTX'); None when an entry is not recognisable as an architecture."""
    out: list[str] = []
    for cc in (c.strip() for c in value.strip().replace(" ", ";").split(";")):
        if not cc:
            continue
        m = _ARCH_DOTTED.match(cc)
        if m:
            token = f"{int(m.group(1))}.{int(m.group(2))}{m.group(3) or ''}"
        else:
            m = _ARCH_SM.match(cc)
            if not m:
                return None
            token = f"{int(m.group(1))}.{int(m.group(2))}"
        if token not in out:
            out.append(token)
    return ";".join(out) or None


def _export(value: str) -> str:
    return f'export TORCH_CUDA_ARCH_LIST="{value}"' if ";" in value else f"export TORCH_CUDA_ARCH_LIST={value}"


def arch_list_fix(value: str | None) -> str:
    """The one fix shardkit gives for a TORCH_CUDA_ARCH_LIST DeepSpeed cannot parse (the `check`
    finding and a failed op build both say it): the same architectures exported in 'X.Y[+PTX]'
    form ('sm_90' -> 9.0), or, when an entry is not an architecture, what to put there."""
    fixed = fixed_arch_list(value or "")
    fix = _export(fixed) if fixed else "export TORCH_CUDA_ARCH_LIST=<major.minor of your GPU, e.g. 9.0 for H100>"
    return fix + " (or unset it: DeepSpeed then builds for the visible GPUs)"


# --- pinned (mlock'ed) memory --------------------------------------------------------------------


def _elem_bytes(cfg: Mapping[str, Any]) -> int:
    v = deepspeed_view(dict(cfg))
    return 2 if (v.fp16 or v.bf16) else 4


def nvme_param_buffer_bytes(cfg: Mapping[str, Any]) -> int | None:
    """Bytes DeepSpeed mlocks for ZeRO-3 NVMe parameter swapping: offload_param.buffer_count (5)
    buffers of buffer_size (1e8) elements in the parameter dtype (partitioned_param_swapper.py,
    new_cpu_locked_tensor). None when params are not offloaded to NVMe."""
    if deepspeed_view(dict(cfg)).stage != 3:
        return None  # below stage 3 DeepSpeed ignores offload_param (the offload rule says so)
    zero = cfg.get("zero_optimization")
    block = zero.get("offload_param") if isinstance(zero, dict) else None
    if not isinstance(block, dict) or block.get("device") != "nvme":
        return None
    count = as_int(block.get("buffer_count", 5))
    size = as_int(block.get("buffer_size", 100_000_000))
    if count is None or size is None:
        return None
    return count * size * _elem_bytes(cfg)


def nvme_optimizer_buffer_estimate(cfg: Mapping[str, Any]) -> int | None:
    """About how many bytes DeepSpeed mlocks for ZeRO-3 NVMe optimizer swapping, at most, as far as the
    config can say: offload_optimizer.buffer_count (4) buffers of the largest ZeRO sub-group's numel
    in fp32 (OptimizerSwapper -> SwapBufferManager, largest_numel = max(fp16_partitioned_groups_flat_numel)).
    The largest sub-group depends on the model; _create_fp16_sub_groups closes a group at the
    parameter that reaches sub_group_size (1e9), so this bound is exceeded only by one partitioned
    parameter that large. None when the optimizer is not swapped to NVMe."""

    view = deepspeed_view(dict(cfg))
    # below stage 3 an nvme optimizer offload is treated as cpu: no swap buffers
    if view.stage != 3 or view.offload_optimizer.device != "nvme":
        return None
    zero = cfg.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    block = zero.get("offload_optimizer")
    count = as_int((block if isinstance(block, dict) else {}).get("buffer_count", 4))
    sub_group = as_int(zero.get("sub_group_size", 1_000_000_000))
    if count is None or sub_group is None:
        return None
    return count * sub_group * 4


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


# --- evaluating the table's environment rows -----------------------------------------------------


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
    from shardkit.platform.versions import known_bad_table

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


def one_line(finding: Finding) -> str:
    """A finding as the single line a command stops with: key, value, what and why, then the fix."""
    return f"{finding.key}={finding.value!r}: {finding.message} Fix: {finding.fix}"


def require_runnable_here(
    configs: Mapping[str, Mapping[str, Any]],
    *,
    accelerator: bool | None = None,
    facts: EnvironmentFacts | None = None,
) -> list[Finding]:
    """Stop before anything starts when this machine cannot run ``configs`` (name -> DeepSpeed or
    FSDP2 config, run here; ``accelerator``: whether the ranks use a GPU, default what this machine
    has). Raises EnvironmentCheckError with the first error's one line; returns the warnings."""
    facts = facts or probe_environment()
    accelerator = run_has_accelerator(accelerator, facts)
    warnings: list[Finding] = []
    for name, cfg in configs.items():
        engine = "fsdp" if isinstance(cfg.get("fsdp"), dict) else "deepspeed"
        for f in environment_findings(cfg, facts=facts, accelerator=accelerator, engine=engine):
            if f.severity is Severity.ERROR:
                raise EnvironmentCheckError(f"{name}: this machine cannot run it: {one_line(f)}")
            if f not in warnings:
                warnings.append(f)
    return warnings


def version_report(
    cfg: dict[str, Any] | None,
    *,
    deepspeed_version: str | None = None,
    source: str | None = None,
    environment: Any = None,
) -> tuple[dict[str, Any], Report]:
    """What `shardkit versions` shows: installed versions, support status, and the table rows that
    apply (to ``cfg`` when given) as a Report, this machine's environment rows included.

    ``environment``: shardkit.platform.environment.EnvironmentFacts to evaluate instead of probing this
    machine; False leaves the environment rows out.
    """

    installed = installed_versions()
    ds = str(parse_version(deepspeed_version)) if deepspeed_version else installed.get("deepspeed")
    status = support_status({**installed, "deepspeed": ds} if ds else installed)
    subject = f"deepspeed {ds}" + (f" with {source}" if source else "") if ds else "deepspeed (not installed)"
    report = Report(subject=subject)
    if ds:
        report.extend(known_bad_findings(cfg, ds, installed.get("torch")))
    if environment is not False:
        engine = "fsdp" if cfg is not None and config_kind(cfg) == "fsdp" else "deepspeed"
        report.extend(environment_findings(cfg, facts=environment, deepspeed_version=ds, engine=engine))
    data = {
        "installed": installed,
        "deepspeed": ds,
        "support": {
            "range": str(SUPPORTED_DEEPSPEED),
            "supported": status.supported,
            "verified": status.verified,
            "notes": status.notes,
        },
    }
    return data, report
