"""Repartition a ZeRO-3 checkpoint for a new data-parallel world size, in DeepSpeed's own format.

DeepSpeed's ``engine.load_checkpoint`` refuses a checkpoint saved at another world size
("Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is not
currently supported", ``engine._load_zero_checkpoint``); its answer is an offline
``ds_to_universal`` conversion into one folder per parameter plus ``load_universal: true``.
``reshard_zero3`` instead writes the per-rank files a run at the new world size would itself have
saved, so the plain ``load_checkpoint`` takes them unchanged:

- parameters are regrouped into sub-groups exactly as ZeRO-3 builds them at the new size
  (``DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups``: split a param group whenever the
  running sum of ``partition_numel()`` reaches ``sub_group_size``);
- each parameter gets ``ceil(numel / M)`` elements per rank, the last rank zero-padded, and the
  fp32 masters and every per-element optimizer state (``exp_avg``, ``exp_avg_sq``) are copied
  bit for bit; ``step`` and the param-group hyperparameters are kept;
- ``dp_world_size``/``partition_count`` become M, ``param_shapes`` follow the new sub-groups, and
  frozen parameter fragments are repartitioned too.

Memory stays near one output tensor: each rank file is written with torch's own zip writer, and
every tensor record is produced (from memory-mapped source rank files, one at a time) only when
it is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from shardkit.checkpoint.atomic import LATEST_NAME, check_tag, disk_full_named, os_errors_named
from shardkit.checkpoint.manifest import MANIFEST_NAME, describe_files
from shardkit.checkpoint.safe_load import safe_torch_load
from shardkit.checkpoint.save import atomic_checkpoint
from shardkit.checkpoint.stream import stream_save
from shardkit.checkpoint.verify import verify_before_reading, warn_unverified
from shardkit.checkpoint.zero3.reader import (
    MODEL_FILE,
    OPTIM_FILE,
    full_frozen_params,
    open_zero3_checkpoint,
    resolve_tag_dir,
)
from shardkit.checkpoint.zero3.repartition import (
    client_state_note,
    model_state_for_rank,
    optim_state_for_rank,
    plan_layout,
)
from shardkit.config.loading import config_digest
from shardkit.errors import UsageError


@dataclass
class ReshardResult:
    """What ``reshard_zero3`` wrote."""

    output: Path
    """The new checkpoint root (holds ``latest``)."""
    tag: str
    world_size: int
    source_world_size: int
    files: list[Path]
    bytes: int
    manifest: Path | None
    notes: list[str] = field(default_factory=list)
    """Things the user should know (client_state taken from rank 0 ...)."""
    verified: str = "sha256"
    """How the source was checked before it was read: 'sha256', 'sizes' (--no-verify) or 'none' (no manifest)."""


@os_errors_named("resharding the checkpoint")
def reshard_zero3(
    checkpoint: str | Path,
    output: str | Path,
    world_size: int,
    *,
    tag: str | None = None,
    sub_group_size: int | None = None,
    manifest: bool = True,
    force: bool = False,
    verify: bool = True,
    warn: Callable[[str], None] | None = None,
) -> ReshardResult:
    """Write ``checkpoint`` repartitioned for ``world_size`` ranks under ``output/<tag>`` + ``output/latest``.

    ``sub_group_size`` must match the ``zero_optimization.sub_group_size`` the resuming run uses
    (default: the one saved in the checkpoint's config, else DeepSpeed's default 1e9). The new tag
    folder is staged and renamed into place, ``latest`` moves last, and a shardkit manifest is
    written unless ``manifest=False``.

    Before anything is read the source is checked against its manifest (sizes, and sha256 unless
    ``verify=False``): a corrupted source is refused, since the new manifest would vouch for the
    corruption. ``output`` must be new, empty, or a shardkit checkpoint folder; an existing
    ``output/<tag>`` is replaced only with ``force=True``. ``warn`` receives what the user should
    know before trusting the result (default: ``warnings.warn``).
    """
    warn = warn or warn_unverified
    source_dir, source_tag = resolve_tag_dir(checkpoint)
    tag = check_tag(tag) if tag is not None else _source_tag_as_new_tag(checkpoint, source_dir, source_tag)
    root = Path(output)
    final = root / tag
    check_output_root(root, tag, source_dir, force=force)
    checked = verify_before_reading(source_dir, checksums=verify)
    for note in checked.warnings:
        warn(note)
    verified = checked.level
    # the tag folder that was verified, not ``checkpoint`` again: a save in between could move
    # 'latest' to a tag nobody verified, and the new manifest would say "verified": "sha256"
    ckpt = open_zero3_checkpoint(source_dir)
    layout = plan_layout(ckpt, world_size, sub_group_size)

    # Real DeepSpeed objects (loss scaler, ZeroStageEnum) are re-saved, so resolve them for real.
    optim0 = safe_torch_load(ckpt.optim_files[0], mmap=True, real_deepspeed_objects=True)
    frozen = full_frozen_params(ckpt)
    prefix = "bf16_" if ckpt.optim_files[0].name.startswith("bf16_") else ""
    written = []
    facts = dict(
        world_size=world_size, step=ckpt.model_state.get("global_steps"), zero_stage=3, dtype=ckpt.precision,
        config_digest=config_digest(ckpt.ds_config or None),
        extra={"resharded_from": {"path": str(ckpt.tag_dir), "world_size": ckpt.world_size,
                                  "ds_version": ckpt.ds_version, "verified": verified}},
    )
    outcome = f"nothing written: the staging folder was removed, {root / LATEST_NAME} is unchanged"
    with atomic_checkpoint(root, tag, engine="deepspeed", manifest=manifest, **facts) as save:
        staged = save.path
        hasher = _BackgroundHasher(staged) if manifest else None
        try:
            for rank in range(world_size):
                model_path = staged / MODEL_FILE.format(rank=rank)
                with disk_full_named(model_path, outcome):
                    _save_small(model_state_for_rank(ckpt, layout, rank, frozen), model_path)
                optim_path = staged / OPTIM_FILE.format(prefix=prefix, rank=rank)
                with disk_full_named(optim_path, outcome):
                    stream_save(optim_state_for_rank(ckpt, layout, rank, optim0), optim_path)
                written += [model_path, optim_path]
                if hasher:
                    hasher.add(model_path, optim_path)
            if hasher:
                save.known_files = hasher.entries()
        finally:
            if hasher:
                hasher.close()  # before the staging folder is removed on failure
    files = [final / p.name for p in written]
    return ReshardResult(
        output=root,
        tag=tag,
        world_size=world_size,
        source_world_size=ckpt.world_size,
        files=files,
        bytes=sum(f.stat().st_size for f in files),
        manifest=final / MANIFEST_NAME if manifest else None,
        notes=[n for n in (client_state_note(ckpt, world_size),) if n],
        verified=verified,
    )


def _source_tag_as_new_tag(checkpoint: str | Path, source_dir: Path, source_tag: str) -> str:
    """The source's tag, reused for the output when no ``--tag`` was given, or a UsageError that
    names where that tag came from (the user never typed it) and says to pass ``--tag``."""
    from shardkit.checkpoint.atomic import tag_problem

    why = tag_problem(source_tag)
    if why is None:
        return source_tag
    given = Path(checkpoint).resolve()
    # a root or its 'latest' file: the tag was read from 'latest'; a tag folder or a rank file: its folder name
    if given != source_dir.resolve() and given.parent != source_dir.resolve():
        origin = f"read from {source_dir.parent / LATEST_NAME}"
    else:
        origin = f"the name of the source folder {source_dir}"
    raise UsageError(f"source tag {source_tag!r} ({origin}) cannot name the new checkpoint ({why}); no --tag was "
                     "given, so the source's tag would be reused. Pass --tag NAME, e.g. --tag global_step100")


def check_output_root(root: Path, tag: str, source_dir: Path, *, force: bool = False) -> None:
    """Refuse an output folder where writing ``<tag>/`` and ``latest`` would destroy something.

    Accepted: a path that does not exist, an empty folder, or a shardkit checkpoint folder (one
    holding at least one tag folder with a manifest). Refused: the source checkpoint's own folder
    or anything inside it; a non-empty folder of other files (the save sequence removes leftovers
    of interrupted saves there and points ``latest`` at the new tag); a ``<tag>`` or ``latest``
    that is not a shardkit checkpoint / a regular file; an existing ``<tag>`` checkpoint unless
    ``force``.
    """
    from shardkit.checkpoint.atomic import LATEST_NAME, REPLACED_MARK, STAGING_PREFIX

    src, src_root = source_dir.resolve(), source_dir.parent.resolve()
    final = root / tag
    if final.resolve() == src:
        raise UsageError(
            f"-o {root} with tag {tag!r} would overwrite the checkpoint being read ({source_dir}); "
            "write to another folder or pass --tag NEW_TAG"
        )
    if root.resolve() == src_root:
        raise UsageError(
            f"-o {root} is the folder of the checkpoint being read: the resharded copy would move its 'latest' "
            f"pointer away from {source_dir.name!r} and the source run could no longer resume from it. Write to "
            f"another folder, e.g. -o {root.resolve().name}_resharded/"
        )
    if root.resolve().is_relative_to(src):
        raise UsageError(f"-o {root} is inside the checkpoint being read ({source_dir}); write to another folder")
    if not root.exists() and not root.is_symlink():
        return
    if not root.is_dir():
        raise UsageError(f"-o {root}: exists and is not a folder; pass a new or empty folder (the resharded "
                         f"checkpoint is written as OUT/{tag}/ and OUT/{LATEST_NAME})")
    entries = sorted(root.iterdir())
    if not entries:
        return
    checkpoints = [e for e in entries if e.is_dir() and not e.name.startswith(STAGING_PREFIX)
                   and REPLACED_MARK not in e.name and (e / MANIFEST_NAME).is_file()]
    if not checkpoints:
        shown = [e.name for e in entries[:5]] + (["..."] if len(entries) > 5 else [])
        raise UsageError(
            f"-o {root}: folder is not empty and is not a shardkit checkpoint folder (it holds {shown}); writing "
            f"there would point its '{LATEST_NAME}' at the new tag and remove files named like leftovers of "
            "interrupted saves. Pass a new or empty folder"
        )
    latest = root / LATEST_NAME
    if (latest.exists() or latest.is_symlink()) and not latest.is_file():
        raise UsageError(f"-o {root}: {latest} is not a regular file (a folder, device or dangling link), so it "
                         "cannot be the checkpoint pointer; pass another folder")
    if final.exists() or final.is_symlink():
        if final.is_symlink() or not final.is_dir() or not (final / MANIFEST_NAME).is_file():
            raise UsageError(f"-o {root}: {final} exists and is not a shardkit checkpoint (no {MANIFEST_NAME}, or "
                             "not a plain folder); it is never replaced. Pass --tag NEW_TAG or another folder")
        if not force:
            raise UsageError(f"-o {root}: already holds checkpoint {tag!r} ({final}); pass --force to replace it, "
                             "or --tag NEW_TAG to write beside it")


def _save_small(obj: Any, path: Path) -> None:
    import torch

    torch.save(obj, path)


class _BackgroundHasher:
    """sha256 of each finished file on a worker thread while the next file is produced.

    hashlib releases the GIL on large buffers, so on a 2-core machine hashing overlaps writing
    instead of re-reading all files at the end (what ``manifest.seal`` would do).
    """

    def __init__(self, tag_dir: Path):
        from concurrent.futures import ThreadPoolExecutor

        self.tag_dir = tag_dir
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardkit-sha256")
        self._futures: dict[str, Any] = {}

    def add(self, *paths: Path) -> None:
        for p in paths:
            rel = p.relative_to(self.tag_dir).as_posix()
            self._futures[rel] = self._pool.submit(describe_files, self.tag_dir, [rel])

    def entries(self) -> list[Any]:
        out = [e for f in self._futures.values() for e in f.result()]
        self._pool.shutdown()
        return sorted(out, key=lambda e: e.path)

    def close(self) -> None:
        """Stop hashing (queued files are dropped); waits for the file being hashed."""
        self._pool.shutdown(wait=True, cancel_futures=True)


