"""Where every tensor training touches is, and where it should be: per-rank records
(``collect_records``, no collective) and the cross-rank preflight (``shardkit.preflight``).

Modules: ``records`` (the plain-data rows), ``tensor_records`` (one tensor -> one record),
``expected`` and ``zero_attrs`` (where each tensor belongs), ``torch_state``, ``deepspeed``,
``fsdp`` (the records of each engine), ``collect`` (one rank's RankReport), ``summary`` (what a rank
ships to rank 0: its placement judged locally, in a few hundred bytes), ``verdict`` and ``report``
(the cross-rank judgement and its renderings), ``fixes`` (what a user does about each kind of
misplaced tensor), ``preflight`` (the collective), ``snapshot`` and ``observed`` (recording a live
run, judging a recording offline) and ``replace`` (re-placing optimizer state after a checkpoint load).

Data flows one way: live objects -> PlacementRecord list -> RankReport -> judged on each rank, a
summary exchanged through the c10d store -> PlacementReport (verdict) -> table / JSON / PreflightError.
"""

from __future__ import annotations

from shardkit.placement.collect import collect_records
from shardkit.placement.records import PlacementRecord, RankReport

__all__ = ["PlacementRecord", "RankReport", "collect_records"]
