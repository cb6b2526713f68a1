"""`shardkit config ... --fit`: the least offloading config that fits, tried in order from the fastest.

Each engine has a ladder of settings, from the one that keeps the most on the GPU (fastest) to the one that
offloads the most; the first whose estimate fits both the GPU and the host memory wins. Offloading trades
GPU memory for host memory and PCIe traffic, so a rung further down can fail on the host where an earlier
one failed on the GPU: both are judged at every rung.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from shardkit.estimate.report import Estimate
from shardkit.estimate.units import human


@dataclass(frozen=True)
class Rung:
    """One candidate: the `shardkit config` flags it sets."""

    label: str
    overrides: dict[str, Any] = field(default_factory=dict)


def ladder(kind: str, nvme: bool = False) -> list[Rung]:
    """The candidates for ``shardkit config KIND``, least offloading first (nvme rungs only with --nvme-path)."""
    if kind == "fsdp":
        return [
            Rung("no offload, gathered parameters kept from forward to backward",
                 {"cpu_offload": False, "reshard_after_forward": False}),
            Rung("no offload", {"cpu_offload": False, "reshard_after_forward": True}),
            Rung("CPU offload of parameters, gradients and optimizer state",
                 {"cpu_offload": True, "reshard_after_forward": True}),
        ]
    rungs = [Rung("no offload", {"offload_optimizer": "none", "offload_param": "none"}),
             Rung("optimizer offloaded to the CPU", {"offload_optimizer": "cpu", "offload_param": "none"})]
    if kind == "zero3":
        rungs.append(Rung("optimizer and parameters offloaded to the CPU",
                          {"offload_optimizer": "cpu", "offload_param": "cpu"}))
        if nvme:
            rungs += [Rung("optimizer on NVMe, parameters on the CPU", {"offload_optimizer": "nvme", "offload_param": "cpu"}),
                      Rung("optimizer and parameters on NVMe", {"offload_optimizer": "nvme", "offload_param": "nvme"})]
    return rungs


@dataclass
class FitResult:
    """What was tried, and the first that fits (None when none does)."""

    tried: list[tuple[Rung, Estimate]]
    chosen: int | None

    def summary(self) -> list[str]:
        lines = []
        for i, (rung, est) in enumerate(self.tried):
            mark = "chosen" if i == self.chosen else ("fits" if est.fits() else "does not fit")
            lines.append(f"{rung.label}: {mark}: per GPU {human(est.per_gpu_peak())}, per host {human(est.per_host_peak())}")
        return lines


def find_fit(rungs: list[Rung], estimate_of: Callable[[Rung], Estimate]) -> FitResult:
    """Estimate every rung (so the report shows the whole ladder) and choose the first that fits."""
    tried = [(rung, estimate_of(rung)) for rung in rungs]
    chosen = next((i for i, (_, est) in enumerate(tried) if est.fits()), None)
    return FitResult(tried, chosen)
