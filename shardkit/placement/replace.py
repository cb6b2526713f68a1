"""Re-place optimizer state next to its parameters after a checkpoint load.

What torch leaves behind (cases 1, 3 and 4; case 2, a module replaced after ``.to()``, is for the
preflight to catch):
- ``Optimizer.load_state_dict`` moves per-parameter state to the parameter's device *at load
  time*; a model moved afterwards leaves ``exp_avg``/``exp_avg_sq`` on the old device (case 1).
- ``step`` is moved only for fused/capturable groups, judged by the *checkpoint's* flags, so a
  fused optimizer resumed from a non-fused checkpoint (or the reverse) has ``step`` on the wrong
  side (case 3; torch.optim.Optimizer._process_value_according_to_param_policy).
- every other param_group entry is copied verbatim, so tensors a custom optimizer keeps there
  (prodigy-plus-schedule-free's ``running_d_numerator``; prodigyopt's ``d_numerator`` with
  ``fsdp_in_use``) stay on the CPU (case 4). Lightning's ``_optimizer_to_device`` and
  Accelerate's ``load_state`` do not move them either.

``replace_optimizer_state`` fixes all three and returns one ``Move`` per tensor it moved. It only
calls ``tensor.to(device)``: values and dtypes are never changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Iterator, MutableMapping, MutableSequence

from shardkit.placement.deepspeed import zero3_group_partitions
from shardkit.platform.device_rules import TORCH_HYPERPARAMETERS, same_device, step_device

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Move:
    """One tensor re-placed (or, from ``plan_optimizer_moves``, to be re-placed)."""

    name: str
    """Where it lives: ``state[model.0.weight].exp_avg``, ``param_groups[0].running_d_numerator``."""
    from_device: str
    """Device it was on."""
    to_device: str
    """Device it was moved to."""
    bytes: int
    """Size of the tensor (numel * element size)."""


@dataclass(frozen=True)
class StateSlot:
    """A place holding a tensor (or a list/tuple/dict of tensors) a custom optimizer needs on a device.

    ``container[key]`` is replaced by the moved value, so the slot must be a mutable mapping or list.
    """

    name: str
    container: MutableMapping[Any, Any] | MutableSequence[Any]
    key: Hashable
    device: "torch.device"


ExtraState = Callable[["torch.optim.Optimizer"], Iterable[StateSlot]]
DeviceFor = Callable[["torch.Tensor"], "torch.device"]

_EXTRA_STATE: dict[type, list[ExtraState]] = {}


def register_extra_state(optimizer_cls: type, fn: ExtraState | None = None) -> Any:
    """Register ``fn(optimizer) -> Iterable[StateSlot]`` for an optimizer class (and subclasses):
    state outside ``optimizer.state`` and ``param_groups`` (e.g. an attribute dict) that must be
    re-placed too. Usable as a decorator: ``@register_extra_state(MyOpt)``."""

    def _register(f: ExtraState) -> ExtraState:
        _EXTRA_STATE.setdefault(optimizer_cls, []).append(f)
        return f

    return _register(fn) if fn is not None else _register


def _registered_for(optimizer: Any) -> list[ExtraState]:
    out: list[ExtraState] = []
    for cls in type(optimizer).__mro__:
        out += _EXTRA_STATE.get(cls, [])
    return out


def _nbytes(t: "torch.Tensor") -> int:
    return t.numel() * t.element_size()


Setter = Callable[["torch.Tensor"], None]


def _setter(container: Any, key: Any) -> Setter:
    def put(t: "torch.Tensor") -> None:
        container[key] = t

    return put


def _tuple_setter(container: Any, key: Any, i: int) -> Setter:
    # tuples are immutable (betas=(tensor, tensor)): rebuild the tuple in its parent slot
    def put(t: "torch.Tensor") -> None:
        items = list(container[key])
        items[i] = t
        container[key] = type(container[key])(items)

    return put


def _slots(value: Any, container: Any, key: Any, name: str) -> Iterator[tuple[str, Setter, "torch.Tensor"]]:
    """(name, setter, tensor) for every tensor in ``container[key]``, descending into
    lists/tuples/dicts."""
    import torch

    if isinstance(value, torch.Tensor):
        yield name, _setter(container, key), value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _slots(v, value, k, f"{name}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _slots(v, value, i, f"{name}[{i}]")
    elif isinstance(value, tuple):
        for i, v in enumerate(value):
            if isinstance(v, torch.Tensor):
                yield f"{name}[{i}]", _tuple_setter(container, key, i), v


@dataclass
class _Action:
    move: Move
    put: Setter
    tensor: "torch.Tensor"
    target: "torch.device"


def _plan_slot(name: str, put: Setter, tensor: "torch.Tensor", target: "torch.device") -> _Action | None:
    if same_device(tensor.device, target):
        return None
    return _Action(Move(name, str(tensor.device), str(target), _nbytes(tensor)), put, tensor, target)


def _param_names(model: Any) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()} if model is not None else {}


def _plan(
    optimizer: "torch.optim.Optimizer",
    extra_state: ExtraState | Iterable[ExtraState] | None,
    device_for: DeviceFor | None,
    model: Any,
) -> list[_Action]:
    import torch

    partitions: dict[int, list[torch.Tensor]] = {}
    zero3 = zero3_group_partitions(optimizer)
    if zero3 is not None:  # a ZeRO-3 wrapper: re-place its inner optimizer (param_groups empty between steps)
        optimizer, partitions = zero3
    # DeepSpeed's own optimizers keep a tensor step beside the partition it counts for (as the
    # preflight expects, placement.deepspeed._state_records); everyone else follows torch's rule.
    step_beside = zero3 is not None and type(optimizer).__module__.startswith("deepspeed")
    names = _param_names(model)
    where: DeviceFor = device_for or (lambda p: p.device)
    actions: list[_Action] = []
    index = 0
    for gi, group in enumerate(optimizer.param_groups):
        params = list(group["params"]) or partitions.get(gi, [])
        for p in params:
            label = names.get(id(p), str(index))
            index += 1
            state = optimizer.state.get(p)
            if not isinstance(state, dict):
                continue
            pdev = torch.device(where(p))
            for key in list(state):
                target = step_device(pdev, group) if key == "step" and not step_beside else pdev
                for name, put, t in _slots(state[key], state, key, f"state[{label}].{key}"):
                    a = _plan_slot(name, put, t, target)
                    if a:
                        actions.append(a)
        if not params:
            continue
        # A group's tensors are used with its parameters; model parallelism inside one group is
        # not a thing torch optimizers support, so the first parameter speaks for the group.
        gdev = torch.device(where(params[0]))
        for key in list(group):
            if key == "params":
                continue
            target = step_device(gdev, group) if key in TORCH_HYPERPARAMETERS else gdev
            for name, put, t in _slots(group[key], group, key, f"param_groups[{gi}].{key}"):
                a = _plan_slot(name, put, t, target)
                if a:
                    actions.append(a)
    fns: list[ExtraState] = _registered_for(optimizer)
    if callable(extra_state):
        fns.append(extra_state)
    elif extra_state is not None:
        fns.extend(extra_state)
    for fn in fns:
        for slot in fn(optimizer):
            value = slot.container[slot.key]
            for name, put, t in _slots(value, slot.container, slot.key, slot.name):
                a = _plan_slot(name, put, t, torch.device(slot.device))
                if a:
                    actions.append(a)
    return actions


def plan_optimizer_moves(
    optimizer: "torch.optim.Optimizer",
    *,
    extra_state: ExtraState | Iterable[ExtraState] | None = None,
    device_for: DeviceFor | None = None,
    model: Any = None,
) -> list[Move]:
    """What ``replace_optimizer_state`` would move, without touching anything (no allocation):
    ``device_for=lambda p: torch.device("cuda:1")`` answers "where would state go" on any machine."""
    return [a.move for a in _plan(optimizer, extra_state, device_for, model)]


def replace_optimizer_state(
    optimizer: "torch.optim.Optimizer",
    *,
    extra_state: ExtraState | Iterable[ExtraState] | None = None,
    device_for: DeviceFor | None = None,
    model: Any = None,
) -> list[Move]:
    """Move every optimizer tensor to where its parameter says it belongs; return what moved.

    - per-parameter state -> the parameter's device (``device_for(param)`` when given);
    - ``state['step']`` -> the parameter's device for fused/capturable groups, CPU otherwise
      (shardkit.platform.device_rules.step_device, torch's own rule);
    - tensors in ``param_groups`` -> the device of the group's parameters (torch hyperparameters
      such as a tensor ``lr`` follow the ``step`` rule);
    - slots from ``extra_state`` and from ``register_extra_state`` for this optimizer's class.

    A DeepSpeed ZeRO-3 optimizer (``engine.optimizer``) is accepted too: its inner optimizer's state
    follows the fp32 partitions, and each param group's tensors the partition the group steps first
    (``placement.deepspeed.zero3_group_partitions``). DeepSpeed's load places per-partition state itself;
    what it leaves behind is a client optimizer's param_group tensors, copied verbatim from the file.

    ``model`` is only used to name parameters in the returned records. Values and dtypes are never
    changed: each tensor goes through ``tensor.to(device)`` and nothing else.
    """
    actions = _plan(optimizer, extra_state, device_for, model)
    for a in actions:
        a.put(a.tensor.to(a.target))
    return [a.move for a in actions]


def summarize_moves(moves: list[Move]) -> str:
    """One line for logs: how many tensors and bytes went where."""
    if not moves:
        return "optimizer state already in place: nothing moved"
    by: dict[tuple[str, str], list[int]] = {}
    for m in moves:
        by.setdefault((m.from_device, m.to_device), []).append(m.bytes)
    parts = [f"{len(v)} tensor(s), {sum(v) / 2**20:.2f} MiB {src} -> {dst}" for (src, dst), v in sorted(by.items())]
    return "re-placed optimizer state: " + "; ".join(parts)
