"""The Trainer's per-rank RNG files (``rng_state_<rank>.pth``; ``rng_state.pth`` for one process) and
which of them each rank of a run at another world size reads (``plan_rng_files``).

``Trainer._load_rng_state`` reads ``rng_state_<rank>.pth`` when it runs distributed and
``rng_state.pth`` without a process group; a rank without its file keeps the RNG the Trainer seeded
it with. Reshard copies the files a plan keeps; verify reports the ranks a checkpoint-N does not cover.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

#: One rank's RNG state file, as the Trainer names it when it runs distributed.
RNG_RANK_FILE = re.compile(r"^rng_state_(\d+)\.pth$")
#: The RNG state file of a one-process run.
RNG_SINGLE_FILE = "rng_state.pth"


@dataclass(frozen=True)
class RngPlan:
    """What happens to the Trainer's per-rank RNG files when the rank count changes."""

    copies: tuple[tuple[str, str], ...]
    """(source file, name in the new checkpoint) for every new rank that gets its old rank's file."""
    dropped: tuple[str, ...]
    """Source files no rank of the new run reads (their rank does not exist there)."""
    absent: tuple[int, ...]
    """New ranks with no file: the Trainer keeps the RNG it seeded them with."""
    stray: tuple[str, ...] = ()
    """``rng_state.pth`` beside per-rank files (a one-process run saved into the same folder): not copied."""

    def notes(self, world_size: int) -> list[str]:
        out = []
        renamed = [f"{a} -> {b}" for a, b in self.copies if a != b]
        if renamed:
            why = ("the Trainer reads rng_state.pth when it runs as one process" if world_size == 1
                   else "the Trainer reads rng_state_<rank>.pth when it runs distributed")
            out.append(f"RNG state renamed: {', '.join(renamed)} ({why})")
        if self.dropped:
            out.append(f"RNG state dropped: {', '.join(self.dropped)} (their ranks do not exist at world size "
                       f"{world_size}; no rank would read them)")
        if self.stray:
            out.append(f"RNG state not carried: {', '.join(self.stray)} (the one-process RNG file, which only a "
                       "1-process run reads; it lies beside per-rank rng_state_<rank>.pth files, which are the "
                       "ones this checkpoint's ranks saved and the ones carried)")
        if self.absent:
            ranks = ", ".join(str(r) for r in self.absent)
            out.append(
                f"no RNG state for rank(s) {ranks}: they did not exist in the saved run. The Trainer logs \"Didn't "
                "find an RNG file for process N\" (INFO level) and those ranks keep the RNG it seeded them with "
                "(TrainingArguments.seed), so their dropout and sampling draws differ from an uninterrupted run's; "
                "no other rank's file is copied there, since two ranks would then draw the same random numbers"
            )
        return out


def plan_rng_files(names: Iterable[str], world_size: int) -> RngPlan:
    """Which RNG files of a checkpoint holding ``names`` each of ``world_size`` new ranks gets.

    Rank r keeps its own file (``rng_state_<r>.pth``, or ``rng_state.pth`` when the source ran as
    one process and r is 0). At world size 1 rank 0's file becomes ``rng_state.pth``, the name
    ``Trainer._load_rng_state`` reads without a process group. Files of ranks beyond the new
    world size are dropped; new ranks beyond the old one get none (the Trainer then keeps their
    seeded RNG, see ``RngPlan.notes``).
    """
    by_rank: dict[int, str] = {}
    for n in names:
        m = RNG_RANK_FILE.match(n)
        if m:
            by_rank[int(m.group(1))] = n
    if 0 not in by_rank and RNG_SINGLE_FILE in names:
        by_rank[0] = RNG_SINGLE_FILE
    target = (lambda r: RNG_SINGLE_FILE) if world_size == 1 else (lambda r: f"rng_state_{r}.pth")
    copies = tuple((by_rank[r], target(r)) for r in range(world_size) if r in by_rank)
    dropped = tuple(by_rank[r] for r in sorted(by_rank) if r >= world_size)
    stray = (RNG_SINGLE_FILE,) if RNG_SINGLE_FILE in names and by_rank.get(0) != RNG_SINGLE_FILE else ()
    absent = tuple(r for r in range(world_size) if r not in by_rank) if by_rank else ()
    return RngPlan(copies, dropped, absent, stray)
