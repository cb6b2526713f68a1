"""Which DeepSpeed rank files a manifest's world size needs and which of them it lists (verify's
rank-coverage check, kept apart so verify stays one concern: the manifest against the files)."""

from __future__ import annotations

import re

from shardkit.storage.manifest import Manifest

RANK_NAME = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d{1,9})_mp_rank_\d+_(optim|model)_states\.pt$")
#: Missing ranks named one by one; beyond that one finding counts the rest.
_MISSING_RANKS_SHOWN = 5


def rank_pattern(kind: str, rank: int) -> str:
    """The file-name pattern of rank ``rank``'s ``kind`` (optim/model) states file."""
    return rf"^{'(bf16_)?' if kind == 'optim' else ''}zero_pp_rank_{rank}_mp_rank_\d+_{kind}_states\.pt$"


def missing_rank_files(m: Manifest) -> list[tuple[str, int, list[int]]]:
    """(kind, how many ranks lack a ``kind`` states file, the first few of them) for the per-rank
    DeepSpeed files the manifest's world size needs. One pass over the listed files: the cost
    follows what the manifest lists, never the world size it claims."""
    if m.engine != "deepspeed" or not m.zero_stage:
        return []
    kinds = ("optim", "model") if m.zero_stage == 3 else ("optim",)
    present: dict[str, set[int]] = {k: set() for k in kinds}
    for entry in m.files:
        match = RANK_NAME.match(entry.path.rsplit("/", 1)[-1])
        if match and match.group(2) in present and int(match.group(1)) < m.world_size:
            present[match.group(2)].add(int(match.group(1)))
    out = []
    for kind in kinds:
        have = present[kind]
        count = m.world_size - len(have)
        if count == 0:
            continue
        first: list[int] = []
        r = 0
        while len(first) < _MISSING_RANKS_SHOWN and r < m.world_size:  # <= len(have) + shown steps
            if r not in have:
                first.append(r)
            r += 1
        out.append((kind, count, first))
    return out
