"""Each ZeRO-1/2 rank file checked against its place: the partition rank r must hold at the save's world size.

DeepSpeed's ZeRO-1/2 rank files are equal in size but for the last rank's tail padding, and rank r's file does
not say it is rank r's except through what it records of its own partition (``runtime/zero/stage_1_and_2.py``):

- ``param_slice_mappings[g]``: every parameter of param group g that overlaps the partition, with where its
  fragment starts in the partition and how many elements it has (``fragment_address(start, numel)``, from
  ``tensor_fragment.get_hp_fragment_mapping``);
- ``group_paddings[g]``: the zero padding at the end of the partition, which only a partition reaching past the
  group's data holds (DeepSpeed pads the last rank's).

A rank file copied over another, or two renamed into each other's place, parse, agree on every size and cover
every tensor exactly once, and the reader would hand one rank's masters and moments out as another's: wrong
weights, exit 0. ``check_group_places`` compares what each parsed file records with what rank r must hold,
and names the rank whose partition the file holds instead. The cost is one pass over the parameters each
rank overlaps (found by bisection), never parameters x ranks.
"""

from __future__ import annotations

import bisect
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from shardkit.core.errors import CheckpointError

#: Candidate ranks tried when naming the rank whose partition a misplaced file holds.
_CANDIDATES = 64
#: Fragments named per partition in a message.
_SHOWN = 2

_Fragments = dict[str, tuple[Any, Any]]
"""Parameter name -> (start in the partition, elements), as ``param_slice_mappings`` records them."""

_FIX = ("No tensor was read and nothing written. Re-copy the tag folder from the save, every rank's optimizer file under its "
        "own name (zero_pp_rank_R_... is the file rank R wrote)")


def check_group_places(tag_dir: Path, g: int, partition: int, total: int,
                       params: Sequence[tuple[str, tuple[int, ...], int]],
                       ranks: Mapping[int, tuple[Path, int, Any]], world: int) -> None:
    """Raise CheckpointError naming the first rank file of ``ranks`` (rank -> its path, ``group_paddings[g]`` and
    ``param_slice_mappings``) that does not hold rank r's partition of param group ``g``: buffer elements
    ``[r * partition, (r + 1) * partition)`` of a group whose data (``params``: name, shape, offset, in buffer
    order) ends at ``total``. A file without ``param_slice_mappings`` (not written by DeepSpeed 0.19 or
    shardkit) is checked by its padding alone."""
    starts = [at for _, _, at in params]
    for r, (path, padding, mappings) in ranks.items():
        recorded = _recorded(mappings, g)
        want = _expected(params, starts, partition, r)
        if recorded is not None and recorded != want:
            holder = _holder(recorded, params, starts, partition, world)
            where = (f"holds rank {holder}'s partition of param group {g}, not rank {r}'s" if holder is not None else
                     f"holds a partition of param group {g} that no rank of this {world}-rank save holds")
            why = (f"the file is a copy of rank {holder}'s, or the rank files were renamed or swapped"
                   if holder is not None else "a rank file of another save, or a damaged one")
            raise CheckpointError(
                f"{path}: {where}: its param_slice_mappings[{g}] places {_few(recorded)}; rank {r}'s partition "
                f"(elements {r * partition:,}..{(r + 1) * partition:,} of the group's flat buffer) holds "
                f"{_few(want)}. {why[0].upper()}{why[1:]}: read as rank {r}'s, its fp32 masters and Adam moments "
                f"would be handed out as other parameters'. {_FIX}")
        held = min(max(total - r * partition, 0), partition)
        if padding != partition - held:
            raise CheckpointError(
                f"{path}: group_paddings[{g}] is {padding}, but rank {r} of {world} holds {partition - held} padding "
                f"elements of param group {g} (partitions of {partition:,} elements, the group's data ends at element "
                f"{total:,}: only a partition reaching past it is padded): the file is another rank's (copied or "
                f"swapped) or from another save. {_FIX}")


def _recorded(mappings: Any, g: int) -> _Fragments | None:
    """What the file records for group ``g`` (None: no ``param_slice_mappings`` to check)."""
    if not isinstance(mappings, (list, tuple)) or len(mappings) <= g or not isinstance(mappings[g], dict):
        return None
    return {str(name): (getattr(frag, "start", None), getattr(frag, "numel", None))
            for name, frag in mappings[g].items()}


def _expected(params: Sequence[tuple[str, tuple[int, ...], int]], starts: list[int], partition: int,
              r: int) -> _Fragments:
    """The fragments rank ``r``'s partition holds, as DeepSpeed records them."""
    lo, hi = r * partition, (r + 1) * partition
    out: _Fragments = {}
    i = max(bisect.bisect_right(starts, lo) - 1, 0)
    while i < len(params) and params[i][2] < hi:
        name, shape, at = params[i]
        first, last = max(at, lo), min(at + math.prod(shape), hi)
        if first < last:
            out[name] = (first - lo, last - first)
        i += 1
    return out


def _holder(recorded: _Fragments, params: Sequence[tuple[str, tuple[int, ...], int]], starts: list[int],
            partition: int, world: int) -> int | None:
    """The rank whose partition ``recorded`` describes (tried among the ranks its first parameter overlaps)."""
    offsets = {name: (at, math.prod(shape)) for name, shape, at in params}
    first = next((name for name in recorded if name in offsets), None)
    if first is None or not partition:
        return None
    at, numel = offsets[first]
    ranks = range(at // partition, min(world, (at + max(numel, 1) - 1) // partition + 1))
    return next((q for q in ranks[:_CANDIDATES] if _expected(params, starts, partition, q) == recorded), None)


def _few(fragments: _Fragments) -> str:
    if not fragments:
        return "no parameter"
    shown = [f"{name!r} at element {start} ({numel} elements)" for name, (start, numel) in
             list(fragments.items())[:_SHOWN]]
    more = f" and {len(fragments) - _SHOWN} more" if len(fragments) > _SHOWN else ""
    return ", ".join(shown) + more
