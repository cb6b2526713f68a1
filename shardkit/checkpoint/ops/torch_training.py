"""Save and resume plain torch / Accelerate-style training: model, optimizer, GradScaler, LR
scheduler and RNG, atomically, loaded back in the right order and re-placed.

Order on resume, and why:
1. verify the checkpoint against its manifest (a truncated file is named, never unpickled);
2. model weights, into the model where it already is (``load_state_dict`` copies in place);
3. optimizer, loaded with ``map_location='cpu'`` (no accelerator memory spike, no every-rank-on-
   cuda:0); state an optimizer keeps in a narrower dtype than its parameter (prodigy-plus-schedule-
   free's bfloat16 ``p0``/``s``) cast back from the dtype torch widened it to
   (``restore_state_dtypes``); then ``replace_optimizer_state``: state next to its parameter,
   ``step`` by torch's fused/capturable rule, param_group tensors moved (the cases in
   shardkit.placement.replace);
4. LR scheduler after the optimizer (its state refers to the optimizer's lrs);
5. GradScaler (plain numbers: scale, growth tracker; device-free but must be restored);
6. RNG last, so nothing in between consumes random numbers.

``Optimizer.load_state_dict`` silently replaces the constructor's ``fused``/``capturable``/``lr``
with the checkpoint's; ``resume_training`` says so (warning + note) and can keep the
constructor's values instead (``keep_constructor=("fused",)``).
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from shardkit.config.loading import config_digest
from shardkit.core.errors import CheckpointError
from shardkit.placement.replace import DeviceFor, ExtraState, Move, replace_optimizer_state, summarize_moves
from shardkit.platform.dist import rank_world
from shardkit.storage.atomic import atomic_save
from shardkit.storage.staged_save import atomic_checkpoint
from shardkit.storage.torch_load import safe_torch_load
from shardkit.storage.verify import check_resumable_distributed

if TYPE_CHECKING:
    import torch

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "lr_scheduler.pt"
SCALER_FILE = "scaler.pt"
EXTRA_FILE = "extra.pt"
RNG_FILE = "rng_state_{rank}.pt"

#: param_group entries whose checkpoint value silently replaces the constructor's on load.
WATCHED_GROUP_KEYS = ("fused", "capturable", "lr")


class ResumeOverrideWarning(UserWarning):
    """The checkpoint's optimizer settings replaced the ones the optimizer was constructed with."""


@dataclass
class ResumeResult:
    """What ``resume_training`` restored."""

    tag_dir: str
    """The checkpoint directory loaded."""
    step: int | None
    """Training step recorded at save time."""
    moves: list[Move] = field(default_factory=list)
    """Optimizer tensors re-placed after loading."""
    notes: list[str] = field(default_factory=list)
    """Things the user should know (overridden constructor settings, RNG not restored ...)."""
    extra: Any = None
    """The ``extra`` object given to ``save_training``, if any."""


def rng_state() -> dict[str, Any]:
    """Python, numpy (when installed), torch CPU and accelerator RNG states, as weights_only-safe data."""
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():  # pragma: no cover - GPU only
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of ``rng_state``."""
    import torch

    if "python" in state:
        v = state["python"]
        random.setstate((v[0], tuple(v[1]), v[2]))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():  # pragma: no cover - GPU only
        torch.cuda.set_rng_state_all(state["cuda"])


def save_training(
    root: str | Path,
    *,
    model: "torch.nn.Module",
    optimizer: "torch.optim.Optimizer | None" = None,
    scaler: Any = None,
    lr_scheduler: Any = None,
    step: int | None = None,
    tag: str | None = None,
    extra: Any = None,
    config: Any = None,
) -> Path:
    """Save a training checkpoint atomically to ``root/<tag>`` and point ``root/latest`` at it.

    Every rank writes its RNG state; rank 0 writes the rest, the manifest, renames the staging
    directory into place and moves ``latest`` last. Collective when a process group exists.
    ``extra`` must be loadable with ``torch.load(weights_only=True)`` (tensors, numbers, strings,
    lists, dicts).
    """
    tag = tag or (f"step{step}" if step is not None else "checkpoint")
    with atomic_checkpoint(root, tag, engine="torch", step=step, config_digest=config_digest(config)) as save:
        staged = save.path
        atomic_save(rng_state(), staged / RNG_FILE.format(rank=save.rank))
        if save.rank == 0:
            atomic_save(model.state_dict(), staged / MODEL_FILE)
            if optimizer is not None:
                atomic_save(optimizer.state_dict(), staged / OPTIMIZER_FILE)
            if lr_scheduler is not None:
                atomic_save(lr_scheduler.state_dict(), staged / SCHEDULER_FILE)
            if scaler is not None:
                atomic_save(scaler.state_dict(), staged / SCALER_FILE)
            if extra is not None:
                atomic_save(extra, staged / EXTRA_FILE)
    return save.final


def _load(tag_dir: Path, name: str, map_location: Any) -> Any:
    """``safe_torch_load`` (weights_only, allow-list): failures are CheckpointErrors naming the file."""
    return safe_torch_load(tag_dir / name, map_location=map_location)


def _group_settings(optimizer: Any) -> list[dict[str, Any]]:
    return [{k: g.get(k) for k in (*WATCHED_GROUP_KEYS, "initial_lr")} for g in optimizer.param_groups]


def _override_notes(before: list[dict[str, Any]], after: list[dict[str, Any]], keep: set[str]) -> list[str]:
    notes = []
    for gi, (b, a) in enumerate(zip(before, after)):
        for key in WATCHED_GROUP_KEYS:
            # with a scheduler the live lr is the scheduled one; compare the base lr it started from
            k = "initial_lr" if key == "lr" and b.get("initial_lr") is not None and a.get("initial_lr") is not None else key
            bv, av = b.get(k), a.get(k)
            if _same(bv, av):
                continue
            if key in keep:
                notes.append(f"optimizer param_groups[{gi}].{k}: kept the constructor's {bv!r} over the checkpoint's "
                             f"{av!r} (keep_constructor)")
            else:
                notes.append(f"optimizer param_groups[{gi}].{k}: the checkpoint's {av!r} replaced the constructor's "
                             f"{bv!r} (torch's Optimizer.load_state_dict keeps saved param_group values); pass "
                             f"keep_constructor=({key!r},) to keep yours")
    return notes


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # tensors of several elements
        import torch

        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())


def restore_state_dtypes(optimizer: "torch.optim.Optimizer", saved: dict[str, Any], model: Any,
                         saved_model: dict[str, Any]) -> list[str]:
    """Put back the dtype of optimizer state an optimizer keeps in another dtype than its parameter.

    ``Optimizer.load_state_dict`` casts every floating state tensor but ``step`` to its parameter's
    dtype (torch.optim.Optimizer._process_value_according_to_param_policy). prodigy-plus-schedule-free
    keeps ``p0`` and ``s`` in bfloat16 beside float32 parameters on purpose; widened to float32 they
    stop rounding, and the resumed loss curve leaves the uninterrupted one within a few steps. Only
    tensors whose saved dtype differed from their parameter's *saved* dtype (``saved_model``) are
    cast back, so a run resumed into a model of another dtype keeps torch's cast. Narrowing back
    is exact: the values were widened from that dtype. Returns one note per (key, dtypes), or none.
    """
    import torch

    names = {id(p): n for n, p in model.named_parameters()}
    live = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in saved.get("param_groups", []) for i in g.get("params", [])]
    counts: dict[tuple[str, str, str], int] = {}
    for idx, param in zip(ids, live):
        entry, state = saved.get("state", {}).get(idx), optimizer.state.get(param)
        saved_param = saved_model.get(names.get(id(param), ""))
        if not isinstance(entry, dict) or not isinstance(state, dict) or not torch.is_tensor(saved_param):
            continue
        for key, value in entry.items():
            now = state.get(key)
            if (key == "step" or not torch.is_tensor(value) or not torch.is_tensor(now) or not value.is_floating_point()
                    or value.dtype == now.dtype or value.dtype == saved_param.dtype):
                continue
            state[key] = now.to(value.dtype)
            what = (key, str(now.dtype).removeprefix("torch."), str(value.dtype).removeprefix("torch."))
            counts[what] = counts.get(what, 0) + 1
    return [f"optimizer state '{k}' ({n} tensor(s)): torch's Optimizer.load_state_dict cast it to {a} (its parameter's "
            f"dtype); restored to {b}, the dtype the optimizer saved it in, so the run continues as it would have"
            for (k, a, b), n in sorted(counts.items())]


def resume_training(
    path: str | Path,
    *,
    model: "torch.nn.Module",
    optimizer: "torch.optim.Optimizer | None" = None,
    scaler: Any = None,
    lr_scheduler: Any = None,
    map_location: Any = "cpu",
    strict: bool = True,
    restore_rng: bool = True,
    keep_constructor: Iterable[str] = (),
    extra_state: ExtraState | Iterable[ExtraState] | None = None,
    device_for: DeviceFor | None = None,
    checksums: bool = True,
) -> ResumeResult:
    """Resume from a checkpoint ``save_training`` wrote (the root or one tag directory).

    Build the model on its device and the optimizer/scheduler/scaler *before* calling this. Returns
    the step, what was re-placed, and notes (also issued as ``ResumeOverrideWarning`` when the
    checkpoint's ``fused``/``capturable``/``lr`` replace the constructor's).
    """

    report = check_resumable_distributed(path, engine="torch", checksums=checksums)
    assert report.tag_dir is not None and report.manifest is not None  # check_resumable_distributed raised otherwise
    tag_dir, manifest = Path(report.tag_dir), report.manifest
    listed = {f.path for f in manifest.files}
    keep = set(keep_constructor)
    unknown = keep - set(WATCHED_GROUP_KEYS)
    if unknown:
        raise CheckpointError(f"keep_constructor: unknown key(s) {sorted(unknown)}; choose from {list(WATCHED_GROUP_KEYS)}")
    result = ResumeResult(tag_dir=str(tag_dir), step=manifest.step)

    def need(name: str, what: str) -> None:
        if name not in listed:
            raise CheckpointError(f"{tag_dir / name}: the checkpoint has no {what} state but a {what} was passed; "
                                  f"it was saved without one. Build the run without a {what}, or start it fresh")

    need(MODEL_FILE, "model")
    model_sd = _load(tag_dir, MODEL_FILE, map_location)
    model.load_state_dict(model_sd, strict=strict)
    if optimizer is not None:
        need(OPTIMIZER_FILE, "optimizer")
        before = _group_settings(optimizer)
        saved_osd = _load(tag_dir, OPTIMIZER_FILE, map_location)
        optimizer.load_state_dict(saved_osd)
        after = _group_settings(optimizer)
        for gi, group in enumerate(optimizer.param_groups):
            for key in keep:
                group[key] = before[gi][key]
                if key == "lr" and before[gi].get("initial_lr") is not None:
                    group["initial_lr"] = before[gi]["initial_lr"]
        result.notes += _override_notes(before, after, keep)
        result.notes += restore_state_dtypes(optimizer, saved_osd, model, model_sd)
        del saved_osd
        # after flags are final: step placement depends on fused/capturable
        result.moves = replace_optimizer_state(optimizer, extra_state=extra_state, device_for=device_for, model=model)
    if lr_scheduler is not None:
        need(SCHEDULER_FILE, "lr_scheduler")
        lr_scheduler.load_state_dict(_load(tag_dir, SCHEDULER_FILE, map_location))
    if scaler is not None:
        need(SCALER_FILE, "scaler (GradScaler)")
        scaler.load_state_dict(_load(tag_dir, SCALER_FILE, map_location))
    if EXTRA_FILE in listed:
        result.extra = _load(tag_dir, EXTRA_FILE, map_location)
    if restore_rng:
        rank, world = rank_world()
        name = RNG_FILE.format(rank=rank)
        if name in listed:
            set_rng_state(_load(tag_dir, name, "cpu"))
        else:
            result.notes.append(f"{tag_dir / name}: no RNG state for rank {rank} (saved with {manifest.world_size} "
                                f"rank(s), resuming with {world}); random streams start fresh on this rank")
    for note in result.notes:
        if "replaced the constructor's" in note:
            warnings.warn(note, ResumeOverrideWarning, stacklevel=2)
    if result.moves:
        result.notes.append(summarize_moves(result.moves))
    return result
