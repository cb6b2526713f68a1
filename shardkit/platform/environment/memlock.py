"""Locked (mlock'ed) memory: the limit this process has (``probe_memlock``: RLIMIT_MEMLOCK, unless
CAP_IPC_LOCK lifts it) and what a config asks DeepSpeed to lock (the ZeRO-3 NVMe swap buffers).
The known-bad table's memlock rows compare the two (``rows``).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from shardkit.config.view import as_int, deepspeed_view

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
