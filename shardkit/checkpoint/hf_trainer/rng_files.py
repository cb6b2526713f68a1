"""Per-rank RNG files and which of them each rank of a run at another world size reads (``plan_rng_files``):
the Trainer's (``rng_state_<rank>.pth``; ``rng_state.pth`` for one process) and Accelerate's
(``random_states_<process>.pkl``, ``Accelerator.save_state``), one rule for both (``RngFiles`` names them).

``Trainer._load_rng_state`` reads ``rng_state_<rank>.pth`` when it runs distributed and
``rng_state.pth`` without a process group; ``accelerate.checkpointing.load_accelerator_state`` reads
``random_states_<process_index>.pkl`` at every world size, 1 included. A rank without its file keeps the
RNG it was seeded with (Accelerate logs "Could not load random states" at INFO level). Reshard copies the
files a plan keeps; verify reports the ranks a checkpoint-N does not cover.
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
class RngFiles:
    """How one library names its per-rank RNG files and what its loader does without one."""

    rank_file: re.Pattern[str]
    """One rank's file; group 1 is the rank."""
    rank_name: str
    """``rank_name.format(rank)``: the file rank ``rank`` reads."""
    single: str | None
    """The file a one-process run reads instead (None: the per-rank name at every world size)."""
    reader: str
    """Who reads them, for the notes ("the Trainer")."""
    missing: str
    """What that reader does for a rank without a file, for the notes."""


#: ``transformers.Trainer``: ``_save_rng_state`` / ``_load_rng_state``.
TRAINER_RNG = RngFiles(
    RNG_RANK_FILE, "rng_state_{}.pth", RNG_SINGLE_FILE, "the Trainer",
    "The Trainer logs \"Didn't find an RNG file for process N\" (INFO level) and those ranks keep the RNG it seeded "
    "them with (TrainingArguments.seed)")
#: ``accelerate.Accelerator.save_state`` / ``load_state`` (``RNG_STATE_NAME``).
ACCELERATE_RNG = RngFiles(
    re.compile(r"^random_states_(\d+)\.pkl$"), "random_states_{}.pkl", None, "Accelerate's load_state",
    "Accelerate's load_state logs \"Could not load random states\" (INFO level) and those processes keep the RNG "
    "they were seeded with")


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
    files: RngFiles = TRAINER_RNG
    """Whose RNG files these are (the Trainer's or Accelerate's)."""

    def dropped_why(self, world_size: int) -> str:
        """Why ``dropped`` is not carried (one line per file in a ``not_carried`` list)."""
        return f"its rank does not exist at world size {world_size}; no rank would read it"

    def notes(self, world_size: int) -> list[str]:
        out = []
        renamed = [f"{a} -> {b}" for a, b in self.copies if a != b]
        if renamed:
            why = (f"the Trainer reads {self.files.single} when it runs as one process" if world_size == 1
                   else f"the Trainer reads {self.files.rank_name.format('<rank>')} when it runs distributed")
            out.append(f"RNG state renamed: {', '.join(renamed)} ({why})")
        if self.dropped:
            out.append(f"RNG state dropped: {', '.join(self.dropped)} (their ranks do not exist at world size "
                       f"{world_size}; no rank would read them)")
        if self.stray:
            out.append(f"RNG state not carried: {', '.join(self.stray)} (the one-process RNG file, which only a "
                       f"1-process run reads; it lies beside per-rank {self.files.rank_name.format('<rank>')} files, "
                       "which are the ones this checkpoint's ranks saved and the ones carried)")
        if self.absent:
            ranks = ", ".join(str(r) for r in self.absent)
            out.append(
                f"no RNG state for rank(s) {ranks}: they did not exist in the saved run. {self.files.missing}, so "
                "their dropout and sampling draws differ from an uninterrupted run's; no other rank's file is copied "
                "there, since two ranks would then draw the same random numbers"
            )
        return out


def plan_rng_files(names: Iterable[str], world_size: int, files: RngFiles = TRAINER_RNG) -> RngPlan:
    """Which RNG files of a checkpoint holding ``names`` each of ``world_size`` new ranks gets.

    Rank r keeps its own file (``rng_state_<r>.pth``, or ``rng_state.pth`` when the source ran as
    one process and r is 0). At world size 1 rank 0's file becomes ``rng_state.pth``, the name
    ``Trainer._load_rng_state`` reads without a process group (``files.single``; Accelerate has none
    and keeps ``random_states_0.pkl``). Files of ranks beyond the new world size are dropped; new
    ranks beyond the old one get none (their loader then keeps their seeded RNG, see ``RngPlan.notes``).
    """
    names = list(names)
    by_rank: dict[int, str] = {}
    for n in names:
        m = files.rank_file.match(n)
        if m:
            by_rank[int(m.group(1))] = n
    single = files.single
    if single is not None and 0 not in by_rank and single in names:
        by_rank[0] = single

    def target(r: int) -> str:
        return single if world_size == 1 and single is not None else files.rank_name.format(r)

    copies = tuple((by_rank[r], target(r)) for r in range(world_size) if r in by_rank)
    dropped = tuple(by_rank[r] for r in sorted(by_rank) if r >= world_size)
    stray = (single,) if single is not None and single in names and by_rank.get(0) != single else ()
    absent = tuple(r for r in range(world_size) if r not in by_rank) if by_rank else ()
    return RngPlan(copies, dropped, absent, stray, files)
