"""Which tensor goes into which file: ``save_pretrained``'s split (huggingface_hub's
``split_state_dict_into_shards_factory``, transformers 5.24) re-done from sizes alone.

Tensors are taken in the model's state-dict order; one larger than the limit gets a shard of its
own, and a tensor that would tip the current shard over the limit starts a new one. One shard is
``model.safetensors`` without an index; more are ``model-0000k-of-0000n.safetensors`` with
``model.safetensors.index.json``.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardkit.core.errors import UsageError

#: ``PreTrainedModel.save_pretrained``'s default ``max_shard_size`` (transformers 5.24).
DEFAULT_MAX_SHARD_SIZE = "50GB"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}


def parse_shard_size(text: str) -> int:
    """``5GB``/``500MB``/``50KB`` (decimal units, as huggingface_hub's ``parse_size_to_int``) or bytes."""
    s = text.strip()
    unit = s[-2:].upper()
    try:
        value = float(s[:-2]) * _UNITS[unit] if unit in _UNITS else float(s)
    except ValueError:
        value = -1.0
    if value < 1:
        raise UsageError(f"--max-shard-size {text!r}: expected a size like 5GB, 500MB or 50KB (or a byte count), as "
                         "save_pretrained's max_shard_size")
    return int(value)


@dataclass(frozen=True)
class Shard:
    filename: str
    names: tuple[str, ...]
    nbytes: int


def plan_shards(sizes: dict[str, int], max_shard_size: int) -> list[Shard]:
    """Split ``{name: bytes}`` (in write order) into shards of at most ``max_shard_size`` bytes."""
    groups: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes.items():
        if size > max_shard_size:
            groups.append([name])
            continue
        if current and current_size + size > max_shard_size:
            groups.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        groups.append(current)
    if len(groups) <= 1:
        names = tuple(groups[0]) if groups else ()
        return [Shard(SINGLE_FILE, names, sum(sizes[n] for n in names))]
    n = len(groups)
    return [Shard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(g), sum(sizes[x] for x in g))
            for i, g in enumerate(groups)]
