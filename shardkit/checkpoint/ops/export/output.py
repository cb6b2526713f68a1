"""The export's output folder: refuse an ``-o`` that would destroy something, assemble the folder
in a staging sibling, seal it with a shardkit manifest and rename it into place last, so ``-o``
is either absent, the previous export, or complete.

``-o`` is replaced only when it is empty or holds an earlier shardkit export (its manifest says
so) and ``--force`` is given: a folder shardkit did not make (a ``save_pretrained`` folder, a
checkpoint, anything else) is never replaced. Staging folders name their writer
(``storage.sibling_staging``), so ``remove_stale_staging`` clears what killed runs left.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from shardkit.core.errors import CheckpointError, UsageError
from shardkit.storage.atomic import signals_deferred
from shardkit.storage.manifest import MANIFEST_NAME, read_manifest, seal
from shardkit.storage.pipeline import refuse_output_in_checkpoint
from shardkit.storage.tags import tag_problem

#: ``extra["kind"]`` of an export's manifest: what makes a folder one shardkit may replace.
EXPORT_KIND = "hf_export"


def _is_export(folder: Path) -> bool:
    if not (folder / MANIFEST_NAME).is_file():
        return False
    try:
        return read_manifest(folder).extra.get("kind") == EXPORT_KIND
    except CheckpointError:
        return False


def check_output_dir(output: Path, sources: list[Path], *, force: bool) -> None:
    """Refuse ``-o output`` when writing it would destroy something (see the module doc)."""
    refuse_output_in_checkpoint(output, sources, writes="the model folder", suffix="_hf")
    if not output.exists() and not output.is_symlink():
        return
    if output.is_symlink() or not output.is_dir():
        raise UsageError(f"-o {output}: exists and is not a folder; pass a new folder (it becomes the model folder "
                         "from_pretrained loads)")
    entries = sorted(e.name for e in output.iterdir())
    if not entries:
        return
    if not _is_export(output):
        shown = entries[:5] + (["..."] if len(entries) > 5 else [])
        raise UsageError(f"-o {output}: folder is not empty and was not written by shardkit export (it holds {shown}, "
                         f"and no {MANIFEST_NAME} of an export); it is never replaced, even with --force. Pass a new or "
                         "empty folder")
    if not force:
        raise UsageError(f"-o {output}: already holds a shardkit export; pass --force to replace it, or export to "
                         "another folder")


def seal_export(staged: Path, final: Path, *, dtype: str, extra: dict[str, Any]) -> None:
    """Write the manifest (every file's size and digest) into ``staged``, last."""
    tag = final.name if tag_problem(final.name) is None else "export"
    seal(staged, engine="torch", world_size=1, tag=tag, dtype=dtype, extra={"kind": EXPORT_KIND, **extra})


def remove_staging(staged: Path) -> None:
    """Remove the staging folder. A second SIGTERM/SIGINT arriving meanwhile (a scheduler repeating
    its cancel) is held until the folder is gone: its handler's exception would otherwise cut the
    removal short and leave a model-sized folder behind. Held by swapping the handlers
    (``signals_deferred``), not by a mask on the main thread: the kernel hands the signal to another
    thread (the progress line's) while the main thread blocks it, and the handler then ran anyway."""
    with signals_deferred():
        shutil.rmtree(staged, ignore_errors=True)
