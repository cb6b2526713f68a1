"""A tolerant, typed reading of a DeepSpeed config dict: just the facts the rules and the version
table need, each with the key path it came from. Values of the wrong type read as "unknown"
(None) here; the schema rule reports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def is_auto(value: Any) -> bool:
    """DeepSpeed's config base drops exactly the string "auto" (DeepSpeedConfigModel.__init__)."""
    return isinstance(value, str) and value == "auto"


def as_int(value: Any) -> int | None:
    """An int (or a float with an integral value, as JSON often gives), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def as_number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


_STAGE_ADAPTER: Any = None


def zero_stage(value: Any) -> int | None:
    """The ZeRO stage DeepSpeed makes of ``value``, or None when it refuses it.

    DeepSpeedZeroConfig.stage is a pydantic ``ZeroStageEnum(int, Enum)`` in lax mode, which coerces:
    true -> 1, false -> 0, "1" -> 1, "3.0" -> 3, 3.0 -> 3 (checked against DeepSpeed 0.19.8 and
    pydantic 2.13). The same pydantic rule is applied here, so the offload rules judge the stage
    DeepSpeed will really run (``"stage": true`` with offload_param is stage 1: the offload is ignored).
    """
    global _STAGE_ADAPTER
    if isinstance(value, int) and not isinstance(value, bool):
        return value if 0 <= value <= 3 else None
    if _STAGE_ADAPTER is None:
        import enum

        from pydantic import TypeAdapter

        class _Stage(int, enum.Enum):  # the values of deepspeed's ZeroStageEnum
            disabled = 0
            optimizer_states = 1
            gradients = 2
            weights = 3

        _STAGE_ADAPTER = TypeAdapter(_Stage)
    try:
        return int(_STAGE_ADAPTER.validate_python(value))
    except Exception:  # pydantic.ValidationError, or a value pydantic cannot even look at
        return None


def enabled(section: Any) -> bool:
    """A {"enabled": true} block (DeepSpeed's fp16/bf16 style) that is switched on."""
    return isinstance(section, dict) and section.get("enabled") is True


@dataclass
class OffloadView:
    """One offload block (offload_optimizer or offload_param)."""

    key: str
    """Key path of the block, e.g. zero_optimization.offload_param."""
    device: str = "none"
    """none | cpu | nvme; "none" also when the block is absent or the value unusable."""
    present: bool = False
    """The block (or a deprecated cpu_offload* flag) is in the config."""
    pin_memory: bool | None = None
    """Explicit pin_memory, or None when the key is absent (the default then depends on the release)."""
    nvme_path: Any = None
    """The nvme_path value as written (None when absent)."""
    ratio: float | None = None
    """offload_optimizer.ratio (partial offload), None when absent."""
    deprecated_key: str | None = None
    """Set when the device came from zero_optimization.cpu_offload / cpu_offload_param."""

    @property
    def active(self) -> bool:
        return self.device in ("cpu", "nvme")


@dataclass
class DeepSpeedView:
    """What the rules need to know about a DeepSpeed config."""

    raw: dict[str, Any]
    stage: int | None = 0
    """ZeRO stage (0 when zero_optimization is absent; None when unreadable)."""
    offload_optimizer: OffloadView = field(default_factory=lambda: OffloadView("zero_optimization.offload_optimizer"))
    offload_param: OffloadView = field(default_factory=lambda: OffloadView("zero_optimization.offload_param"))
    fp16: bool = False
    bf16: bool = False
    bf16_key: str = "bf16"
    """"bf16" or its alias "bfloat16", whichever the config uses."""
    gradient_clipping: float | None = None
    optimizer_type: str | None = None
    """optimizer.type as written; None when there is no optimizer section (a client optimizer then)."""
    has_optimizer_section: bool = False

    @property
    def clipping_on(self) -> bool:
        return bool(self.gradient_clipping and self.gradient_clipping > 0)

    @property
    def offload_any(self) -> bool:
        return self.offload_optimizer.active or self.offload_param.active

    @property
    def active_offloads(self) -> list[OffloadView]:
        return [o for o in (self.offload_optimizer, self.offload_param) if o.active]


def _offload(zero: dict[str, Any], name: str, deprecated_flag: str) -> OffloadView:
    view = OffloadView(f"zero_optimization.{name}")
    block = zero.get(name)
    if isinstance(block, dict):
        view.present = True
        dev = block.get("device", "none")
        view.device = dev if isinstance(dev, str) and dev in OFFLOAD_DEVICES else "none"
        pin = block.get("pin_memory")
        view.pin_memory = pin if isinstance(pin, bool) else None
        view.nvme_path = block.get("nvme_path")
        view.ratio = as_number(block.get("ratio"))
    elif zero.get(deprecated_flag) is True:
        # DeepSpeed maps the deprecated boolean to a default offload block on the CPU.
        view.present = True
        view.device = "cpu"
        view.deprecated_key = f"zero_optimization.{deprecated_flag}"
    return view


def deepspeed_view(cfg: dict[str, Any]) -> DeepSpeedView:
    """Read the facts out of a DeepSpeed config dict without failing on bad values."""
    view = DeepSpeedView(raw=cfg)
    zero = cfg.get("zero_optimization")
    if isinstance(zero, bool):  # the deprecated `"zero_optimization": true` form means stage 1
        view.stage = 1 if zero else 0
        zero = {}
    elif isinstance(zero, dict):
        view.stage = zero_stage(zero.get("stage", 0))
    else:
        zero = {}
        view.stage = 0 if "zero_optimization" not in cfg else None
    view.offload_optimizer = _offload(zero, "offload_optimizer", "cpu_offload")
    view.offload_param = _offload(zero, "offload_param", "cpu_offload_param")
    view.fp16 = enabled(cfg.get("fp16"))
    if "bf16" in cfg:
        view.bf16 = enabled(cfg.get("bf16"))
    elif "bfloat16" in cfg:
        view.bf16, view.bf16_key = enabled(cfg.get("bfloat16")), "bfloat16"
    view.gradient_clipping = as_number(cfg.get("gradient_clipping"))
    opt = cfg.get("optimizer")
    if isinstance(opt, dict):
        view.has_optimizer_section = True
        t = opt.get("type")
        view.optimizer_type = t if isinstance(t, str) else None
    return view
