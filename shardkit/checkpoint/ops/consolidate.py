"""Write a ZeRO-3 checkpoint's full weights to one safetensors file, streaming (zero_to_fp32's job).

DeepSpeed's ``zero_to_fp32.py`` maps every rank's optimizer file, builds the whole fp32 state dict
in memory and then serializes it, so its peak memory is about twice the fp32 model. Here the
safetensors header is computed up front (tensor order taken from safetensors itself), the output
file is sized once, and every rank's unpadded piece of every parameter is copied straight from
the rank file to its final byte offset with ``os.copy_file_range`` (a ``pread``/``pwrite`` loop
where the kernel refuses; the header and the copy are ``io.safetensors_file``'s, shared with
``export``). For the default fp32 output with no buffers or frozen parameters the files are parsed
by ``read_structure`` and neither torch nor DeepSpeed is imported: the process stays at a few tens
of MB whatever the model size. A cast (``--dtype bf16``) or buffers/frozen
parameters take the torch path, which maps one rank file at a time.

The result is byte-for-byte the file ``safetensors.torch.save_file(state_dict, metadata={"format":
"pt"})`` writes for zero_to_fp32's state dict (tests check it).

Under ``srun``/``torchrun`` the copy is split across the launched processes (``consolidate_shared``
on ``io.shared_meet``/``io.shared_save``, as reshard): process 0 claims a hidden staging folder beside
the output, every process agrees on the request, and process 0 creates the sized file (header written) in it; every process copies its share of the pieces, dealt by bytes, to
their offsets in that one file (on a filesystem every node shares), hashes its share of the source
files, fsyncs and reports; process 0 waits for every report, then renames the file into place. A
process that fails, stops its heartbeat or never joins fails the run, named, and the staging
folder (with the partial file) is removed.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from shardkit.checkpoint.layout.support import refuse_unsupported
from shardkit.checkpoint.ops.consolidate_model import consolidate_model, model_source
from shardkit.checkpoint.ops.consolidate_output import (
    ConsolidateResult,
    check_output_file,
    remove_stale_temps,
)
from shardkit.checkpoint.ops.consolidate_shared import write_shared
from shardkit.checkpoint.ops.export.writer import output_dtype
from shardkit.checkpoint.zero3.checkpoint import FP32, ParamSlot, Zero3Checkpoint
from shardkit.checkpoint.zero3.files import resolve_tag_dir
from shardkit.checkpoint.zero3.gather import full_frozen_params
from shardkit.checkpoint.zero3.reader import open_zero3_checkpoint
from shardkit.core import progress
from shardkit.core.errors import CheckpointError, UsageError
from shardkit.storage.atomic import atomic_open, disk_full_named, os_errors_named
from shardkit.storage.pipeline import (
    default_workers,
    verify_before_reading,
    warn_unverified,
)
from shardkit.storage.request import RunRequest, source_of
from shardkit.storage.safetensors_file import TensorEntry as _Entry
from shardkit.storage.safetensors_file import copy_bytes as _copy_bytes
from shardkit.storage.safetensors_file import header_layout as _layout
from shardkit.storage.safetensors_file import write_header
from shardkit.storage.shared_save import (
    Launch,
    launch_from_env,
    split_by_bytes,
)
from shardkit.storage.torch_load import read_structure

if TYPE_CHECKING:
    import torch

#: A parameter's name -> the absolute byte offsets of its tensor (and of its tied aliases) in the output.
Targets = Callable[[str], list[int]]


def _dtype_name(dtype: "torch.dtype") -> str:
    return str(dtype).split(".")[-1]


@os_errors_named("consolidating the checkpoint")
def consolidate_zero3(
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
    """Write the full weights of the ZeRO-3 checkpoint at ``checkpoint`` to ``output`` (.safetensors).

    Floating-point tensors are written as ``dtype`` (the fp32 masters by default, like
    zero_to_fp32); integer buffers keep their dtype. Tied parameters (``shared_params``) are written
    under each name, since safetensors cannot alias. The file appears atomically (temp name,
    fsync, rename).

    The source is checked against its manifest first (sizes, and digests unless ``verify=False``);
    one without a manifest is read with a warning through ``warn`` (default ``warnings.warn``). An
    existing output is replaced only with ``force=True`` and only when it is a regular file; a
    path inside a checkpoint folder (or a root's ``latest``) is never written. ``workers``: source
    files hashed and rank files copied at once, each copier owning the disjoint byte ranges of its
    rank's pieces (default ``default_workers``). ``launch``: this process's share of the pieces
    (default: from ``srun``/``torchrun``'s variables; one process does everything without them).
    """

    if workers is not None and workers < 1:
        raise UsageError(f"workers={workers}: must be at least 1 (rank files copied at once)")
    out_name = output_dtype(dtype)
    refuse_unsupported(checkpoint, "consolidate")  # a layout nothing converts correctly: refused before anything is read
    routed = model_source(checkpoint)  # ZeRO-1/2 and other readers' kinds: the checkpoint model's path
    if routed is not None:
        return consolidate_model(routed, output, dtype=dtype, include_frozen=include_frozen, force=force,
                                 verify=verify, warn=warn, workers=workers, launch=launch)
    source_dir, _ = resolve_tag_dir(checkpoint)
    launch = launch or launch_from_env()
    # every process resolves -o the same way: the staging folder is named after the file
    out = check_output_file(Path(output), source_dir, force=force)
    n_files = sum(1 for f in source_dir.iterdir() if f.name.endswith(".pt"))
    workers = workers or default_workers(max(1, n_files))
    if launch.distributed:
        # sizes now; each process hashes its share of the files beside its copy (nothing is
        # published unless all matched), instead of every process hashing everything first
        checked = verify_before_reading(source_dir, checksums=False)
        level = "none" if checked.manifest is None else ("hash" if verify else "sizes")
        notes = [n for n in checked.warnings if not (verify and n.startswith("--no-verify"))]
    else:
        checked = verify_before_reading(source_dir, checksums=verify, workers=workers)
        level, notes = checked.level, checked.warnings
    for note in notes if launch.rank == 0 else []:
        (warn or warn_unverified)(note)
    # The common case (fp32 out, no buffers, no frozen parameters) never imports torch: the files
    # are parsed by read_structure and every byte is copied file to file. The tag folder that was
    # verified is opened, not ``checkpoint`` again: a save between the two could move 'latest'
    # to a tag nobody verified.
    ckpt = open_zero3_checkpoint(source_dir, torch_free=dtype == "fp32")
    if ckpt.torch_free and (ckpt.model_state.get("buffer_names") or (include_frozen and ckpt.frozen_param_shapes)):
        ckpt = open_zero3_checkpoint(source_dir)
    if not launch.distributed:
        out.parent.mkdir(parents=True, exist_ok=True)

    small = {} if ckpt.torch_free else _small_tensors(ckpt, out_name, include_frozen)
    entries: dict[str, _Entry] = {n: _Entry(n, _dtype_name(t.dtype), tuple(t.shape)) for n, t in small.items()}
    for slot in ckpt.slots:
        entries[slot.name] = _Entry(slot.name, out_name, slot.shape)
    aliases: dict[str, list[str]] = {}
    for alias, source in ckpt.shared_params.items():
        if source in entries and alias not in entries:
            src = entries[source]
            entries[alias] = _Entry(alias, src.dtype, src.shape)
            aliases.setdefault(source, []).append(alias)

    header, data_start = _layout(entries)
    total = data_start + sum(e.nbytes for e in entries.values())

    def targets(name: str) -> list[int]:
        return [data_start + entries[t].start for t in (name, *aliases.get(name, ()))]

    outcome = f"nothing written: the partial file was removed, {out} is unchanged"
    n_params = sum(s.numel for s in ckpt.slots) + sum(
        small[n].numel() for n in ckpt.frozen_param_shapes if n in small
    )
    result = ConsolidateResult(out, len(entries), n_params, total, ckpt.world_size, ckpt.tag, level,
                               launcher=launch.launcher)
    copy_fp32 = ckpt.torch_free or out_name == "float32"
    itemsize = 4 if copy_fp32 else _Entry("", out_name, ()).itemsize

    def write_small(fd: int) -> None:
        write_header(fd, header, total)
        for name, t in small.items():
            buf = _as_bytes(t)
            for at in targets(name):
                os.pwrite(fd, buf, at)

    if launch.distributed:
        by_rank, result.share_bytes = _my_pieces(ckpt, launch, lambda slot: itemsize * len(targets(slot.name)))
        progress.expect(result.share_bytes)
        manifest_files = checked.manifest.files if checked.manifest is not None and verify else []
        to_hash = [manifest_files[i] for i in split_by_bytes([e.size for e in manifest_files], launch.world)[launch.rank]]

        def copy_share(fd: int) -> None:
            if copy_fp32:
                _in_parallel([partial(_copy_rank_fp32, ckpt, r, fd, targets, sl) for r, sl in by_rank.items()], workers)
            else:
                for r, sl in by_rank.items():
                    _copy_rank_cast(ckpt, r, fd, targets, out_name, sl)

        # what every process must agree on before anything is written (io.shared_meet)
        request = RunRequest("consolidate", source_of(source_dir), str(out.resolve()), None,
                             {"--dtype": dtype, "--exclude-frozen": not include_frozen, "--no-verify": not verify})
        write_shared(out, launch, request, write_small, copy_share, [(source_dir / e.path, e) for e in to_hash],
                     workers, outcome)
        result.rank, result.processes = launch.rank, launch.world
        result.share_pieces = sum(len(sl) for sl in by_rank.values())
        return result

    # atomic_open: a temporary sibling, fsynced and renamed over ``out`` only when every byte is
    # written; positional writes go straight to its descriptor (nothing is buffered in the file object)
    for note in remove_stale_temps(out):  # a run killed (SIGKILL, OOM) before it could remove its own
        (warn or warn_unverified)(note)
    progress.expect(total)
    with disk_full_named(out, outcome), atomic_open(out, "wb") as fh:
        fd = fh.fileno()
        write_small(fd)
        # Rank-major: one rank file at a time; each rank's piece of a parameter is a contiguous
        # run of the row-major flattened tensor, so it goes to one offset. Without a cast the
        # bytes go file to file in the kernel (copy_file_range): nothing is paged into this process.
        if copy_fp32:
            # each rank's pieces go to their own byte ranges of the output: copied by rank files
            # at once (copy_file_range runs in the kernel, without the GIL)
            _in_parallel([partial(_copy_rank_fp32, ckpt, r, fd, targets) for r in range(ckpt.world_size)], workers)
        else:
            # a cast builds each piece in memory: one rank file mapped at a time keeps the peak low
            for rank in range(ckpt.world_size):
                _copy_rank_cast(ckpt, rank, fd, targets, out_name)
    result.share_pieces = sum(1 for r in range(ckpt.world_size) for slot in ckpt.slots if _numel(slot, r))
    result.share_bytes = total
    return result


def _in_parallel(tasks: list[Callable[[], None]], workers: int) -> None:
    """Run ``tasks`` ``workers`` at a time; the first failure is raised once all have stopped."""
    if workers <= 1 or len(tasks) <= 1:
        for task in tasks:
            task()
        return

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shardkit-consolidate") as pool:
        futures = [pool.submit(task) for task in tasks]
    for f in futures:
        f.result()


def _torch_dtype(name: str) -> "torch.dtype":
    import torch

    return getattr(torch, name)


def _as_bytes(t: "torch.Tensor") -> memoryview:
    import torch

    return memoryview(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())


def _my_pieces(ckpt: Zero3Checkpoint, launch: Launch, bytes_per_element: Callable[[ParamSlot], int],
               ) -> tuple[dict[int, list[ParamSlot]], int]:
    """This process's pieces (one source rank's run of one parameter), dealt by bytes written so the
    processes finish together; every process computes the same deal. Grouped by source rank (one
    rank file opened per group), in file order. Returns them and the bytes they write."""
    pieces = [(r, slot) for r in range(ckpt.world_size) for slot in ckpt.slots if _numel(slot, r)]
    sizes = [_numel(slot, r) * bytes_per_element(slot) for r, slot in pieces]
    mine = sorted(split_by_bytes(sizes, launch.world)[launch.rank])
    by_rank: dict[int, list[ParamSlot]] = {}
    for i in mine:
        by_rank.setdefault(pieces[i][0], []).append(pieces[i][1])
    return by_rank, sum(sizes[i] for i in mine)


def _numel(slot: ParamSlot, rank: int) -> int:
    start, stop = slot.rank_range(rank)
    return max(0, stop - start)


def _copy_rank_fp32(ckpt: Zero3Checkpoint, rank: int, dst_fd: int, targets: Targets,
                    slots: list[ParamSlot] | None = None) -> None:
    """Every fp32 piece rank ``rank`` holds (of ``slots``; default all), file to file, to its place in the output."""
    osd = read_structure(ckpt.optim_files[rank])["optimizer_state_dict"]
    flats = osd["fp32_flat_groups"]
    src_fd = os.open(ckpt.optim_files[rank], os.O_RDONLY)
    try:
        for slot in ckpt.slots if slots is None else slots:
            start, stop = slot.rank_range(rank)
            if stop <= start:
                continue
            ref = flats[slot.sub_group]
            if ref.dtype != "float32" or ref.numel != ckpt.sub_group_numel[slot.sub_group] or not ref.is_contiguous():
                raise CheckpointError(
                    f"{ckpt.optim_files[rank]}: fp32 partition of sub-group {slot.sub_group} is "
                    f"{ref.dtype}[{ref.numel}], expected float32[{ckpt.sub_group_numel[slot.sub_group]}]"
                )
            for at in targets(slot.name):
                _copy_bytes(src_fd, dst_fd, (stop - start) * 4, ref.file_offset + slot.offset * 4, at + start * 4)
    finally:
        os.close(src_fd)


def _copy_rank_cast(ckpt: Zero3Checkpoint, rank: int, dst_fd: int, targets: Targets, out_name: str,
                    slots: list[ParamSlot] | None = None) -> None:
    """Every piece rank ``rank`` holds (of ``slots``; default all), cast to ``out_name`` in memory
    and written to its place; the rank file is mapped for the duration only."""
    itemsize = _Entry("", out_name, ()).itemsize
    with ckpt.open_rank(rank) as part:
        for slot in ckpt.slots if slots is None else slots:
            start, stop = slot.rank_range(rank)
            if stop > start:
                buf = _as_bytes(part.param_slice(slot, FP32).to(_torch_dtype(out_name)))
                for at in targets(slot.name):
                    progress.advance(os.pwrite(dst_fd, buf, at + start * itemsize))


def _small_tensors(ckpt: Zero3Checkpoint, out_name: str, include_frozen: bool) -> dict[str, "torch.Tensor"]:
    """Buffers and frozen parameters (assembled whole in memory), cast as zero_to_fp32 casts them."""
    tensors = dict(ckpt.buffers())
    if include_frozen:
        tensors.update(full_frozen_params(ckpt))
    out_dtype = _torch_dtype(out_name)
    return {n: (t.to(out_dtype) if t.is_floating_point() else t) for n, t in tensors.items()}
