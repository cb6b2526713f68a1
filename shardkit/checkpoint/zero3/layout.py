"""ZeRO-3's partition arithmetic and the model-states keys that are DeepSpeed's own: the facts the
reader, reshard, in-process resume and consolidate share, written once.
"""

from __future__ import annotations

import math

from shardkit.storage.torch_zip import Segment

#: DeepSpeed's default ``zero_optimization.sub_group_size`` (runtime/zero/config.py).
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000

#: Entries DeepSpeed itself writes into each ``*_model_states.pt`` (``DeepSpeedEngine.
#: _common_checkpoint_state``, 0.19.8); everything else there is the caller's ``client_state``.
DEEPSPEED_MODEL_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version", "sparse_tensor_module_names",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info",
})


def partition_numel(numel: int, world_size: int) -> int:
    """Elements each rank holds of a parameter with ``numel`` elements (ZeRO-3 pads to this)."""
    return math.ceil(numel / world_size)


def rank_range(rank: int, partition: int, numel: int) -> tuple[int, int]:
    """Elements ``[start, stop)`` of a flattened parameter of ``numel`` elements that ``rank`` holds
    when each rank holds ``partition`` of them (without the last rank's zero padding)."""
    start = min(rank * partition, numel)
    return start, min(start + partition, numel)


def client_state_keys(model_state: dict[str, object]) -> list[str]:
    """The entries of a ``*_model_states.pt`` dict that are the caller's ``client_state``."""
    return sorted(k for k in model_state if k not in DEEPSPEED_MODEL_KEYS)


def append_segment(segs: list[Segment], path: str | None, offset: int, nbytes: int) -> None:
    """Add ``nbytes`` from ``path`` at ``offset`` (zeros when ``path`` is None) to ``segs``, merged into
    the last segment when it continues it: a new rank's flat tensor is a few long runs, not one per piece."""
    last = segs[-1] if segs else None
    if last is not None and last.path == path and (path is None or last.offset + last.nbytes == offset):
        segs[-1] = Segment(path, last.offset, last.nbytes + nbytes)
    else:
        segs.append(Segment(path, offset, nbytes))
