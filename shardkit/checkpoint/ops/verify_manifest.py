"""``shardkit verify --write-manifest``: the manifest of a plain save (no shardkit manifest) that passed the
structural check (``verify_structure``), written once so later verifies compare digests.

A manifest vouches for every byte it lists, so it is written only over what was checked: a folder that
passed whole, whose every file is a file of its own. A link leading out of the folder is never read through
(``storage.links``, as every command refuses it), and a link leading nowhere (a missing target, a loop) is no
file a manifest could list: either refuses the manifest, naming the link, and nothing is written.
"""

from __future__ import annotations

from pathlib import Path

from shardkit.checkpoint.ops.verify_structure import StructureReport
from shardkit.core.errors import CheckpointError, UsageError
from shardkit.storage.links import links_nowhere, refuse_links_leaving
from shardkit.storage.manifest import MANIFEST_NAME, Manifest, seal

#: Kinds whose manifest ``shardkit verify`` then finds (the tag or DCP folder it resolves to).
MANIFEST_KINDS = {"zero3": "deepspeed", "zero12": "deepspeed", "dcp": "fsdp2"}


def write_plain_manifest(report: StructureReport) -> Manifest:
    """Record the sizes and digests of a checkpoint that passed ``verify_structure``, in the folder a later
    ``shardkit verify`` reads its manifest from; every file is hashed (its bytes read once)."""
    if not report.ok or report.kind is None or report.tensor_folder is None:
        raise CheckpointError(f"{report.subject}: not whole, so no manifest is written (it would vouch for damaged "
                              "files); fix the errors verify reports first")
    engine = MANIFEST_KINDS.get(report.kind)
    if engine is None:
        raise UsageError(f"--write-manifest: {report.subject} is a {report.layout or report.kind} checkpoint; a manifest "
                         f"is written only where `shardkit verify` reads one back ({', '.join(MANIFEST_KINDS)}: the tag "
                         "or DCP folder)")
    folder = Path(report.tensor_folder)
    if (folder / MANIFEST_NAME).exists():
        raise UsageError(f"--write-manifest: {folder / MANIFEST_NAME} exists already; verify checks against it")
    # verify_structure names both as findings; checked again here, where the files are about to be hashed
    refuse_links_leaving(folder, "write a manifest for")
    nowhere = links_nowhere(folder)
    if nowhere:
        rel, target = nowhere[0]
        raise CheckpointError(
            f"refusing to write a manifest for {folder}: {folder / rel} is a symbolic link to {target!r}, which leads "
            "nowhere, and a manifest lists the folder's files. Nothing was written. Fix: remove the link (rm "
            f"{folder / rel}), then run --write-manifest again")
    try:
        return seal(folder, engine=engine, world_size=report.world_size or 1, step=report.step,
                    zero_stage=report.stage if engine == "deepspeed" else None)
    except OSError as exc:
        raise CheckpointError(f"{folder}: cannot write {MANIFEST_NAME} ({exc}); is the folder writable?") from exc
