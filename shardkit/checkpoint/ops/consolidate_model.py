"""Consolidate any checkpoint a reader describes (``checkpoint.readers``) to one safetensors file.

``consolidate.py`` keeps its own ZeRO-3 path (split across srun/torchrun processes, its torch-free
fp32 copy); every other kind goes through here: the registry's reader describes the checkpoint as
the checkpoint model (``TrainingCheckpoint``: each tensor as byte ranges of the source files), and
export's streaming writer (``export.writer.write_shard`` with one ``Shard``) copies each piece to its
place in the output, in the kernel where no cast is needed, a chunk at a time where one is. Memory
stays a few tens of MB whatever the model size.

The output follows consolidate's rules: checked before anything is read (never inside a checkpoint
folder, an existing file replaced only with ``force``), the source verified against its manifest
first, the file written under a temporary name, fsynced and renamed (``atomic_open``). Its tensors
are what DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` returns: buffers, frozen
parameters (unless ``include_frozen=False``), the trainable parameters' fp32 masters, and tied
aliases under each of their names (safetensors cannot alias); floating-point tensors as ``dtype``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.model.tensors import SourceTensor
from shardkit.checkpoint.ops.consolidate_output import (
    ConsolidateResult,
    check_output_file,
    remove_stale_temps,
)
from shardkit.checkpoint.ops.export.shard_plan import Shard
from shardkit.checkpoint.ops.export.sources import Source, resolve_source
from shardkit.checkpoint.ops.export.writer import ShardJob, entry_dtype, output_dtype, write_shard
from shardkit.checkpoint.readers.registry import read_checkpoint
from shardkit.core import progress
from shardkit.core.errors import CheckpointError, ShardkitError
from shardkit.storage.atomic import atomic_open, disk_full_named, os_errors_named
from shardkit.storage.pipeline import default_workers, verify_before_reading, warn_unverified
from shardkit.storage.shared_save import Launch, launch_from_env
from shardkit.storage.torch_load import ITEMSIZE

#: Kinds consolidate does not route here: ZeRO-3 keeps its own split path (each process copies its
#: ranks' byte ranges into one pre-sized file).
_OWN_PATHS = ("zero3",)


def model_source(checkpoint: str | Path) -> Source | None:
    """``checkpoint`` resolved when it is a kind this module consolidates (ZeRO-1/2, ... : any reader in
    the registry but ZeRO-3), else None: the caller's own reader then names what it is."""
    try:
        source = resolve_source(checkpoint)
    except ShardkitError:
        return None
    return source if source.kind not in _OWN_PATHS else None


def output_tensors(ckpt: TrainingCheckpoint, include_frozen: bool = True) -> dict[str, SourceTensor]:
    """What the consolidated file holds, by name: the weights (frozen ones only with ``include_frozen``)
    and each tied alias whose holder is written. Raises CheckpointError naming a tensor whose pieces do
    not cover it (nothing is written then)."""
    tensors = {n: t for n, t in ckpt.weights.items() if include_frozen or n not in ckpt.frozen}
    for alias, holder in ckpt.aliases.items():
        if holder in tensors and alias not in tensors:
            tensors[alias] = tensors[holder]
    for name, t in tensors.items():
        if not t.covered():
            raise CheckpointError(
                f"{ckpt.folder}: tensor {name!r} ({t.dtype}{list(t.shape)}) is not fully stored: its pieces do not "
                "cover every element once. A rank's file is missing or from another save; nothing was written")
    return tensors


@os_errors_named("consolidating the checkpoint")
def consolidate_model(
    source: Source,
    output: str | Path,
    *,
    dtype: str = "fp32",
    include_frozen: bool = True,
    force: bool = False,
    verify: bool = True,
    warn: Callable[[str], None] | None = None,
    workers: int | None = None,
    launch: Launch | None = None,
) -> ConsolidateResult:
    """Write the full weights of the resolved ``source`` (any kind in ``readers.registry.READERS``) to
    ``output`` (.safetensors; a folder gets ``model.safetensors``). Arguments as ``consolidate_zero3``'s;
    ``workers`` hashes source files at once. Under srun/torchrun only process 0 writes (the file is
    one sequential stream here); the others return at once with an empty share."""
    say = warn or warn_unverified
    launch = launch or launch_from_env()
    out = check_output_file(Path(output), source.tag_dir, force=force)
    if launch.distributed and launch.rank != 0:
        return ConsolidateResult(out, 0, 0, 0, 0, source.tag_dir.name, rank=launch.rank, processes=launch.world,
                                 launcher=launch.launcher)
    n_files = sum(1 for f in source.tag_dir.iterdir() if f.is_file())
    checked = verify_before_reading(source.tag_dir, checksums=verify, workers=workers or default_workers(max(1, n_files)))
    for note in [*source.notes, *checked.warnings]:
        say(note)
    ckpt = read_checkpoint(source.kind, source.tag_dir)
    out_name = output_dtype(dtype)
    tensors = output_tensors(ckpt, include_frozen)
    nbytes = sum(t.numel * ITEMSIZE[entry_dtype(t, out_name)] for t in tensors.values())
    job = ShardJob(Shard(out.name, tuple(tensors), nbytes), tensors, out_name)
    stored = {n for n in tensors if n not in ckpt.aliases and n not in ckpt.buffers}
    parameters = sum(tensors[n].numel for n in stored)

    outcome = f"nothing written: the partial file was removed, {out} is unchanged"
    out.parent.mkdir(parents=True, exist_ok=True)
    for note in remove_stale_temps(out):  # a run killed (SIGKILL, OOM) before it could remove its own
        say(note)
    progress.expect(nbytes)
    # atomic_open: a temporary sibling, fsynced and renamed over ``out`` once every byte is written;
    # the writer opens that temporary file by its name and writes each piece at its offset
    with disk_full_named(out, outcome), atomic_open(out, "wb") as fh:
        total = write_shard(Path(fh.name), job, threading.Event())
    return ConsolidateResult(out, len(tensors), parameters, total, ckpt.world_size or 0, ckpt.tag or source.tag_dir.name,
                             checked.level, rank=launch.rank, processes=launch.world if launch.distributed else 1,
                             share_pieces=sum(len(t.pieces) for t in tensors.values()), share_bytes=total,
                             launcher=launch.launcher)
