"""This machine's facts, probed once: ``EnvironmentFacts`` (what the known-bad table's environment
rows are evaluated against) and ``probe_environment``, which gathers them from the probes of
``accelerator`` and ``memlock``. Every probe can be replaced: ``probe_environment(environ=...,
memlock_bytes=..., cuda=..., cpu_fp16=...)`` takes the facts instead of asking the machine, so
tests force each path. ``run_has_accelerator`` is the one answer to "does a run here have one".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from shardkit.platform.environment.accelerator import CudaProbe, probe_cuda
from shardkit.platform.environment.memlock import probe_memlock

_UNSET: Any = object()


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
