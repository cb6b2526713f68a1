"""The universal writer: any checkpoint model with its optimizer state (``TrainingCheckpoint``) as the
DeepSpeed universal checkpoint ``ds_to_universal`` writes from a ZeRO-1/2 save, so that DeepSpeed's
``load_checkpoint`` with ``checkpoint.load_universal: true`` resumes it at any data-parallel size.

Written under ``root/<tag>/`` (staged beside it, renamed into place, ``latest_universal`` last):

- ``zero/<parameter>/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt``: ``{"param": tensor, "cat_dim": 0}``
  with the whole fp32 tensor in the parameter's shape (what ``merge_tp_slices`` writes at tp 1, what
  ``load_hp_checkpoint_state`` reads), and ``step.pt`` the step as saved (an int where it is whole).
- ``zero/optimizer_state.pt``: the param groups' hyperparameters (``params`` the group's index, as
  ``_save_optimizer_state`` keeps it), ``ds_version`` (``_load_global_state`` asserts one), the
  loss scaler's ``dynamic_loss_scale`` where the source kept one; and, for a ZeRO-3 engine
  (``load_hp_checkpoint_state_from_checkpoint_dir_stage3``), the same groups and the step under
  ``optimizer_state_dict``.
- ``mp_rank_00_model_states.pt``: the module's state dict in the training dtype (tied aliases under
  each name, frozen parameters and buffers as read), ``param_shapes`` per param group, ``buffer_names``,
  ``shared_params``, the counters, ``ds_config`` and client state: what ``_load_checkpoint`` reads
  before the optimizer's universal load overwrites the trainable 16-bit weights from the masters.
  A ZeRO-3 engine reads ``zero_pp_rank_0_mp_rank_00_model_states.pt`` instead (``_get_ckpt_name``
  with ``load_universal``): the same file, hard-linked (copied where links are not possible).

Tensors are read one at a time from their source pieces (memory: the largest tensor, twice).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkit.checkpoint.layout.deepspeed_files import UNIVERSAL_FOLDER
from shardkit.checkpoint.layout.detect import LATEST_UNIVERSAL
from shardkit.checkpoint.model.checkpoint import TRAINING_DTYPES, TrainingCheckpoint
from shardkit.checkpoint.model.tensors import SourceTensor, read_slice
from shardkit.core.errors import CheckpointError
from shardkit.platform.versions import package_version
from shardkit.storage.atomic import atomic_save, publish_dir, signals_deferred, write_latest
from shardkit.storage.shared_save import OWNER_NAME, claim, launch_from_env, remove_own_claim

if TYPE_CHECKING:
    import torch

OPTIMIZER_FILE = "optimizer_state.pt"
MODEL_STATES = "mp_rank_00_model_states.pt"
#: The name a ZeRO-3 engine loads the model states of a universal checkpoint from (DeepSpeed 0.19.8).
ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"


def write_universal(ckpt: TrainingCheckpoint, root: Path, tag: str) -> Path:
    """Write ``ckpt`` as the universal checkpoint ``root/<tag>``; return that folder.

    Refuses, before writing, what ``universal_state_keys`` refuses.
    """
    keys = universal_state_keys(ckpt)
    launch = launch_from_env(single=True)
    # claimed as every other writer's staging folder is (its owner file in it from its first moment):
    # a live writer of the same output is refused by name, a killed one's leftover removed; without an
    # owner file a claim-based run (convert --to universal) took this folder, files and all, for a leftover
    staged = claim(root, tag, launch, sweep=False)
    try:
        _write(ckpt, staged, ckpt.trainable, keys)
        publish_dir(staged, root / tag, drop=(OWNER_NAME,))
    except BaseException:
        with signals_deferred():  # a second SIGTERM (a repeated cancel) must not cut the removal short
            remove_own_claim(staged, launch)
        raise
    write_latest(root, tag, LATEST_UNIVERSAL)
    return root / tag


def write_universal_files(ckpt: TrainingCheckpoint, folder: Path) -> None:
    """The universal files of ``ckpt`` into ``folder`` (a staging folder its caller seals and publishes,
    as ``convert --to universal`` does through ``atomic_checkpoint``); refuses what ``universal_state_keys`` does."""
    _write(ckpt, folder, ckpt.trainable, universal_state_keys(ckpt))


def universal_state_keys(ckpt: TrainingCheckpoint) -> list[str]:
    """The optimizer state keys every trainable parameter holds (one file each). Refuses a checkpoint
    without its optimizer state, a trainable parameter missing a moment the others have, and tensors
    whose pieces do not cover them: callers check before anything is written."""
    trainable = ckpt.trainable
    keys = sorted({k for states in ckpt.optimizer.values() for k in states})
    lacking = [n for n in trainable if sorted(ckpt.optimizer.get(n, {})) != keys]
    if not ckpt.optimizer_described or not keys or lacking:
        raise CheckpointError(
            f"{ckpt.folder}: a universal checkpoint needs every trainable parameter's optimizer state, and this "
            f"{ckpt.format} source {'describes none' if not keys else 'lacks it for ' + ', '.join(lacking[:5])}; "
            "export writes its weights instead. Nothing was written")
    ckpt.refuse_uncovered()
    return keys


def _write(ckpt: TrainingCheckpoint, staged: Path, trainable: list[str], keys: list[str]) -> None:
    import torch

    zero = staged / UNIVERSAL_FOLDER
    steps = ckpt.scalars.get("step") or {}
    for name in trainable:
        folder = zero / name
        folder.mkdir(parents=True)
        atomic_save({"param": _load(ckpt.weights[name], torch.float32), "cat_dim": 0}, folder / "fp32.pt")
        for key in keys:
            atomic_save({"param": _load(ckpt.optimizer[name][key], torch.float32), "cat_dim": 0}, folder / f"{key}.pt")
        if name in steps:
            step = float(steps[name])
            atomic_save(int(step) if step.is_integer() else step, folder / "step.pt")
    groups = _param_groups(ckpt, trainable)
    optim: dict[str, Any] = {"param_groups": [{**g, "params": [i]} for i, (g, _) in enumerate(groups)],
                             "ds_version": _ds_version(ckpt), "zero_stage": 2, "partition_count": [1] * len(groups)}
    scaler = ckpt.scalars.get("loss_scaler")
    if isinstance(scaler, dict):
        optim["dynamic_loss_scale"] = bool(scaler.get("dynamic"))
    first_step = next((float(steps[n]) for n in trainable if n in steps), 0.0)
    optim["optimizer_state_dict"] = {  # ZeRO-3's universal load reads one step and the first group's values here
        "state": {0: {"step": int(first_step) if first_step.is_integer() else first_step}},
        "param_groups": optim["param_groups"]}
    atomic_save(optim, zero / OPTIMIZER_FILE)
    atomic_save(_model_states(ckpt, groups, torch), staged / MODEL_STATES)
    try:
        os.link(staged / MODEL_STATES, staged / ZERO3_MODEL_STATES)
    except OSError:
        shutil.copy2(staged / MODEL_STATES, staged / ZERO3_MODEL_STATES)


def _param_groups(ckpt: TrainingCheckpoint, trainable: list[str]) -> list[tuple[dict[str, Any], list[str]]]:
    """(hyperparameters, names) per param group; one group of every trainable parameter where the
    source named none."""
    named = [g for g in ckpt.scalars.get("param_groups") or [] if isinstance(g, dict)]
    if not named:
        return [({}, trainable)]
    out = [({k: v for k, v in g.items() if k != "params"}, [str(n) for n in g.get("params") or []]) for g in named]
    grouped = [n for _, names in out for n in names]
    if sorted(grouped) != sorted(trainable):
        missing = sorted(set(trainable) - set(grouped))
        raise CheckpointError(f"{ckpt.folder}: the param groups name {len(grouped)} parameters, the checkpoint has "
                              f"{len(trainable)} trainable ones (not in a group: {', '.join(missing[:5])}); the "
                              "scalars do not describe this checkpoint. Nothing was written")
    return out


def _model_states(ckpt: TrainingCheckpoint, groups: list[tuple[dict[str, Any], list[str]]], torch: Any) -> dict[str, Any]:
    """What DeepSpeed's ``_load_checkpoint`` reads from ``mp_rank_00_model_states.pt``."""
    dtype = getattr(torch, TRAINING_DTYPES.get(ckpt.precision, "float32"))
    module: dict[str, Any] = {}
    for name, t in ckpt.weights.items():
        value = _load(t, None)
        trained = name not in ckpt.frozen and name not in ckpt.buffers
        module[name] = value.to(dtype) if trained and value.is_floating_point() else value
    for alias, holder in ckpt.aliases.items():
        if holder in module:
            module[alias] = module[holder]
    counters = ckpt.scalars.get("counters") or {}
    source = ckpt.scalars.get("source") or {}
    state: dict[str, Any] = dict(ckpt.scalars.get("client_state") or {})
    state.update(
        module=module, buffer_names=sorted(ckpt.buffers), optimizer=None,
        param_shapes=[{n: torch.Size(ckpt.weights[n].shape) for n in names} for _, names in groups],
        frozen_param_shapes={n: torch.Size(ckpt.weights[n].shape) for n in ckpt.weights if n in ckpt.frozen} or None,
        shared_params=dict(ckpt.aliases), frozen_param_fragments=None, lr_scheduler=ckpt.scalars.get("lr_scheduler"),
        data_sampler=None, random_ltd=None,
        skipped_steps=int(counters.get("skipped_steps", 0)), global_steps=int(counters.get("global_steps", 0)),
        global_samples=int(counters.get("global_samples", 0)), dp_world_size=ckpt.world_size or 1, mp_world_size=1,
        ds_config=source.get("ds_config") or {}, ds_version=_ds_version(ckpt),
        universal_checkpoint_info={"universal_checkpoint_version": 0.2})
    return state


def _ds_version(ckpt: TrainingCheckpoint) -> str:
    version = (ckpt.scalars.get("source") or {}).get("ds_version")
    if isinstance(version, str) and version:
        return version
    # else the installed release, else the one this layout was read from (deepspeed/checkpoint/ds_to_universal.py)
    return package_version("deepspeed") or "0.19.8"


def _load(t: SourceTensor, dtype: "torch.dtype | None") -> "torch.Tensor":
    """The whole tensor ``t`` from its pieces (or its loader), as ``dtype`` when given."""
    value = read_slice(t, 0, t.numel, "the file is truncated. Nothing was written").reshape(t.shape)
    return value.to(dtype) if dtype is not None else value
