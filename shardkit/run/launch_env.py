"""The launching shell's variables against the launch `shardkit launch` is about to start.

Every launcher (torchrun, the deepspeed launcher, accelerate launch) gives each rank its own RANK,
WORLD_SIZE and LOCAL_RANK, so values exported in the shell (a leftover from another job step, a
Slurm script's own arithmetic) never reach the ranks; they are named as a warning, because code run
before the launcher, and the user reading them, see another world size. ``CUDA_VISIBLE_DEVICES``
does reach the ranks: "" (or "-1") hides every GPU, so the run is a CPU run and a config asking for
the accelerator fails there (the fp16 row says what fails; this says why the GPUs are gone); a list
shorter than the ranks a node starts leaves the last ranks without a device ("invalid device
ordinal" deep in torch), an error before anything starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from shardkit.core.findings import Finding, Severity

_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def launch_env_findings(
    environ: Mapping[str, str],
    *,
    launcher: str,
    world_size: int | None,
    per_node: int | None,
    gpus: int,
    gpus_present: bool | None = None,
    config_failed: bool = False,
) -> list[Finding]:
    """Findings about ``environ`` (the launching shell's) for a launch of ``world_size`` ranks,
    ``per_node`` of them on this node; ``gpus``: CUDA devices this process sees (0 on a CPU run).

    Hidden GPUs (``CUDA_VISIBLE_DEVICES=""``) are named where it matters: the node has GPU devices
    (``gpus_present``, default: probed from ``/dev``), or the config already failed its checks
    (``config_failed``: an fp16 row on a CPU run, say, whose cause may be the hiding). A deliberate
    CPU run on a CPU-only machine gets no row."""
    out: list[Finding] = []
    exported = {k: environ[k] for k in _RANK_VARIABLES if k in environ}
    if exported:
        shown = " ".join(f"{k}={v}" for k, v in exported.items())
        clash = ""
        if "WORLD_SIZE" in exported and world_size is not None and exported["WORLD_SIZE"].strip() != str(world_size):
            clash = f" (WORLD_SIZE says {exported['WORLD_SIZE'].strip()}, the launch starts {world_size} rank(s))"
        out.append(Finding(
            Severity.WARNING, "environment", shown,
            f"{shown} exported in the launching shell{clash}: {launcher} gives every rank its own values, so the "
            "ranks never see these; a script or tool run outside the launcher (and shardkit's own reshard/convert, "
            "which split their work by RANK/WORLD_SIZE) would",
            f"unset {' '.join(exported)} before `shardkit launch` (a leftover from another job step?)",
            rule="launch.env.rank-variables",
        ))
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    present = gpu_devices_present() if gpus_present is None else gpus_present
    if visible is not None and visible.strip() in ("", "-1") and (present or config_failed):
        out.append(Finding(
            Severity.WARNING, "CUDA_VISIBLE_DEVICES", visible,
            f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU from the ranks: this is a CPU run (gloo), and a "
            "config or script that asks for the accelerator (fp16, nccl, .cuda()) fails there",
            "unset CUDA_VISIBLE_DEVICES (or list the GPUs) to train on GPUs; keep it only for a deliberate CPU run",
            rule="launch.env.gpus-hidden",
        ))
    elif visible and gpus > 0 and per_node is not None and per_node > len(_entries(visible)):
        listed = _entries(visible)
        out.append(Finding(
            Severity.ERROR, "CUDA_VISIBLE_DEVICES", visible,
            f"CUDA_VISIBLE_DEVICES={visible!r} shows {len(listed)} GPU(s) but {launcher} starts {per_node} rank(s) on "
            f"this node: the ranks with LOCAL_RANK {len(listed)}..{per_node - 1} ask for devices that do not exist "
            "('invalid device ordinal' inside torch.cuda.set_device / nccl)",
            f"start {len(listed)} rank(s) per node, or list {per_node} GPUs in CUDA_VISIBLE_DEVICES",
            rule="launch.env.too-few-gpus",
        ))
    return out


def per_node_ranks(launcher: str, launcher_args: Sequence[str]) -> int | None:
    """Ranks the launcher starts on this node, when its arguments say (an integer)."""
    names = ("--nproc_per_node", "--nproc-per-node") if launcher == "torchrun" else ("--num_gpus", "--num-gpus")
    args = list(launcher_args)
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in names:
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            return int(value) if value.isdigit() else None
    return None


def gpu_devices_present() -> bool:
    """Whether this node has GPU device files (NVIDIA's, or AMD's ROCm ``/dev/kfd``), whatever
    CUDA_VISIBLE_DEVICES hides from this process."""
    dev = Path("/dev")
    return (dev / "nvidiactl").exists() or (dev / "kfd").exists() or any(dev.glob("nvidia[0-9]*"))


def _entries(visible: str) -> list[str]:
    return [e for e in (part.strip() for part in visible.split(",")) if e]
