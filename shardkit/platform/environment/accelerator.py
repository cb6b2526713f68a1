"""What torch can use on this machine: is it a CUDA build, does it reach a GPU (``probe_cuda``), and
does oneDNN run fp16 on this CPU (``probe_cpu_fp16``, DeepSpeed's CPU accelerator test). Each probe
runs once per process (cached) and imports torch only when its answer needs it: a CPU or ROCm build
of torch is recognised from torch/version.py without importing torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache


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
