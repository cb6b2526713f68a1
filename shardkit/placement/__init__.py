"""Where every tensor training touches is, and where it should be: per-rank records
(``collect_records``, no collective) and the cross-rank preflight (``shardkit.preflight``).

Data flows one way: live objects -> PlacementRecord list -> RankReport -> exchanged through the
c10d store -> PlacementReport (verdict) -> table / JSON / PreflightError.
"""

from __future__ import annotations

from shardkit.placement.collect import collect_records
from shardkit.placement.records import PlacementRecord, RankReport

__all__ = ["PlacementRecord", "RankReport", "collect_records"]
