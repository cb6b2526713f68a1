"""Placement records for plain torch training: model, optimizer, GradScaler, LR scheduler.

Rules (and the upstream behaviour they come from):
- parameters and buffers belong on the compute device;
- per-parameter optimizer state follows its parameter's *expected* device, except ``step``, which
  torch keeps on the CPU unless the group is fused or capturable (shardkit.platform.device_rules.step_device;
  see resume.replace);
- tensors inside ``param_groups`` (Prodigy's ``d_numerator``...) are never moved by
  ``Optimizer.load_state_dict``, so each is checked: torch's own hyperparameter
  tensors (``lr``, ``betas`` ...) follow the ``step`` rule, anything else the parameters' device;
- GradScaler's ``_scale``/``_growth_tracker`` live where the scaled outputs are: the compute device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from shardkit.placement import records as R
from shardkit.placement.expected import ExpectedDevices
from shardkit.placement.tensor_records import iter_tensors, tensor_record
from shardkit.platform.device_rules import TORCH_HYPERPARAMETERS, step_device

if TYPE_CHECKING:
    import torch


def module_records(
    module: "torch.nn.Module", rank: int, expected: ExpectedDevices, prefix: str = "", skip: Iterable[str] = ()
) -> list[R.PlacementRecord]:
    """Parameters (and their grads) and buffers of ``module`` against the compute device."""
    skipped = set(skip)
    out: list[R.PlacementRecord] = []
    why = "compute device: the rank's accelerator (LOCAL_RANK)" if expected.compute != "cpu" else "compute device: no accelerator, cpu"
    for name, p in module.named_parameters():
        if name in skipped:
            continue
        out.append(tensor_record(rank, prefix + name, R.PARAM, p, expected.compute, why))
        if p.grad is not None:
            out.append(tensor_record(rank, f"{prefix}{name}.grad", R.GRAD, p.grad, expected.compute, why))
    for name, b in module.named_buffers():
        if name in skipped or b is None:
            continue
        out.append(tensor_record(rank, prefix + name, R.BUFFER, b, expected.compute, "buffers are used in forward: compute device"))
    return out


def optimizer_records(
    optimizer: "torch.optim.Optimizer",
    rank: int,
    param_device: dict[int, str],
    default_device: str,
    why: str = "",
    prefix: str = "optimizer",
    state_index: dict[int, str] | None = None,
) -> list[R.PlacementRecord]:
    """State and param_group tensors of a torch optimizer.

    ``param_device`` maps ``id(param)`` to that parameter's expected device; ``state_index`` maps
    ``id(param)`` to the label used in names (default: its position across param_groups, as in
    ``optimizer.state_dict()``).
    """
    import torch

    out: list[R.PlacementRecord] = []
    index: dict[int, str] = dict(state_index or {})
    pos = 0
    group_of: dict[int, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            index.setdefault(id(p), str(pos))
            group_of[id(p)] = group
            pos += 1
    for p, state in optimizer.state.items():
        if not isinstance(state, dict):
            continue
        pdev = param_device.get(id(p), default_device)
        group = group_of.get(id(p), {})
        label = index.get(id(p), "?")
        for key, value in state.items():
            for sub, t in iter_tensors(value, ""):
                name = f"{prefix}.state[{label}].{key}{sub}"
                if key == "step":
                    dev = str(step_device(torch.device(pdev), group))
                    reason = "fused/capturable: step on the parameter's device" if dev == pdev and dev != "cpu" else (
                        "foreach/for-loop optimizers keep step on cpu (a device scalar costs a sync per step)"
                        if dev == "cpu" else "fused/capturable: step on the parameter's device")
                    out.append(tensor_record(rank, name, R.OPTIMIZER_STEP, t, dev, reason))
                else:
                    out.append(tensor_record(rank, name, R.OPTIMIZER_STATE, t, pdev, why or "optimizer state follows its parameter"))
    for gi, group in enumerate(optimizer.param_groups):
        params = group.get("params", [])
        gdev = param_device.get(id(params[0]), default_device) if params else default_device
        for key, value in group.items():
            if key == "params":
                continue
            for sub, t in iter_tensors(value, ""):
                name = f"{prefix}.param_groups[{gi}].{key}{sub}"
                if key in TORCH_HYPERPARAMETERS:
                    dev = str(step_device(torch.device(gdev), group))
                    reason = "torch hyperparameter tensor: same rule as step"
                else:
                    # Optimizer.load_state_dict copies these verbatim: it never moves them.
                    dev, reason = gdev, "param_group tensor used with the group's parameters; load_state_dict never moves it"
                out.append(tensor_record(rank, name, R.PARAM_GROUP, t, dev, reason))
    return out


def scaler_records(scaler: Any, rank: int, compute: str) -> list[R.PlacementRecord]:
    """GradScaler: its scale and growth tracker are created lazily on the scaled outputs' device."""
    out: list[R.PlacementRecord] = []
    if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
        return out
    why = "GradScaler tensors live with the scaled loss: compute device"
    for attr in ("_scale", "_growth_tracker"):
        t = getattr(scaler, attr, None)
        if t is not None:
            out.append(tensor_record(rank, f"scaler.{attr.lstrip('_')}", R.GRAD_SCALER, t, compute, why))
    return out


def scheduler_records(scheduler: Any, rank: int, optimizer: Any, compute: str) -> list[R.PlacementRecord]:
    """Tensors an LR scheduler holds (``base_lrs`` when lr is a tensor); they follow the ``step`` rule."""
    import torch

    out: list[R.PlacementRecord] = []
    if scheduler is None:
        return out
    group = optimizer.param_groups[0] if optimizer is not None and optimizer.param_groups else {}
    dev = str(step_device(torch.device(compute), group))
    for key, value in vars(scheduler).items():
        if key in ("optimizer",) or key.startswith("__"):
            continue
        for sub, t in iter_tensors(value, ""):
            out.append(tensor_record(rank, f"lr_scheduler.{key}{sub}", R.LR_SCHEDULER, t, dev, "scheduler tensors follow the lr/step rule"))
    return out


def collect_torch(
    model: "torch.nn.Module | None",
    optimizer: Any,
    scaler: Any,
    lr_scheduler: Any,
    rank: int,
    expected: ExpectedDevices,
) -> list[R.PlacementRecord]:
    """All records for plain torch training on one rank."""
    out: list[R.PlacementRecord] = []
    if model is not None:
        out += module_records(model, rank, expected)
    if optimizer is not None:
        out += optimizer_records(optimizer, rank, {}, expected.compute)
    out += scaler_records(scaler, rank, expected.compute)
    out += scheduler_records(lr_scheduler, rank, optimizer, expected.compute)
    return out
