"""The opening every one-process convert target shares (``--to zero1|zero2``, ``--to universal``): refuse
a split run and the layouts nothing converts, resolve and verify the source, check the output folder,
read the checkpoint model once, and refuse a reader that describes the weights only. Everything here
runs before anything is written. (``--to fsdp2`` and ``--to zero3`` split across processes and hash
the source while they write: their verification differs; ``--to zero3`` shares ``locate``, the part before it.)"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shardkit.checkpoint.layout.support import refuse_unsupported
from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.ops.export.sources import Source, resolve_source
from shardkit.checkpoint.readers.registry import read_checkpoint
from shardkit.core.errors import CheckpointError, UsageError
from shardkit.storage.pipeline import SourceCheck, check_output_root, output_tag, verify_before_reading
from shardkit.storage.shared_save import launch_from_env


@dataclass
class OpenedSource:
    """A source ready to convert: where it is, where it goes, how it was checked, what it holds."""

    found: Source
    tag: str
    """The output tag (``--tag``, else the source's)."""
    root: Path
    checked: SourceCheck
    ckpt: TrainingCheckpoint

    @property
    def tag_dir(self) -> Path:
        return self.found.tag_dir

    @property
    def engine(self) -> str:
        """The engine that saved the source, as the manifests name it ('fsdp2' for a DCP folder)."""
        origin = self.ckpt.scalars.get("source") or {}
        return "fsdp2" if self.ckpt.format == "dcp" else str(origin.get("engine") or self.ckpt.format)


def open_source(source: str | Path, output: str | Path, *, target: str, label: str, needs: str,
                same_format: Callable[[Source], str | None], tag: str | None, force: bool, verify: bool,
                warn: Callable[[str], None]) -> OpenedSource:
    """``source`` opened for ``convert --to <target>`` into ``output``. ``same_format(found)``: the
    refusal (exit 2) of a source already in the target's format, None otherwise; ``needs``: what the
    target holds that a weights-only reader cannot give ("fp32 masters and Adam moments"); ``label``: the
    target's name in that sentence ("ZeRO-2")."""
    launch = launch_from_env()
    if launch.distributed:
        raise UsageError(f"convert --to {target} runs in one process, and {launch.launcher} started {launch.world}: "
                         "run shardkit convert once, without srun/torchrun")
    found, out_tag, root = locate(source, output, target=target, same_format=same_format, tag=tag, force=force)
    checked = verify_before_reading(found.tag_dir, checksums=verify)  # also refuses a link out of it, manifest or not
    for note in checked.warnings:
        warn(note)
    ckpt = read_checkpoint(found.kind, found.tag_dir)
    refuse_weights_only(ckpt, found, target, f"and a {label} checkpoint needs {needs}")
    return OpenedSource(found, out_tag, root, checked, ckpt)


def locate(source: str | Path, output: str | Path, *, target: str, same_format: Callable[[Source], str | None],
           tag: str | None, force: bool, rank: int = 0) -> tuple[Source, str, Path]:
    """Where ``convert --to <target>`` reads and writes, before anything is verified or read: the source
    (a layout nothing converts correctly, or one ``same_format`` refuses, exit 2), the output tag and root.
    Only process ``rank`` 0 checks the output: the others write into the staging folder it claims after."""
    refuse_unsupported(source, f"convert --to {target}")  # a layout nothing converts correctly: before any tensor
    found = resolve_source(source)
    same = same_format(found)
    if same is not None:
        raise UsageError(same)
    out_tag = output_tag(tag, source, found.tag_dir, found.tag_dir.name)
    if rank == 0:
        check_output_root(Path(output), out_tag, found.tag_dir, force=force)
    return found, out_tag, Path(output)


def refuse_weights_only(ckpt: TrainingCheckpoint, found: Source, target: str, why: str) -> None:
    """CheckpointError when ``found``'s reader described the weights only: every convert target carries
    the optimizer state. ``why``: what the target would lose ("so an FSDP2 resume would start Adam from
    zero")."""
    if not ckpt.optimizer_described:
        raise CheckpointError(
            f"{found.tag_dir}: shardkit's {found.kind} reader describes this checkpoint's weights only, not its "
            f"optimizer state, {why}; convert --to {target} takes the kinds whose reader describes the optimizer "
            "(`shardkit inspect` says which). For the weights alone: shardkit export")
