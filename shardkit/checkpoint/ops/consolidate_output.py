"""What a consolidation (``consolidate``) records and checks apart from the copy: the result record, where
``-o`` may write (``check_output_file``) and the removal of the temporary files a killed run left.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from shardkit.core.errors import UsageError
from shardkit.core.files import file_kind
from shardkit.storage.pipeline import refuse_output_in_checkpoint
from shardkit.storage.tags import LATEST_NAME


@dataclass
class ConsolidateResult:
    """What a consolidation wrote (``consolidate_checkpoint``)."""

    output: Path
    tensors: int
    """Tensors in the file (parameters, buffers and tied aliases)."""
    parameters: int
    """Elements of trainable and frozen parameters (tied aliases counted once)."""
    bytes: int
    source_world_size: int
    """Ranks that saved the source; 0 where it does not record them (a universal checkpoint)."""
    tag: str
    verified: str = "hash"
    """How the source was checked before it was read: 'hash' (sizes and digests), 'sizes' (--no-verify) or
    'none' (no manifest)."""
    rank: int = 0
    """This process's share (under srun/torchrun; 0 alone)."""
    processes: int = 1
    """Processes that copied the pieces (under srun/torchrun; 1 alone)."""
    share_pieces: int = 0
    """Pieces (one source file's run of one tensor) this process copied."""
    share_bytes: int = 0
    """Bytes this process copied."""
    launcher: str = "single process"


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
    if real.name == LATEST_NAME and (real.parent == src.parent or (real.parent / LATEST_NAME).is_file()):
        raise UsageError(f"-o {output}: {real} is a checkpoint's '{LATEST_NAME}' pointer; replacing it would "
                         "break resuming from that folder. Choose another file name")
    # the source, its root, a folder holding it or any checkpoint folder: the check every command's output runs
    refuse_output_in_checkpoint(out, [source_dir], writes="the weights", suffix=".safetensors")
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


#: A temporary file whose writer is gone and that has not changed for this long is a leftover.
STALE_TEMP_AGE_S = 120.0


def remove_stale_temps(out: Path, min_age_s: float = STALE_TEMP_AGE_S) -> list[str]:
    """Remove the hidden temporary siblings (``.NAME.tmp-PID-XXXXXXXX``, ``atomic_open``'s) that a
    consolidate killed outright left beside ``out``: SIGTERM and Ctrl-C remove their own, SIGKILL or
    the OOM killer cannot, and each is as large as the output. Only a file whose writer pid is not
    running here *and* that has not changed for ``min_age_s`` is removed (on a shared filesystem the
    pid may be another host's, whose live writer keeps changing it). Returns one note per removal."""

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
