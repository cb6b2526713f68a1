"""Expected devices, derived from the config, the engine and this rank's accelerator.

Never a literal "cuda": the compute device is ``shardkit.platform.device_rules.accelerator_device()``
(``<accelerator>:<LOCAL_RANK>``, ``cpu`` on DeepSpeed's CPU accelerator / gloo), and every offload
target comes from the config keys that choose it, so the same rules hold on CUDA, XPU, NPU and CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from shardkit.config.view import deepspeed_view
from shardkit.platform.device_rules import zero3_first_cpu_subgroup, zero3_offload_ratio


@dataclass(frozen=True)
class ExpectedDevices:
    """Where each class of tensor belongs on one rank."""

    compute: str
    """The rank's accelerator (``cuda:1``) or ``cpu``: parameters used in forward, buffers, activations."""
    param_shard: str
    """ZeRO-3 ``ds_tensor`` / FSDP2 local shard: ``cpu`` with param offload, else ``compute``."""
    optimizer: str
    """fp32 master partitions, optimizer state and gradient partitions: ``cpu`` with optimizer offload."""
    param_shard_why: str = ""
    """The config key (and value) that decided ``param_shard``."""
    optimizer_why: str = ""
    """The config key (and value) that decided ``optimizer``."""
    offload_ratio: float = 1.0
    """ZeRO-3 ``offload_optimizer.ratio`` as DeepSpeed reads it: roughly the fraction of fp32 sub-groups
    on the CPU (exactly: ``platform.device_rules.zero3_first_cpu_subgroup``). 1.0 wherever DeepSpeed
    ignores the ratio (no optimizer offload) or refuses it (stages 0-2: its config check)."""
    optimizer_offloaded: bool = False
    """``offload_optimizer.device`` is cpu or nvme: the inner optimizer is DeepSpeed's CPU optimizer."""
    param_nvme: bool = False
    """ZeRO-3 ``offload_param.device=nvme``: partitions may be swapped out to disk."""
    optimizer_nvme: bool = False
    """ZeRO-3 ``offload_optimizer.device=nvme``: fp32 partitions and states are swapped to disk."""

    @property
    def partial_offload(self) -> bool:
        """ZeRO-3 optimizer offload with ``ratio < 1``: sub-groups are split between the two sides."""
        return self.optimizer_offloaded and self.offload_ratio < 1.0

    def first_cpu_subgroup(self, count: int) -> int:
        """Index of the first of ``count`` ZeRO-3 sub-groups whose fp32 partition is on the CPU
        (``count`` when none is: no optimizer offload, or ratio 0)."""
        if not self.optimizer_offloaded:
            return count
        return zero3_first_cpu_subgroup(self.offload_ratio, count)

    def _split(self, count: int) -> str:
        first = self.first_cpu_subgroup(count)
        gpu = "none" if first == 0 else f"0-{first - 1}" if first > 1 else "0"
        cpu = "none" if first == count else f"{first}-{count - 1}" if count - first > 1 else str(first)
        return (f"{self.optimizer_why}, ratio={self.offload_ratio:g} over {count} sub-group(s): DeepSpeed keeps "
                f"sub-groups {gpu} on the accelerator and {cpu} on cpu (first cpu sub-group = "
                f"int((1 - {self.offload_ratio:g}) * {count}) = {first}, stage3.py _create_fp32_partitions)")

    def fp32_subgroup(self, index: int, count: int) -> tuple[str, str]:
        """Device and reason for ZeRO-3 fp32 sub-group ``index`` of ``count``.

        Mirrors DeepSpeed's partial offload (stage3.py ``_create_fp32_partitions``): sub-group ``i``
        goes to the CPU when ``i >= int((1 - ratio) * count)``, the rest stay on the accelerator.
        """
        if self.partial_offload:
            side = "cpu" if index >= self.first_cpu_subgroup(count) else self.compute
            return side, f"{self._split(count)}; this is sub-group {index}"
        return self.optimizer, self.optimizer_why

    def inner_state(self, k: int, count: int) -> tuple[str, str]:
        """Device and reason for ``state[k]`` of the ZeRO-3 inner optimizer, counted as ``state`` is
        (the order its partitions were first stepped), of ``count`` sub-groups.

        Without partial offload the inner optimizer steps every sub-group, so ``state[k]`` is
        sub-group ``k``. With ``ratio < 1`` it is DeepSpeedCPUAdam and steps only the CPU sub-groups
        (``_optimizer_step``, stage3.py:1249-1258; the accelerator ones go to a torch AdamW,
        ``backup_optimizer``, stage3.py:313-326): its ``state[k]`` is sub-group ``first_cpu + k``.
        """
        if not self.partial_offload:
            return self.fp32_subgroup(k, count)
        first = self.first_cpu_subgroup(count)
        dev, why = self.fp32_subgroup(first + k, count)
        return dev, (f"DeepSpeedCPUAdam steps only the cpu sub-groups and numbers its state from the first of "
                     f"them, so state[{k}] is sub-group {first + k}. {why}")


def torch_expected(compute: str) -> ExpectedDevices:
    """Plain torch training: everything on the compute device (``step`` follows its own rule)."""
    why = "the rank's accelerator (LOCAL_RANK)" if compute != "cpu" else "no accelerator: cpu"
    return ExpectedDevices(compute=compute, param_shard=compute, optimizer=compute, param_shard_why=why, optimizer_why=why)


def deepspeed_expected(config: Mapping[str, Any], compute: str) -> ExpectedDevices:
    """Expected devices for a DeepSpeed config dict (the JSON the engine was built from).

    The config is read by ``shardkit.config.view.deepspeed_view``, the same reading the static
    checks use, so a float stage (``3.0``), the deprecated ``cpu_offload``/``cpu_offload_param``
    flags and ``"auto"`` devices (dropped by DeepSpeed: no offload) mean the same thing to the
    preflight as to ``shardkit check``.
    """
    view = deepspeed_view(dict(config))
    stage = view.stage or 0  # None: unreadable, and DeepSpeed would refuse it anyway
    opt, par = view.offload_optimizer, view.offload_param
    opt_dev = opt.device if stage >= 1 else "none"
    par_dev = par.device if stage == 3 else "none"

    if opt_dev in ("cpu", "nvme"):
        optimizer = "cpu"
        # Stage 1/2 treat nvme as cpu (stage_1_and_2.py only checks `device != none`).
        optimizer_why = f"{opt.deprecated_key}=true" if opt.deprecated_key else f"{opt.key}.device={opt_dev}"
    else:
        optimizer = compute
        optimizer_why = "no optimizer offload: the rank's accelerator" if compute != "cpu" else "no optimizer offload; no accelerator: cpu"
    if par_dev in ("cpu", "nvme"):
        param_shard = "cpu"
        param_why = f"{par.deprecated_key}=true" if par.deprecated_key else f"{par.key}.device={par_dev}"
    else:
        param_shard = compute
        param_why = "no param offload: the rank's accelerator" if compute != "cpu" else "no param offload; no accelerator: cpu"
    # DeepSpeed reads the ratio only where it offloads the optimizer at stage 3 (stage3.py:1100 builds
    # subgroup_to_device under `if self.offload_optimizer`); stages 0-2 refuse a ratio < 1 in their
    # config check, and a value DeepSpeed refuses never reaches an engine: 1.0 then.
    ratio = 1.0
    if stage == 3 and opt_dev in ("cpu", "nvme"):
        zero = view.raw.get("zero_optimization")
        block = zero.get("offload_optimizer") if isinstance(zero, dict) else None
        raw = block.get("ratio", 1.0) if isinstance(block, dict) else 1.0
        parsed = zero3_offload_ratio(raw)
        ratio = parsed if parsed is not None else 1.0
    return ExpectedDevices(
        compute=compute,
        param_shard=param_shard,
        optimizer=optimizer,
        param_shard_why=param_why,
        optimizer_why=optimizer_why,
        offload_ratio=ratio,
        optimizer_offloaded=opt_dev in ("cpu", "nvme"),
        param_nvme=par_dev == "nvme",
        optimizer_nvme=opt_dev == "nvme" and stage == 3,
    )


def fsdp_expected(cpu_offload: bool, compute: str, why: str) -> ExpectedDevices:
    """FSDP2: CPUOffloadPolicy keeps sharded params, their grads and the optimizer state on the CPU."""
    if cpu_offload:
        return ExpectedDevices(compute=compute, param_shard="cpu", optimizer="cpu", param_shard_why=why, optimizer_why=why)
    where = "the rank's accelerator" if compute != "cpu" else "no accelerator: cpu"
    return ExpectedDevices(
        compute=compute, param_shard=compute, optimizer=compute, param_shard_why=f"{why}: {where}", optimizer_why=f"{why}: {where}"
    )
