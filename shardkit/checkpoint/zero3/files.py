"""Where a ZeRO-3 checkpoint's files are: the names DeepSpeed gives each rank's files, and which tag
folder a path designates (``resolve_tag_dir``: a root holding ``latest``, a tag folder or one rank
file). What the files hold is described by ``reader``; their partitions are read through
``checkpoint``.
"""

from __future__ import annotations

import re
from pathlib import Path

from shardkit.core.errors import CheckpointError
from shardkit.storage.listing import FolderListing, list_folder
from shardkit.storage.tags import LATEST_NAME, REPLACED_MARK, STAGING_PREFIX, latest_tag

MODEL_FILE = "zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
OPTIM_FILE = "{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
#: Any per-rank file of a ZeRO checkpoint; groups: the bf16 prefix, the data-parallel rank, the
#: model-parallel rank, and ``model`` or ``optim``.
RANK_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(model|optim)_states\.pt$")


def resolve_tag_dir(path: str | Path, listing: FolderListing | None = None) -> tuple[Path, str]:
    """Checkpoint root (with ``latest``), tag folder, or one rank file -> (tag folder, tag). ``listing``: of
    ``path``, already taken (``resolve_listed``), so the folder is not listed again here."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: checkpoint path does not exist")
    if p.is_file():
        if RANK_FILE.match(p.name):
            return p.parent, p.parent.name
        if p.name == "latest":
            return resolve_tag_dir(p.parent)
        raise CheckpointError(
            f"{p}: is a file, expected a DeepSpeed checkpoint folder (the one holding 'latest') or a tag folder"
        )
    if p.name.startswith(STAGING_PREFIX):
        # the same rule as verify.resolve_checkpoint: a staging folder is never loaded
        raise CheckpointError(
            f"{p}: is the staging directory of a save that never completed (killed or failed before it was "
            f"renamed into place). Resume from the checkpoint named in {p.parent / LATEST_NAME}"
        )
    if listing is None or not listing.describes(p):
        listing = list_folder(p)  # the command's one listing of it, where a command holds one (storage.listing)
    if any(RANK_FILE.match(name) for name in listing.files):
        return p, p.name
    latest = p / LATEST_NAME
    tag = latest_tag(p)  # one folder name inside p, or a CheckpointError naming the pointer file
    if tag is not None:
        tag_dir = p / tag
        if not tag_dir.is_dir():
            raise CheckpointError(
                f"{latest}: points to tag {tag!r} but {tag_dir} does not exist (a save interrupted before "
                "its files were written, or a partial copy). Pass an existing tag folder instead."
            )
        return tag_dir, tag
    tags = sorted(d.name for d in p.iterdir() if d.is_dir() and not d.name.startswith(STAGING_PREFIX)
                  and REPLACED_MARK not in d.name and any(RANK_FILE.match(f.name) for f in d.iterdir()))
    if tags:
        raise CheckpointError(
            f"{p}: has no 'latest' file, so the tag to read is ambiguous; found tags {tags}. "
            f"Pass the tag folder, e.g. {p / tags[-1]}"
        )
    if (p / "mp_rank_00_model_states.pt").exists():
        raise CheckpointError(
            f"{p}: is a ZeRO-0/1/2 checkpoint (mp_rank_00_model_states.pt, no per-rank zero_pp_rank files); "
            "shardkit's reader handles ZeRO-3. Use DeepSpeed's zero_to_fp32.py for this one."
        )
    raise CheckpointError(f"{p}: no DeepSpeed ZeRO-3 checkpoint here (no 'latest' file, no zero_pp_rank_* files)")


def resolve_listed(path: str | Path) -> tuple[Path, FolderListing]:
    """``resolve_tag_dir``'s tag folder with the one listing of it the steps after share (``storage.listing``):
    a tag folder given is listed once, for the resolution and the rest; a root holding ``latest``, then its tag."""
    p = Path(path)
    given = list_folder(p) if p.is_dir() else None
    tag_dir, _ = resolve_tag_dir(p, given)
    return tag_dir, given if given is not None and given.describes(tag_dir) else list_folder(tag_dir)
