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
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from shardkit.checkpoint.io.atomic import atomic_open, disk_full_named, os_errors_named
from shardkit.checkpoint.io.pipeline import default_workers, verify_before_reading, warn_unverified
from shardkit.checkpoint.io.safetensors_file import TensorEntry as _Entry
from shardkit.checkpoint.io.safetensors_file import copy_bytes as _copy_bytes
from shardkit.checkpoint.io.safetensors_file import header_layout as _layout
from shardkit.checkpoint.io.safetensors_file import write_header
from shardkit.checkpoint.io.tags import LATEST_NAME, STAGING_PREFIX
from shardkit.checkpoint.io.torch_load import read_structure
from shardkit.checkpoint.zero3.checkpoint import FP32, Zero3Checkpoint
from shardkit.checkpoint.zero3.files import resolve_tag_dir
from shardkit.checkpoint.zero3.gather import full_frozen_params
from shardkit.checkpoint.zero3.reader import open_zero3_checkpoint
from shardkit.core.errors import CheckpointError, UsageError
from shardkit.core.files import file_kind

if TYPE_CHECKING:
    import torch

OUTPUT_DTYPES = ("fp32", "bf16", "fp16")


@dataclass
class ConsolidateResult:
    """What ``consolidate_zero3`` wrote."""

    output: Path
    tensors: int
    """Tensors in the file (parameters, buffers and tied aliases)."""
    parameters: int
    """Elements of trainable and frozen parameters (tied aliases counted once)."""
    bytes: int
    source_world_size: int
    tag: str
    verified: str = "sha256"
    """How the source was checked before it was read: 'sha256', 'sizes' (--no-verify) or 'none' (no manifest)."""


_OUT_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


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
) -> ConsolidateResult:
    """Write the full weights of the ZeRO-3 checkpoint at ``checkpoint`` to ``output`` (.safetensors).

    Floating-point tensors are written as ``dtype`` (the fp32 masters by default, like
    zero_to_fp32); integer buffers keep their dtype. Tied parameters (``shared_params``) are written
    under each name, since safetensors cannot alias. The file appears atomically (temp name,
    fsync, rename).

    The source is checked against its manifest first (sizes, and sha256 unless ``verify=False``);
    one without a manifest is read with a warning through ``warn`` (default ``warnings.warn``). An
    existing output is replaced only with ``force=True`` and only when it is a regular file; a
    path inside a checkpoint folder (or a root's ``latest``) is never written. ``workers``: source
    files hashed and rank files copied at once, each copier owning the disjoint byte ranges of its
    rank's pieces (default ``default_workers``).
    """

    if workers is not None and workers < 1:
        raise UsageError(f"workers={workers}: must be at least 1 (rank files copied at once)")
    if dtype not in OUTPUT_DTYPES:
        raise UsageError(f"--dtype {dtype!r}: choose one of {list(OUTPUT_DTYPES)}")
    out_name = _OUT_NAMES[dtype]
    source_dir, _ = resolve_tag_dir(checkpoint)
    out = check_output_file(Path(output), source_dir, force=force)
    n_files = sum(1 for f in source_dir.iterdir() if f.name.endswith(".pt"))
    workers = workers or default_workers(max(1, n_files))
    checked = verify_before_reading(source_dir, checksums=verify, workers=workers)
    for note in checked.warnings:
        (warn or warn_unverified)(note)
    # The common case (fp32 out, no buffers, no frozen parameters) never imports torch: the files
    # are parsed by read_structure and every byte is copied file to file. The tag folder that was
    # verified is opened, not ``checkpoint`` again: a save between the two could move 'latest'
    # to a tag nobody verified.
    ckpt = open_zero3_checkpoint(source_dir, torch_free=dtype == "fp32")
    if ckpt.torch_free and (ckpt.model_state.get("buffer_names") or (include_frozen and ckpt.frozen_param_shapes)):
        ckpt = open_zero3_checkpoint(source_dir)
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

    # atomic_open: a temporary sibling, fsynced and renamed over ``out`` only when every byte is
    # written; positional writes go straight to its descriptor (nothing is buffered in the file object)
    outcome = f"nothing written: the partial file was removed, {out} is unchanged"
    for note in remove_stale_temps(out):  # a run killed (SIGKILL, OOM) before it could remove its own
        (warn or warn_unverified)(note)
    with disk_full_named(out, outcome), atomic_open(out, "wb") as fh:
        fd = fh.fileno()
        write_header(fd, header, total)
        for name, t in small.items():
            buf = _as_bytes(t)
            for at in targets(name):
                os.pwrite(fd, buf, at)
        # Rank-major: one rank file at a time; each rank's piece of a parameter is a contiguous
        # run of the row-major flattened tensor, so it goes to one offset. Without a cast the
        # bytes go file to file in the kernel (copy_file_range): nothing is paged into this process.
        if ckpt.torch_free or out_name == "float32":
            # each rank's pieces go to their own byte ranges of the output: copied by rank files
            # at once (copy_file_range runs in the kernel, without the GIL)
            _in_parallel([lambda r=r: _copy_rank_fp32(ckpt, r, fd, targets) for r in range(ckpt.world_size)], workers)
        else:
            # a cast builds each piece in memory: one rank file mapped at a time keeps the peak low
            for rank in range(ckpt.world_size):
                with ckpt.open_rank(rank) as part:
                    for slot in ckpt.slots:
                        start, stop = slot.rank_range(rank)
                        if stop > start:
                            buf = _as_bytes(part.param_slice(slot, FP32).to(_torch_dtype(out_name)))
                            for at in targets(slot.name):
                                os.pwrite(fd, buf, at + start * entries[slot.name].itemsize)
    n_params = sum(s.numel for s in ckpt.slots) + sum(
        small[n].numel() for n in ckpt.frozen_param_shapes if n in small
    )
    return ConsolidateResult(out, len(entries), n_params, total, ckpt.world_size, ckpt.tag, checked.level)


#: Files whose presence makes a folder a checkpoint (tag) folder: shardkit's completion marker and
#: the rank-0 files DeepSpeed writes. Nothing is ever written inside such a folder.
_CHECKPOINT_MARKERS = ("shardkit_manifest.json", "zero_pp_rank_0_mp_rank_00_model_states.pt",
                       "mp_rank_00_model_states.pt")


def _in_parallel(tasks: list[Callable[[], None]], workers: int) -> None:
    """Run ``tasks`` ``workers`` at a time; the first failure is raised once all have stopped."""
    if workers <= 1 or len(tasks) <= 1:
        for task in tasks:
            task()
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shardkit-consolidate") as pool:
        futures = [pool.submit(task) for task in tasks]
    for f in futures:
        f.result()


def check_output_file(output: Path, source_dir: Path, *, force: bool = False) -> Path:
    """The path ``consolidate`` may write for ``-o output``, or a UsageError saying why not.

    A folder gets ``model.safetensors`` inside. Refused whatever ``force`` says: a path inside the
    checkpoint being read or inside any checkpoint folder (a tag folder, a staging folder, or a
    root holding ``latest``), a checkpoint root's ``latest``, and
    anything that exists and is not a regular file (a device, fifo, folder, or a link to one; as
    root, replacing ``/dev/null`` would make it a plain file). An existing regular file is
    replaced only with ``force``; a symlink to one keeps pointing at the new file.
    """

    out = output / "model.safetensors" if output.is_dir() else output
    real = Path(os.path.realpath(out))
    src = source_dir.resolve()
    if real == src or real.is_relative_to(src):
        raise UsageError(f"-o {output}: {real} is inside the checkpoint being read ({source_dir}); writing there "
                         "would change the checkpoint. Write the weights to another folder")
    if real.name == LATEST_NAME and (real.parent == src.parent or (real.parent / LATEST_NAME).is_file()):
        raise UsageError(f"-o {output}: {real} is a checkpoint's '{LATEST_NAME}' pointer; replacing it would "
                         "break resuming from that folder. Choose another file name")
    for folder in real.parents:
        # a root (the folder holding 'latest') is a checkpoint folder too: its next save's cleanup
        # and DeepSpeed's loaders treat whatever is in it as theirs
        if (folder.name.startswith(STAGING_PREFIX) or any((folder / m).exists() for m in _CHECKPOINT_MARKERS)
                or os.path.lexists(folder / LATEST_NAME)):
            raise UsageError(f"-o {output}: {folder} is a checkpoint folder; consolidate never writes into one. "
                             "Write the weights to another folder")
    if not os.path.lexists(out):
        return out
    try:
        mode = os.stat(out).st_mode
    except FileNotFoundError:
        raise UsageError(f"-o {output}: is a symlink to {real}, which does not exist; pass the target path or "
                         "remove the link") from None
    if not stat.S_ISREG(mode):
        link = f" (a symlink to {real})" if out.is_symlink() else ""
        raise UsageError(f"-o {output}{link}: exists and is {file_kind(mode)}, not a regular file; consolidate only "
                         "ever replaces regular files. Pass a file path")
    if not force:
        raise UsageError(f"-o {output}: {out} already exists; pass --force to replace it, or choose another name")
    # a symlink stays a symlink: its target is replaced (atomically, in the target's folder)
    return real if out.is_symlink() else out


def _torch_dtype(name: str) -> "torch.dtype":
    import torch

    return getattr(torch, name)


def _as_bytes(t: "torch.Tensor") -> memoryview:
    import torch

    return memoryview(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())


def _copy_rank_fp32(ckpt: Zero3Checkpoint, rank: int, dst_fd: int, targets) -> None:
    """Every fp32 piece rank ``rank`` holds, file to file, to its place in the output."""
    osd = read_structure(ckpt.optim_files[rank])["optimizer_state_dict"]
    flats = osd["fp32_flat_groups"]
    src_fd = os.open(ckpt.optim_files[rank], os.O_RDONLY)
    try:
        for slot in ckpt.slots:
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


def _small_tensors(ckpt: Zero3Checkpoint, out_name: str, include_frozen: bool) -> dict[str, "torch.Tensor"]:
    """Buffers and frozen parameters (assembled whole in memory), cast as zero_to_fp32 casts them."""
    tensors = dict(ckpt.buffers())
    if include_frozen:
        tensors.update(full_frozen_params(ckpt))
    out_dtype = _torch_dtype(out_name)
    return {n: (t.to(out_dtype) if t.is_floating_point() else t) for n, t in tensors.items()}


#: A temporary file whose writer is gone and that has not changed for this long is a leftover.
STALE_TEMP_AGE_S = 120.0


def remove_stale_temps(out: Path, min_age_s: float = STALE_TEMP_AGE_S) -> list[str]:
    """Remove the hidden temporary siblings (``.NAME.tmp-PID-XXXXXXXX``, ``atomic_open``'s) that a
    consolidate killed outright left beside ``out``: SIGTERM and Ctrl-C remove their own, SIGKILL or
    the OOM killer cannot, and each is as large as the output. Only a file whose writer pid is not
    running here *and* that has not changed for ``min_age_s`` is removed (on a shared filesystem the
    pid may be another host's, whose live writer keeps changing it). Returns one note per removal."""
    import time

    notes = []
    for tmp in out.parent.glob(f".{out.name}.tmp-*"):
        pid_text = tmp.name[len(f".{out.name}.tmp-"):].split("-", 1)[0]
        if not pid_text.isdigit() or _pid_running(int(pid_text)):
            continue
        try:
            info = tmp.lstat()
            if not stat.S_ISREG(info.st_mode) or time.time() - info.st_mtime < min_age_s:
                continue
            tmp.unlink()
        except OSError:
            continue
        notes.append(f"removed {tmp} ({info.st_size:,} bytes): the partial output of an earlier consolidate (pid "
                     f"{pid_text}, no longer running) that was killed before it could remove it")
    return notes


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True
