"""Checkpoint tags and the ``latest`` pointer, in one place: which names a tag may have
(``tag_problem``, ``check_tag``), the names the save sequence keeps for itself (``LATEST_NAME``,
``STAGING_PREFIX``, ``REPLACED_MARK``), and which tag a root's ``latest`` names (``read_latest``;
``latest_tag`` for a reader about to open ``root/<tag>``).

Verify, the manifest, the format readers and the operations all ask these questions of a tag; they
ask this module, not one another. Writing ``latest`` is part of publishing a save
(``atomic.write_latest``, ``atomic.publish_tag``).
"""

from __future__ import annotations

import os
from pathlib import Path

from shardkit.core.errors import CheckpointError, UsageError
from shardkit.core.files import FileReadError, read_regular_file

#: Name of the pointer file DeepSpeed's ``load_checkpoint`` reads (content: the tag, no newline).
LATEST_NAME = "latest"
#: Prefix of directories a save is staged in; never a valid tag, skipped by verify and loaders.
STAGING_PREFIX = ".shardkit-tmp-"
#: Marks ``<tag><REPLACED_MARK><hex>``: a complete, loadable copy (hard links) of a tag that is being
#: saved again; ``latest`` names it while the tag itself is swapped, so it never dangles.
REPLACED_MARK = ".shardkit-replaced-"

#: ``latest`` holds one tag name; anything longer is not a pointer (and is never read whole).
MAX_LATEST_BYTES = 4096


def also_there(others: list[str] | tuple[str, ...]) -> str:
    """``"; also there: a, b"`` naming the checkpoints (tags, ``checkpoint-N`` folders) a folder holds beside the
    one a command took, or ``""`` when there are none: every "took the newest/``latest``" line says it alike."""
    return f"; also there: {', '.join(others)}" if others else ""


def tag_problem(tag: object) -> str | None:
    """Why ``tag`` cannot name a checkpoint folder inside a root, or None when it can.

    A tag becomes ``root/<tag>`` and the content of ``root/latest``; names the save sequence uses
    for itself (staging folders, set-aside copies, the pointer) would be deleted or misread by the
    next save, and separators or ``..`` would put the checkpoint outside the root.
    """
    if not isinstance(tag, str) or not tag:
        return "a tag must be a non-empty folder name"
    if tag in (".", ".."):
        return "'.' and '..' are not folder names"
    if "/" in tag or "\\" in tag or (os.sep in tag) or "\0" in tag:
        return "a tag is one folder name: path separators and NUL are not allowed"
    if tag == LATEST_NAME:
        return f"{LATEST_NAME!r} is the pointer file DeepSpeed reads the tag from"
    if tag.startswith(STAGING_PREFIX):
        return f"names starting with {STAGING_PREFIX!r} are staging folders, deleted by the next save"
    if REPLACED_MARK in tag:
        return f"names containing {REPLACED_MARK!r} are set-aside copies, deleted by the next save"
    if tag.startswith(".") and ".tmp-" in tag:
        return "hidden names containing '.tmp-' are temporaries of atomic writes, deleted by the next save"
    if len(tag.encode("utf-8", "surrogateescape")) > 255:
        return "longer than the 255 bytes a folder name may have"
    return None


def check_tag(tag: object, what: str = "--tag") -> str:
    """``tag`` when it can name a checkpoint folder; UsageError naming the value and why otherwise."""
    why = tag_problem(tag)
    if why is not None:
        raise UsageError(f"{what} {tag!r}: not a usable checkpoint tag ({why}); choose another name, "
                         "e.g. global_step100")
    return tag  # type: ignore[return-value]


def read_latest(root: str | os.PathLike[str], name: str = LATEST_NAME) -> str | None:
    """The tag ``root/latest`` names, or None when there is no pointer (nothing there, or a folder).

    Read with ``read_regular_file``: the type is checked on the open descriptor, so a FIFO or
    device swapped in after a check is refused instead of blocking the reader."""
    p = Path(root) / name
    fix = (f"Write the tag of a complete checkpoint into it (e.g. `echo -n TAG > {p}`), or pass the tag "
           "directory itself")
    try:
        data = read_regular_file(p, MAX_LATEST_BYTES)
    except FileReadError as exc:
        if exc.reason in ("missing", "folder"):
            return None
        if exc.reason == "too_large":
            raise CheckpointError(f"{p}: more than {MAX_LATEST_BYTES} bytes, not a tag name; the pointer file is "
                                  f"corrupted or was replaced. {fix}") from None
        raise CheckpointError(f"{exc}; 'latest' must be a small text file holding one tag. {fix}") from None
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(
            f"{p}: not a tag name ({len(data)} bytes, not UTF-8 text: {data[:32]!r}); the pointer file is "
            f"corrupted. {fix}"
        ) from None


def latest_tag(root: str | os.PathLike[str]) -> str | None:
    """``read_latest`` for a reader about to open ``root/<tag>``: the tag must be one folder name
    inside ``root`` ('/etc' or '../x' would make ``root / tag`` point anywhere), so anything else
    raises one CheckpointError naming the pointer file, the value and the fix. None: no pointer."""
    tag = read_latest(root)
    if tag is None:
        return None
    p = Path(root) / LATEST_NAME
    why = None
    if not tag:
        why = "it is empty"
    elif tag in (".", "..") or "/" in tag or "\\" in tag or os.sep in tag or "\0" in tag:
        why = "a tag is one folder name inside the checkpoint folder: no path separators, '.', '..' or NUL"
    elif tag.startswith(STAGING_PREFIX):
        why = f"names starting with {STAGING_PREFIX!r} are staging folders of saves that never completed"
    if why is not None:
        raise CheckpointError(
            f"{p}: holds {tag[:200]!r}, which is not a checkpoint tag ({why}); the pointer file is corrupted or "
            f"was edited. Write the tag of a complete checkpoint into it (e.g. `echo -n global_step100 > {p}`), "
            "or pass the tag folder itself"
        )
    return tag
