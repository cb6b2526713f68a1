"""Where tensors belong: the single source of device rules shared by preflight and resume.

Expected devices come from the accelerator torch reports and ``LOCAL_RANK``, never from a literal
"cuda", so the same rules hold on CUDA, XPU, NPU ... and on CPU-only machines (gloo).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch


def local_rank() -> int:
    """This process's index on its node, as set by torchrun / the deepspeed launcher."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def accelerator_device(rank: int | None = None) -> "torch.device":
    """The device this rank computes on: ``<accelerator>:<LOCAL_RANK>``, or ``cpu`` without one."""
    import torch

    idx = local_rank() if rank is None else rank
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None:
        return torch.device("cpu")
    count = torch.accelerator.device_count()
    # CUDA_VISIBLE_DEVICES remaps indices: LOCAL_RANK counts visible devices, not physical ones.
    return torch.device(acc.type, idx % count if count else 0)


# param_group entries torch's own optimizers accept as tensors. Their placement follows `step`: a
# tensor lr/betas is meant for fused/capturable kernels, which read it on the parameter's device.
# Any other tensor in a param_group (Prodigy's running_d_numerator ...) belongs with the parameters.
TORCH_HYPERPARAMETERS = frozenset(
    {"lr", "initial_lr", "max_lr", "min_lr", "betas", "eps", "weight_decay", "momentum", "dampening",
     "lr_decay", "alpha", "beta1", "beta2"}
)


def step_device(param_device: "torch.device", group: Mapping[str, Any]) -> "torch.device":
    """Where ``state['step']`` belongs for a parameter in ``group``.

    torch keeps ``step`` on the CPU for the default (for-loop / foreach) optimizers, because a
    device scalar would cost a host sync every step, but fused and capturable kernels read it on
    the parameter's device (torch.optim.Optimizer._process_value_according_to_param_policy).
    """
    import torch

    if group.get("fused") or group.get("capturable"):
        return param_device
    return torch.device("cpu")


def zero3_first_cpu_subgroup(ratio: float, subgroups: int) -> int:
    """Index of the first ZeRO-3 fp32 sub-group DeepSpeed puts on the CPU under
    ``offload_optimizer`` with ``ratio``: sub-groups ``[0, first)`` keep their fp32 partition (and
    Adam state) on the accelerator, ``[first, subgroups)`` go to the CPU.

    DeepSpeed 0.19.8 ``runtime/zero/stage3.py:1100-1108`` (``_create_fp32_partitions``)::

        for i in range(sub_group_size):          # here: the number of sub-groups
            if i >= int((1 - self.partial_offload) * sub_group_size): -> 'cpu'
            else: -> get_accelerator()._name

    The same float expression is evaluated here, so the rounding is DeepSpeed's: ``(1 - 0.9) * 10``
    is 0.999..., so ratio 0.9 over 10 sub-groups keeps *none* on the accelerator, and with a single
    sub-group every ratio above 0 offloads everything. ``ratio`` 1.0 (the default) gives 0: all on
    the CPU; 0.0 gives ``subgroups``: none on the CPU.
    """
    first = int((1 - ratio) * subgroups)
    return min(max(first, 0), subgroups)


def zero3_offload_ratio(value: Any) -> float | None:
    """``offload_optimizer.ratio`` as DeepSpeed 0.19.8 reads it, or None where it refuses the value.

    The field is ``ratio: float = Field(1.0, ge=0.0, le=1.0)`` (``runtime/zero/offload_config.py:99``),
    a pydantic float in lax mode: ``"0.5"`` is 0.5 and ``true`` is 1.0; NaN, strings that are not
    numbers and values outside [0, 1] are refused. The same rule is applied here so the preflight
    splits sub-groups by the ratio DeepSpeed really uses.
    """
    import math

    if isinstance(value, bool):
        number: float | None = float(value)
    elif isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    else:
        number = None
    if number is None or math.isnan(number) or not 0.0 <= number <= 1.0:
        return None
    return number


def same_device(a: "torch.device", b: "torch.device") -> bool:
    """Device equality where ``cuda`` means ``cuda:<current>`` is not assumed: both must be explicit.

    ``cpu`` and ``cpu:0`` are the same place; accelerator devices compare type and index.
    """
    if a.type != b.type:
        return False
    if a.type in ("cpu", "meta"):
        return True
    return (a.index or 0) == (b.index or 0)


def compute_device_from_tensors(
    bytes_by_device: Mapping[str, int], local_rank: int | None, accelerator_count: int
) -> str | None:
    """The compute device a plain torch run really uses, judged from where its parameters are.

    - parameters on an accelerator: the launcher's ``LOCAL_RANK`` picks the index when one is set
      (torchrun/deepspeed give every rank its own device), else the accelerator device holding the
      most bytes - so a head left on the CPU by ``model.to(device)`` then ``model.head = ...`` is
      the odd one out (a module replaced after ``.to()``);
    - parameters on the CPU only: ``cpu`` - a model deliberately kept on the CPU of a GPU host is
      healthy (an H100 run showed the old "an accelerator exists" rule failing it);
    - nothing (or only ``meta``, which is never a compute device): ``None``, the caller decides.
    """
    seen = {d: n for d, n in bytes_by_device.items() if not d.startswith("meta")}
    accel = {d: n for d, n in seen.items() if not d.startswith("cpu")}
    if accel:
        kind = max(accel.items(), key=lambda kv: (kv[1], kv[0]))[0].split(":")[0]
        if local_rank is not None and accelerator_count > 0:
            return f"{kind}:{local_rank % accelerator_count}"
        dev = max(accel.items(), key=lambda kv: (kv[1], kv[0]))[0]
        return dev if ":" in dev else f"{dev}:0"
    return "cpu" if seen else None


def module_compute_device(model: Any, optimizer: Any = None) -> str:
    """``compute_device_from_tensors`` over a live model's (or optimizer's) parameters; falls back to
    ``accelerator_device()`` when there is nothing to judge from."""
    import torch

    sizes: dict[str, int] = {}
    params = list(model.parameters()) if model is not None else [
        p for g in getattr(optimizer, "param_groups", []) for p in g.get("params", [])
    ]
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        key = str(local.device)
        sizes[key] = sizes.get(key, 0) + local.numel() * local.element_size()
    launched = "LOCAL_RANK" in os.environ
    count = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    dev = compute_device_from_tensors(sizes, local_rank() if launched else None, count)
    return dev if dev is not None else str(accelerator_device())
