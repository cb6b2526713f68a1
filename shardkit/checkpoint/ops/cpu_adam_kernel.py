"""Restore the Adam step state that DeepSpeed's CPU Adam kernels keep outside every checkpoint.

DeepSpeed's CPU Adam kernels (``DeepSpeedCPUAdam``, and ``FusedAdam`` on the CPU accelerator, whose
``multi_tensor_adam`` calls the same ``ds_adam_step``) keep ``beta1**step`` and ``beta2**step`` in a
C++ ``Adam_Optimizer`` object (``csrc/includes/cpu_adam.h``, ``IncrementStep``), not in the torch
optimizer state. In one process they are built up by float32 multiplication, one factor per step
(``_betta2_t *= _betta2``); a process that starts at step ``s`` sets them with ``std::pow(beta,
s)``, computed in double and rounded to float. The two differ in the last bit for some steps
(beta2 = 0.999: ``0.9970031`` by three multiplications, ``0.997003`` by ``pow(0.999, 3)``), so the
bias correction of the first step after a resume differs, and with it about half of the fp32
master elements (by one ulp), although every tensor DeepSpeed saves (fp32 masters, exp_avg,
exp_avg_sq, step) was restored bit for bit. ``engine.load_checkpoint`` has the same gap.

The object has no getter or setter, so the only way to give it the state an uninterrupted run
has is to replay the kernel's own step sequence: call it for steps ``1 .. step`` with empty
tensors (it updates the powers, then has no element to touch), in the order the optimizer step
visits the ZeRO-3 sub-groups. After step 1 the powers equal ``beta`` whatever the object held
before (``pow(beta, 1)`` and ``1.0 * beta`` are both exact), so the replay lands on the values an
uninterrupted process computed. About 6 us per step on a 2-core CPU (a million steps: ~6 s).

The CUDA ``FusedAdam`` kernel computes ``pow(beta, step)`` on every call and needs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from shardkit.core.errors import CheckpointError

if TYPE_CHECKING:
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine


@dataclass
class KernelReplay:
    """What ``restore_cpu_adam_kernel_state`` did to one kernel."""

    kernel: str
    """The kernel object, e.g. ``DeepSpeedCPUAdam opt_id 0`` or ``FusedAdam CPU kernel (adamw mode)``."""
    step: int
    """The step its beta powers now correspond to (the optimizer state's ``step``)."""
    calls: int
    """Kernel calls made (one per step; repeats within a step are no-ops in the kernel and skipped)."""


@dataclass
class _Unit:
    """One kernel call per optimizer step (a ZeRO-3 sub-group, or one tensor of a plain optimizer),
    listed in the order the optimizer's ``step()`` makes the calls."""

    key: tuple[Any, ...]
    label: str
    step: int
    betas: tuple[float, float]
    call: Callable[[int], None]


def restore_cpu_adam_kernel_state(target: "DeepSpeedEngine | torch.optim.Optimizer") -> list[KernelReplay]:
    """Bring the beta powers inside DeepSpeed's CPU Adam kernels to the loaded optimizer step.

    ``target``: a ZeRO-3 engine (its sub-groups are replayed in the order its optimizer step visits
    them), or a ``DeepSpeedCPUAdam`` / CPU ``FusedAdam`` used without an engine (each tensor of
    each param group in order, as ``DeepSpeedCPUAdam.step`` calls the kernel; ``FusedAdam`` calls
    it once per group, which this matches when a group's tensors share one step count and dtype,
    as DeepSpeed's flat partitions do). Call it on every
    rank after the optimizer state is loaded: ``load_checkpoint_resharded`` does, and so does every
    ``engine.load_checkpoint`` of an engine guarded by ``resume_zero3.guard_plain_loads``; after
    an unguarded ``engine.load_checkpoint`` or ``optimizer.load_state_dict`` call it yourself. Returns one entry
    per kernel replayed; empty when the optimizer keeps no such state (torch optimizers, CUDA
    FusedAdam, a checkpoint at step 0).
    """
    if hasattr(target, "zero_optimization_stage"):
        stage = target.zero_optimization_stage()
        if stage != 3:
            raise CheckpointError(
                f"restore_cpu_adam_kernel_state: this engine runs ZeRO stage {stage}; only stage 3 engines are "
                "handled (their sub-group step order is known). For another stage pass the CPU Adam optimizer "
                "itself, engine.optimizer.optimizer, once you have checked it steps one tensor per param group"
            )
        return _replay(_zero3_units(target.optimizer))  # type: ignore[union-attr]  # an engine: hasattr above
    return _replay(_optimizer_units(target))


def _optimizer_units(inner: Any) -> list[_Unit]:
    units = []
    for group in inner.param_groups:
        for p in group["params"]:
            step = inner.state.get(p, {}).get("step")
            unit = _unit(inner, group, int(step)) if step is not None else None
            if unit is not None:
                units.append(unit)
    return units


def _zero3_units(opt: Any) -> list[_Unit]:
    """One unit per sub-group, with the optimizer object that steps it (DeepSpeed's ``_optimizer_step``)."""
    units = []
    for j, flat in enumerate(opt.fp32_partitioned_groups_flat):
        inner = opt.optimizer
        backup = getattr(opt, "backup_optimizer", None)
        if getattr(opt, "offload_optimizer", False) and backup is not None and opt.subgroup_to_device[j] != "cpu":
            inner = backup  # offload ratio < 1: this sub-group stays on the accelerator
        step = inner.state.get(flat, {}).get("step")
        if step is None:
            continue
        group = inner.param_groups[opt.sub_group_to_group_id[j]]
        unit = _unit(inner, group, int(step))
        if unit is not None:
            units.append(unit)
    return units


def _unit(inner: Any, group: dict[str, Any], step: int) -> _Unit | None:
    """The kernel call ``inner.step()`` makes for one fp32 partition, or None when it keeps no state."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    beta1, beta2 = (float(b) for b in group["betas"])
    lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
    bias_correction = bool(group.get("bias_correction", True))
    empty = torch.empty(0, dtype=torch.float32)

    if isinstance(inner, DeepSpeedCPUAdam):
        # per-instance kernel object, keyed by opt_id (DeepSpeedCPUAdam.step -> adam_update)
        def call(k: int) -> None:
            inner.ds_opt_adam.adam_update(inner.opt_id, k, lr, beta1, beta2, eps, wd, bias_correction,
                                          empty, empty, empty, empty)

        return _Unit(("cpu_adam", inner.opt_id), f"DeepSpeedCPUAdam opt_id {inner.opt_id}", step, (beta1, beta2), call)

    if isinstance(inner, FusedAdam) and get_accelerator().device_name() == "cpu":
        from deepspeed.ops.adam.fused_adam import multi_tensor_applier

        # one process-wide kernel object per mode (csrc/cpu/adam/fused_adam.cpp: optimizer_id = mode)
        mode = int(inner.adam_w_mode)

        def call(k: int) -> None:
            multi_tensor_applier(inner.multi_tensor_adam, inner._dummy_overflow_buf, [[empty], [empty], [empty], [empty]],
                                 lr, beta1, beta2, eps, k, mode, int(bias_correction), wd)

        name = "adamw" if mode else "adam"
        return _Unit(("fused_adam_cpu", mode), f"FusedAdam CPU kernel ({name} mode)", step, (beta1, beta2), call)
    return None


def _replay(units: list[_Unit]) -> list[KernelReplay]:
    done: dict[tuple[Any, ...], KernelReplay] = {}
    last: dict[tuple[Any, ...], tuple[int, tuple[float, float]]] = {}
    # A unit whose previous unit on the same kernel has the same betas and step is skipped at every
    # step below anyway: drop it once here, so a model with dozens of sub-groups costs one Python
    # iteration per kernel per step, not one per sub-group per step.
    kept: list[_Unit] = []
    prev: dict[tuple[Any, ...], tuple[int, tuple[float, float]]] = {}
    for u in units:
        if prev.get(u.key) != (u.step, u.betas):
            kept.append(u)
        prev[u.key] = (u.step, u.betas)
    units = kept
    for k in range(1, max((u.step for u in units), default=0) + 1):
        for u in units:
            if k > u.step:
                continue
            # A second call with the same step and betas returns early in IncrementStep: skip it.
            if last.get(u.key) == (k, u.betas):
                continue
            u.call(k)
            last[u.key] = (k, u.betas)
            entry = done.setdefault(u.key, KernelReplay(kernel=u.label, step=0, calls=0))
            entry.step, entry.calls = k, entry.calls + 1
    return list(done.values())
