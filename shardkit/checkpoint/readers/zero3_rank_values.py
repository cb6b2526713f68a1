"""Optimizer values each saved ZeRO-3 rank may keep for itself, outside the partitions (a
Prodigy-style optimizer's D statistics, per-group flags), and what a load at another world size
does with them: every new rank takes rank 0's numbers, with a warning naming each disagreement;
anything else that differs is refused (``check_rank_values``)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from shardkit.checkpoint.readers.zero3_open import zero3_optimizer_sd
from shardkit.checkpoint.zero3.checkpoint import Zero3Checkpoint
from shardkit.core.errors import CheckpointError
from shardkit.platform.dist import all_gather_object, rank_world
from shardkit.storage.torch_load import safe_torch_load


class PerRankValuesWarning(UserWarning):
    """The saved ranks kept different values of an optimizer entry (a Prodigy-style optimizer's D
    statistics, computed from each rank's own partition) and the load is at another world size, so
    every new rank gets one rank's value."""


@dataclass(frozen=True)
class RankDisagreement:
    """One optimizer entry whose saved value is not the same on every source rank."""

    where: str
    """``param_groups[0].d_numerator`` or ``state[sub-group 1].step``."""
    values: list[Any]
    """The value on each source rank (``_MISSING`` where a rank has none)."""

    @property
    def numeric(self) -> bool:
        """Every rank holds a number (or a one-element numeric tensor): one rank's value is a state
        the optimizer really reached, so it can stand in for the others."""
        return all(is_number(v) for v in self.values)

    def render(self, limit: int = 4) -> str:
        shown = ", ".join(f"rank {r}: {_show(v)}" for r, v in enumerate(self.values[:limit]))
        more = f", ... ({len(self.values)} ranks)" if len(self.values) > limit else ""
        return f"{self.where} ({shown}{more})"


_MISSING = object()


def is_number(v: Any) -> bool:
    """A number, or a one-element numeric tensor (what a per-rank value may be and still be kept per rank)."""
    import torch

    if torch.is_tensor(v):
        return v.numel() == 1 and v.dtype != torch.bool and not v.dtype.is_complex
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _show(v: Any) -> str:
    import torch

    if v is _MISSING:
        return "absent"
    if torch.is_tensor(v):
        return repr(v.item()) if v.numel() == 1 else f"tensor of shape {tuple(v.shape)}"
    return repr(v)


def _same(a: Any, b: Any) -> bool:
    import torch

    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        return bool(torch.equal(a, b)) or (a.is_floating_point() and bool(
            torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN on every rank is agreement
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False


def rank_local_values(ckpt: Zero3Checkpoint) -> list[dict[str, Any]]:
    """For each source rank, ``{where: value}`` of what the optimizer may keep per rank outside the
    partitions: every param_groups entry but ``params``, and every non-partition state entry of at
    most one element. (Larger non-partition tensors are refused by ``resume_zero3_state`` when
    they would move to another partition.) Reads only the pickled structure of each file.

    Collective under a process group: each rank reads every world-th source file and the small
    dicts are gathered, so no rank opens all N files (N x N opens at 1,024 ranks otherwise)."""
    rank, world = rank_world()
    mine = {i: _local_values(ckpt, path) for i, path in enumerate(ckpt.optim_files) if i % world == rank}
    merged: dict[int, dict[str, Any]] = {}
    for part in all_gather_object(mine):
        merged.update(part)
    return [merged[i] for i in range(len(ckpt.optim_files))]


def _local_values(ckpt: Zero3Checkpoint, path: Any) -> dict[str, Any]:
    import torch

    inner = zero3_optimizer_sd(safe_torch_load(path, mmap=True), path)["optimizer_state_dict"]
    values: dict[str, Any] = {}
    for g, group in enumerate(inner.get("param_groups") or []):
        values.update({f"param_groups[{g}].{k}": v.clone() if torch.is_tensor(v) else v
                       for k, v in group.items() if k != "params"})
    for j, entry in sorted((inner.get("state") or {}).items()):
        # clone: the gather pickles them, and a view would carry its whole mapped storage
        values.update({f"state[sub-group {j}].{k}": v.clone() if torch.is_tensor(v) else v for k, v in entry.items()
                       if k not in ckpt.state_keys and not (torch.is_tensor(v) and v.numel() > 1)})
    return values


def rank_disagreements(per_rank: list[dict[str, Any]]) -> list[RankDisagreement]:
    """The entries whose value is not the same on every rank, in the order rank 0 lists them."""
    keys = list(dict.fromkeys(k for values in per_rank for k in values))
    found = []
    for key in keys:
        values = [r.get(key, _MISSING) for r in per_rank]
        if any(v is _MISSING for v in values) or not all(_same(values[0], v) for v in values[1:]):
            found.append(RankDisagreement(key, values))
    return found


def check_rank_values(ckpt: Zero3Checkpoint, world_size: int) -> str | None:
    """At another world size every new rank takes rank 0's param_groups and non-partition state
    (``optim_dict``): fine for what every source rank kept alike (hyperparameters, ``step``).
    Where the source ranks disagree, warn (``PerRankValuesWarning``) naming the entries, each
    rank's value and what was chosen, and return that text; refuse where no one value can do.
    At the saved world size each rank reads its own file and nothing is lost: returns None."""
    if world_size == ckpt.world_size:
        return None
    found = rank_disagreements(rank_local_values(ckpt))
    if not found:
        return None
    # Numbers (Prodigy's d, d_numerator, running_d_* ...) are statistics each rank computed from its
    # own partition; a partition of the new layout mixes elements of several old ones, so no rule
    # maps them. Any one rank's value is a state the optimizer really reached (a sum or mean of
    # them is one no rank ever had: d is a running maximum, d_numerator a sum over elements), and it
    # keeps re-estimating them from the new partition as it steps: rank 0's is taken, with a warning.
    # Anything else that differs (a flag such as a schedule-free optimizer's train_mode, a string,
    # an entry only some ranks have, tensors of several elements) says the ranks are in different
    # states; one rank's value would be wrong for the others' elements, so the load is refused.
    refused = [d for d in found if not d.numeric]
    if refused:
        raise CheckpointError(
            f"{ckpt.tag_dir}: the {ckpt.world_size} saved ranks hold different optimizer values that are not numbers: "
            + "; ".join(d.render() for d in refused[:5]) + ("; ..." if len(refused) > 5 else "")
            + f". At world size {world_size} every rank would take rank 0's, wrong for the elements the other ranks "
            f"held. Resume at the saved world size {ckpt.world_size}, where each rank reads its own file")
    message = (f"{ckpt.tag_dir}: the optimizer kept per-rank values the {ckpt.world_size} saved ranks do not share: "
               + "; ".join(d.render() for d in found[:8]) + ("; ..." if len(found) > 8 else "")
               + f". Loading at world size {world_size}, every rank resumes with rank 0's value (statistics computed "
               "from a saved rank's partition cannot be mapped to the new partitions; the optimizer re-estimates them "
               f"as it steps). To keep each rank's own, resume at world size {ckpt.world_size}")
    if rank_world()[0] == 0:  # once for the job, not once per rank
        warnings.warn(message, PerRankValuesWarning, stacklevel=3)
    return message
