"""Write a checkpoint's full weights to one safetensors file, streaming (zero_to_fp32's job), for every
kind a reader describes (``readers.registry``: ZeRO-3, ZeRO-1/2, DCP, FSDP1, universal...).

DeepSpeed's ``zero_to_fp32.py`` maps every rank's optimizer file, builds the whole fp32 state dict in
memory and then serializes it, so its peak memory is about twice the fp32 model. Here the reader
describes the checkpoint as the checkpoint model (``TrainingCheckpoint``: each tensor as byte ranges
of the source files, read without torch), the safetensors header is computed up front (tensor order
taken from safetensors itself), the output file is sized once, and every piece is copied straight
to its final byte offset by export's writer (``export.writer.write_elements``): file to file in the
kernel (``os.copy_file_range``) where no cast is needed, a chunk at a time where one is (``--dtype
bf16``; only then is torch imported). The output's data bytes are cut into windows, one per copier
thread, each asking every tensor for just the pieces of its window (``SourceTensor.pieces_in``: for
ZeRO-3 the ranks overlapping it, computed from the layout), so memory stays a few tens of MB and
never grows as ranks x tensors.

Its tensors are what DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` returns: buffers,
frozen parameters (unless ``include_frozen=False``), the trainable parameters' fp32 masters, and tied
aliases under each of their names (safetensors cannot alias); floating-point tensors as ``dtype``.
For ZeRO-3 the result is byte-for-byte the file ``safetensors.torch.save_file(state_dict,
metadata={"format": "pt"})`` writes for zero_to_fp32's state dict (tests check it).

Under ``srun``/``torchrun`` the copy is split across the launched processes (``consolidate_shared``
on ``storage.shared_meet``/``storage.shared_save``, as reshard): process 0 claims a hidden staging
folder beside the output, every process agrees on the request, process 0 creates the sized file
(header written) in it, every process copies its window of the data bytes to that one file (on a
filesystem every node shares), hashes its share of the source files, fsyncs and reports; process 0
waits for every report, then renames the file into place. A process that fails, stops its heartbeat
or never joins fails the run, named, and the staging folder (with the partial file) is removed.
"""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable

from shardkit.checkpoint.layout.support import refuse_unsupported
from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.model.tensors import SourceTensor, refuse_uncovered, written_as
from shardkit.checkpoint.ops.consolidate_output import ConsolidateResult, check_output_file, remove_stale_temps
from shardkit.checkpoint.ops.consolidate_shared import write_shared
from shardkit.checkpoint.ops.export.sources import Source, resolve_source
from shardkit.checkpoint.ops.export.writer import SourceFiles, Stopped, entry_dtype, output_dtype, write_elements
from shardkit.checkpoint.readers.registry import read_checkpoint
from shardkit.checkpoint.readers.zero3 import read_zero3
from shardkit.checkpoint.zero3.files import resolve_tag_dir
from shardkit.core import progress
from shardkit.core.deprecated import deprecated_alias
from shardkit.core.errors import ShardkitError, UsageError
from shardkit.storage.atomic import atomic_open, disk_full_named, os_errors_named
from shardkit.storage.dry_run import writing_starts
from shardkit.storage.listing import list_folder, lists_source_once
from shardkit.storage.pipeline import check_source, default_workers, warn_unverified
from shardkit.storage.request import RunRequest, source_of
from shardkit.storage.safetensors_file import TensorEntry, header_layout, write_header
from shardkit.storage.shared_save import Launch, launch_from_env, split_by_bytes
from shardkit.storage.stream import join_pool, submit_all


@os_errors_named("consolidating the checkpoint")
@lists_source_once("checkpoint", "output")  # each step asking what the source holds: one listing of its folders
def consolidate_checkpoint(
    checkpoint: str | Path,
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
    """Write the full weights of the checkpoint at ``checkpoint`` (any kind ``readers.registry`` reads:
    ZeRO-3, ZeRO-1/2, DCP, FSDP1, universal ...) to ``output`` (.safetensors; a folder gets ``model.safetensors``).

    Floating-point tensors are written as ``dtype`` (the fp32 masters by default, like zero_to_fp32);
    integer buffers keep their dtype. The file appears atomically (temp name, fsync, rename). The
    source is checked against its manifest first (sizes, and digests unless ``verify=False``); one
    without a manifest is read with a warning through ``warn`` (default ``warnings.warn``). An existing
    output is replaced only with ``force=True`` and only when it is a regular file; a path inside a
    checkpoint folder (or a root's ``latest``) is never written. ``workers``: source files hashed and
    output windows copied at once (default ``default_workers``). ``launch``: this process's share
    (default: from ``srun``/``torchrun``'s variables; one process does everything without them).
    """
    if workers is not None and workers < 1:
        raise UsageError(f"workers={workers}: must be at least 1 (output windows copied at once)")
    out_name = output_dtype(dtype)
    refuse_unsupported(checkpoint, "consolidate")  # a layout nothing converts correctly: refused before anything is read
    source = _source(checkpoint)
    say = warn or warn_unverified
    launch = launch or launch_from_env()
    # every process resolves -o the same way: the staging folder is named after the file
    out = check_output_file(Path(output), source.tag_dir, force=force)
    n_files = len(list_folder(source.tag_dir).files)
    workers = workers or default_workers(max(1, n_files))
    # split: each process hashes its share of the files beside its copy (nothing is published unless all matched)
    checked = check_source(source.tag_dir, verify=verify, hash_now=not launch.distributed, workers=workers)
    for note in [*source.notes, *checked.warnings] if launch.rank == 0 else []:
        say(note)
    # the tag folder that was verified is read, not ``checkpoint`` again: a save between the two could
    # move 'latest' to a tag nobody verified. A split run's process parses only the rank files its window
    # reads (lazy): eagerly, every process parsed every rank's pickle, processes x ranks parses on the
    # shared filesystem; a damaged file is then named by the process reading it, and nothing is published
    # (the output is staged). One process reads every piece anyway: eager names damage before the output exists
    lazy = launch.distributed and source.kind == "zero3"
    ckpt = read_zero3(source.tag_dir, lazy=True) if lazy else read_checkpoint(source.kind, source.tag_dir)
    tensors = output_tensors(ckpt, include_frozen)
    entries = {n: TensorEntry(n, entry_dtype(t, out_name), tuple(t.shape)) for n, t in tensors.items()}
    header, data_start = header_layout(entries)
    data = sum(e.nbytes for e in entries.values())
    stored = [n for n in tensors if n not in ckpt.aliases and n not in ckpt.buffers]
    result = ConsolidateResult(out, len(entries), sum(tensors[n].numel for n in stored), data_start + data,
                               ckpt.world_size or 0, ckpt.tag or source.tag_dir.name, checked.level, launcher=launch.launcher)
    # this process's window of the data bytes (all of them alone), cut again into one window per copier
    lo, hi = launch.rank * data // launch.world, (launch.rank + 1) * data // launch.world
    windows = [(lo + i * (hi - lo) // workers, lo + (i + 1) * (hi - lo) // workers) for i in range(workers)]

    def write_header_only(fd: int) -> None:
        write_header(fd, header, data_start + data)

    def copy_share(fd: int) -> None:
        result.share_pieces = _copy_windows(fd, data_start, entries, tensors, windows)

    result.share_bytes = hi - lo
    progress.expect(hi - lo)
    outcome = f"nothing written: the partial file was removed, {out} is unchanged"
    writing_starts(str(out))  # a --dry-run stops here: every check before it has passed
    if launch.distributed:
        manifest_files = list(checked.owed.values())
        to_hash = [manifest_files[i] for i in split_by_bytes([e.size for e in manifest_files], launch.world)[launch.rank]]
        # what every process must agree on before anything is written (storage.shared_meet)
        request = RunRequest("consolidate", source_of(source.tag_dir), str(out.resolve()), None,
                             {"--dtype": dtype, "--exclude-frozen": not include_frozen, "--no-verify": not verify})
        write_shared(out, launch, request, write_header_only, copy_share,
                     [(source.tag_dir / e.path, e) for e in to_hash], workers, outcome)
        result.rank, result.processes = launch.rank, launch.world
        return result
    out.parent.mkdir(parents=True, exist_ok=True)
    for note in remove_stale_temps(out):  # a run killed (SIGKILL, OOM) before it could remove its own
        say(note)
    # atomic_open: a temporary sibling, fsynced and renamed over ``out`` only when every byte is
    # written; positional writes go straight to its descriptor (nothing is buffered in the file object)
    with disk_full_named(out, outcome), atomic_open(out, "wb", output=True) as fh:
        write_header_only(fh.fileno())
        copy_share(fh.fileno())
    return result


# the name before it took every layout; warns on call, goes in the next release
consolidate_zero3 = deprecated_alias("consolidate_zero3", "consolidate_checkpoint", consolidate_checkpoint)


def _source(checkpoint: str | Path) -> Source:
    """``checkpoint`` resolved; what is no kind a reader takes is refused with ZeRO-3's own wording (the
    command's first kind: its tag folder, 'latest' and rank-file messages), else with the resolver's."""
    try:
        return resolve_source(checkpoint)
    except ShardkitError:
        resolve_tag_dir(checkpoint)
        raise


def output_tensors(ckpt: TrainingCheckpoint, include_frozen: bool = True) -> dict[str, SourceTensor]:
    """What the consolidated file holds, by name: the weights (frozen ones only with ``include_frozen``)
    and each tied alias whose holder is written. Raises CheckpointError naming a tensor whose pieces do
    not cover it (nothing is written then)."""
    tensors = {n: t for n, t in ckpt.weights.items() if include_frozen or n not in ckpt.frozen}
    for alias, holder in ckpt.aliases.items():
        if holder in tensors and alias not in tensors:
            tensors[alias] = tensors[holder]
    refuse_uncovered(ckpt.folder, written_as(tensors))
    return tensors


def _copy_windows(fd: int, data_start: int, entries: dict[str, TensorEntry], tensors: dict[str, SourceTensor],
                  windows: list[tuple[int, int]]) -> int:
    """Copy the elements whose first byte lies in each window of the data bytes, one thread per window
    (``copy_file_range`` and the casts run without the GIL); returns the pieces read. The first failure
    stops the other threads (between chunks) and is raised once all have stopped."""
    stop, sources = threading.Event(), SourceFiles()

    def copy(window: tuple[int, int]) -> int:
        count = 0
        for name, e in entries.items():
            t, size = tensors[name], e.itemsize
            lo = min(t.numel, max(0, -(-(window[0] - e.start) // size)))
            hi = min(t.numel, max(0, -(-(window[1] - e.start) // size)))
            if hi > lo:
                count += write_elements(fd, data_start + e.start, t, e.dtype, sources, stop, lo, hi)
        return count

    try:
        if len(windows) == 1:
            return copy(windows[0])
        pool = ThreadPoolExecutor(max_workers=len(windows), thread_name_prefix="shardkit-consolidate")
        futures: list[Future[int]] = []
        try:
            # every thread joined before the caller closes fd: one left running (an interrupt in submit's
            # thread start, stream.submit_all) wrote through a closed, perhaps reused, descriptor
            futures = submit_all(pool, copy, [(w,) for w in windows])
            wait(futures, return_when=FIRST_EXCEPTION)
        finally:
            if not futures or not all(f.done() and f.exception() is None for f in futures):
                stop.set()  # a failure or an interrupt: the others stop at their next tensor or chunk
            join_pool(pool)
        # a window still queued when another failed was cancelled by join_pool: its exception() is a
        # CancelledError raised, not returned (a traceback instead of the disk-full line, under load)
        failed = [e for e in (f.exception() for f in futures if not f.cancelled()) if e is not None]
        real = [e for e in failed if not isinstance(e, Stopped)]
        if failed:
            raise (real or failed)[0]  # the failure, not the threads it stopped
        return sum(f.result() for f in futures)
    finally:
        sources.close()
