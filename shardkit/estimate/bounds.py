"""The range of every number the estimate takes, from a flag or from a config, and the one check that
refuses a number outside it naming where it came from, the value and the range.

The bounds are generous for real models and runs, and small enough that the arithmetic stays exact and
fast and the model description stays small: a typo (``"num_hidden_layers": 1000000000``, ``--params
1e30``) is refused at once instead of running for minutes or ending in an OverflowError. Each bound
says why it is where it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardkit.core.errors import ConfigError, UsageError


@dataclass(frozen=True)
class Bound:
    """The accepted range of one number, and why."""

    low: int
    high: int
    why: str


#: The largest models published hold about 2e12 parameters (dense and MoE); 1e15 is 500 times that.
MAX_PARAMS = Bound(1, 10**15, "500x the largest published model (~2e12 parameters)")
#: The largest training jobs run on about 1e5 GPUs; 2**20 ranks is ten times that.
WORLD_SIZE = Bound(1, 2**20, "ten times the largest training jobs (~1e5 GPUs)")
#: A host holds 4-16 GPUs; 1,024 leaves room for anything scheduled as one host.
GPUS_PER_NODE = Bound(1, 1024, "hosts hold 4-16 GPUs")
MICRO_BATCH = Bound(1, 2**20, "a million sequences per rank per step is past any GPU's memory")
#: Context windows reach 1e7 tokens (2025); 2**30 is a hundred times that.
SEQ_LEN = Bound(1, 2**30, "100x the longest context windows (~1e7 tokens)")
#: GPUs hold up to 288 GB and hosts tens of TiB; a pebibyte is past both.
MEMORY_BYTES = Bound(1, 2**50, "a PiB: past any GPU (<= 288 GB) or host (tens of TiB)")
#: DeepSpeed's own element counts are C ints (its default model persistence threshold is sys.maxsize).
ELEMENTS = Bound(0, 2**63 - 1, "DeepSpeed and torch count elements in 64-bit signed integers")

#: config.json keys that shape a model, and their ranges. The deepest published transformer has 1,000
#: layers (DeepNet); the widest hidden size is ~25,600; vocabularies reach ~262k; MoE models ~400 experts.
MODEL_KEYS: dict[str, Bound] = {
    "num_hidden_layers": Bound(1, 2**16, "65x the deepest published transformer (DeepNet, 1,000 layers)"),
    "hidden_size": Bound(1, 2**20, "40x the widest published model (~25,600)"),
    "intermediate_size": Bound(1, 2**22, "40x the widest published MLP (~100k)"),
    "vocab_size": Bound(1, 2**24, "64x the largest published vocabulary (~262k)"),
    "num_attention_heads": Bound(1, 2**14, "100x the most heads published (128)"),
    "num_key_value_heads": Bound(1, 2**14, "as num_attention_heads"),
    "head_dim": Bound(1, 2**16, "256x the widest published head (256)"),
    "max_position_embeddings": Bound(1, 2**30, "as --seq-len"),
    "num_local_experts": Bound(0, 2**14, "40x the most experts published (~400)"),
    "num_experts": Bound(0, 2**14, "as num_local_experts"),
    "n_routed_experts": Bound(0, 2**14, "as num_local_experts"),
    "moe_intermediate_size": Bound(0, 2**22, "as intermediate_size"),
}
#: Parameter tensors a model may have: DeepSeek-V3 and Kimi K2 have ~50-70k (hundreds of experts x 61
#: layers); 2**18 is about four times that, and keeps the per-tensor arithmetic under a second.
MAX_PARAM_TENSORS = 2**18


def _range(bound: Bound) -> str:
    return f"{bound.low:,} to {bound.high:,}"


def check_flag(value: int | None, flag: str, bound: Bound) -> None:
    """``value`` of ``flag`` within ``bound``; UsageError (exit 2) naming both otherwise (None: not given)."""
    if value is not None and not bound.low <= value <= bound.high:
        raise UsageError(f"{flag} {value}: out of range; accepted {_range(bound)} ({bound.why})")


def check_config_number(value: object, key: str, bound: Bound, source: str) -> int:
    """The whole number at ``key`` of a config, within ``bound``; ConfigError naming the key, the value, the
    file and the range otherwise (a float is taken only when it is whole: 5e8 is 500000000)."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        number = int(value)
    if number is None or not bound.low <= number <= bound.high:
        shown = repr(value) if not isinstance(value, int) or isinstance(value, bool) or abs(value) < 10**30 \
            else f"a {len(str(abs(value)))}-digit number"
        what = "not a whole number" if number is None else "out of range"
        raise ConfigError(f"{source}: {key}={shown}: {what}; accepted {_range(bound)} ({bound.why}). "
                          f"Fix {key} in that file")
    return number


def check_model_config(data: dict[str, object], source: str) -> None:
    """Every shape key of a model's config.json (and of its text_config) within MODEL_KEYS, before
    transformers builds anything from it. Keys set to null are left to transformers' defaults."""
    for prefix, section in (("", data), ("text_config.", data.get("text_config"))):
        if not isinstance(section, dict):
            continue
        for key, bound in MODEL_KEYS.items():
            if section.get(key) is not None:
                check_config_number(section[key], prefix + key, bound, source)
