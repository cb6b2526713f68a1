"""The ZeRO-1/2 reshard as one composition: the ZeRO-1/2 reader (``readers.zero12``: every rank file's pickle
parsed without torch, each parameter's master and optimizer states as byte ranges of the ranks' flats) ->
``TrainingCheckpoint`` -> the ZeRO-1/2 writer (``writers.zero12``) with a target planned from the source itself
(``plan_same_run``: its own dicts, key for key, at the new world size).

``reshard.reshard_checkpoint`` runs the rest as for ZeRO-3: each launched process writes its share of the jobs
returned here, the source's digests are checked while writing, an unchanged world size is a byte copy. The
files are written without torch where the source's bytes express every new partition; else through torch,
and ``notes`` says why (a rank tensor some tool saved strided, a state whose dtype differs between ranks).

Without torch, ``write_hashing_sources`` writes the new ranks cut from one old rank's file on one thread,
their records interleaved in that file's order (``stream.write_interleaved``), so the old file is hashed from
the very bytes the copy reads (``stream.SourceDigests``): each source byte is read once and hashed once,
instead of a second read of every source file on threads of its own.
"""

from __future__ import annotations

import errno
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Sequence

from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.ops.reshard_source import PlannedReshard
from shardkit.checkpoint.readers.registry import read_checkpoint
from shardkit.checkpoint.readers.zero12_run_state import alignment_paddings
from shardkit.checkpoint.writers.zero3 import TargetOptimizer
from shardkit.checkpoint.writers.zero12 import FileJob, SameRun, Zero12Files, Zero12Target, file_jobs
from shardkit.checkpoint.zero3.files import OPTIM_FILE
from shardkit.checkpoint.zero12.files import MODEL_FILE
from shardkit.core import progress
from shardkit.core.errors import CheckpointError
from shardkit.storage.atomic import is_disk_full
from shardkit.storage.manifest import FileEntry
from shardkit.storage.pipeline import check_source_digests
from shardkit.storage.stream import SourceDigests, WrittenFile, main_source, write_interleaved, write_parallel
from shardkit.storage.torch_zip import RecordData


def plan_zero12_reshard(tag_dir: Path, world_size: int) -> PlannedReshard[FileJob]:
    """The ZeRO-1/2 tag folder ``tag_dir`` read once and planned at ``world_size`` ranks (nothing written yet).
    Raises CheckpointError, naming the file, for a source the reader refuses."""
    ckpt = read_checkpoint("zero12", tag_dir)
    files = Zero12Files(ckpt, plan_same_run(ckpt, world_size))
    source = ckpt.scalars["source"]
    native = ckpt.scalars["native"]
    saved = ckpt.world_size or 0
    notes = []
    if files.torch_route_reason is not None:
        read_by_torch = [n for n in ckpt.notes if n.endswith("read through torch")]
        notes.append("the new rank files were built in memory with torch (one partition of one state per writer "
                     "thread, slower than the byte-range copy) because the byte-range writer cannot express the "
                     f"source: {'; '.join([files.torch_route_reason, *read_by_torch])}")
    unchanged = world_size == saved  # ZeRO-1/2 has no sub-groups: the same world size is the same layout
    return PlannedReshard(
        tag_dir=tag_dir, stage=int(source["zero_stage"]), world_size=saved, precision=ckpt.precision,
        ds_config=dict(source.get("ds_config") or {}), ds_version=source.get("ds_version"),
        optim_files=[tag_dir / OPTIM_FILE.format(prefix=native["prefix"], rank=r) for r in range(saved)],
        model_files=[tag_dir / MODEL_FILE], model_state=native["model_states"], unchanged=unchanged,
        jobs=file_jobs(files), notes=notes)


def plan_same_run(ckpt: TrainingCheckpoint, world_size: int) -> Zero12Target:
    """The ZeRO-1/2 source ``ckpt`` as its own run at ``world_size`` ranks: everything but the partitions is the
    source's own (``writers.zero12.SameRun``), so nothing the source run could resume is refused here (fp16
    with its loss scaler, any optimizer and per-element state)."""
    native = ckpt.scalars.get("native")
    if not isinstance(native, dict):
        raise CheckpointError(f"{ckpt.folder}: the {ckpt.format} reader kept no rank-0 dicts to write back; only a "
                              "ZeRO-1/2 checkpoint is resharded as its own run. Use `shardkit convert --to zero2`")
    optim, model = native["optim_file"], native["model_states"]
    groups: list[dict[str, Any]] = list(ckpt.scalars.get("param_groups") or [])
    group_params = [list(g["params"]) for g in groups]
    saved = alignment_paddings(optim)
    paddings = saved if saved is not None else [[0] * len(n) for n in group_params]
    flat_keys = [list(ckpt.optimizer[names[0]]) if names else [] for names in group_params]
    steps_by_name: dict[str, float] = dict(ckpt.scalars.get("step") or {})
    counters = dict(ckpt.scalars.get("counters") or {})
    source = ckpt.scalars.get("source") or {}
    return Zero12Target(
        stage=int(source.get("zero_stage") or 2), world_size=world_size, precision=ckpt.precision,
        opt=TargetOptimizer(str(ckpt.scalars.get("optimizer_type") or "torch"), bool(ckpt.scalars.get("adam_w_mode")),
                            step_as_tensor=False),
        groups=groups, group_params=group_params,
        steps=[int(steps_by_name.get(names[0], 0)) if names else 0 for names in group_params],
        parameter_alignment=any(any(p) for p in paddings), global_steps=int(counters.pop("global_steps", 0)),
        counters=counters, client=dict(ckpt.scalars.get("client_state") or {}),
        cfg=dict(source.get("ds_config") or {}), names={}, clip_grad=float(ckpt.scalars.get("clip_grad") or 0.0),
        same_run=SameRun(optim, model, str(native.get("prefix") or ""), paddings, flat_keys))


#: One output file without torch: its name and its contents as ``data.pkl`` + records.
Contents = tuple[str, Callable[[], tuple[bytes, list[tuple[str, RecordData]]]]]


def write_hashing_sources(staged: Path, share: Sequence[Contents], sources: Sequence[tuple[Path, FileEntry]],
                          workers: int, *, outcome: str, refusing: str, retry: str) -> list[FileEntry]:
    """Write ``share``'s files into ``staged`` and check ``sources`` against their manifest entries from the bytes
    the copies read (module doc). The files whose bytes come mostly from one source file are one job
    (``write_interleaved``), at most ``workers`` jobs at once; a source digest that differs from its entry raises
    ``check_source_digests``'s CheckpointError naming the file, after the writes and before anything is published
    (or instead of a failed write's own error, where a corrupted source could have caused it: ``_suspects``).
    Returns the written files' entries in ``share``'s order."""
    built = {name: contents() for name, contents in share}
    groups: dict[str | None, list[str]] = {}
    for name, (_, records) in built.items():
        groups.setdefault(main_source(records), []).append(name)
    digests = SourceDigests([(path, entry.algorithm) for path, entry in sources])

    def job(names: list[str]) -> Callable[[Path], list[WrittenFile]]:
        return lambda _first: write_interleaved([(staged / n, *built[n]) for n in names], on_read=digests.seen)

    def check(suspects: Sequence[tuple[Path, FileEntry]]) -> None:
        got = digests.finish(only={path for path, _ in suspects})
        hashed: list[tuple[Path, FileEntry, Future[str]]] = []
        for path, entry in suspects:
            done: Future[str] = Future()
            done.set_result(got[path])
            hashed.append((path, entry, done))
        check_source_digests(hashed, refusing, retry)

    # the storages' bytes (each pickle and the zip around it grow the total as written: torch_zip)
    progress.expect(sum(sum(len(d) if isinstance(d, (bytes, memoryview)) else d.nbytes for _, d in records)
                        for _, records in built.values()))
    try:
        written = write_parallel([(staged / names[0], job(names)) for names in groups.values()],
                                 max(1, min(workers, len(groups))), outcome=outcome, thread_name="shardkit-reshard")
    except Exception as exc:
        check(_suspects(exc, sources))
        raise
    except BaseException:  # Ctrl-C, SIGTERM: stop now, no source to blame
        digests.finish(only=())
        raise
    check(sources)
    by_name = {n: w for names, files in zip(groups.values(), written) for n, w in zip(names, files)}
    return [FileEntry.of(name, by_name[name].size, by_name[name].algorithm, by_name[name].digest) for name, _ in share]


#: A failed write with one of these errnos says nothing about the source's bytes: the disk or quota is full, the
#: file too large for the filesystem, the destination (or a source) not writable or readable by this user.
_NOT_DATA_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG, errno.EACCES,
                              errno.EPERM, errno.EROFS})


def _suspects(exc: BaseException, sources: Sequence[tuple[Path, FileEntry]]) -> list[tuple[Path, FileEntry]]:
    """The source files whose digests could explain the failed write ``exc``, the only ones hashed to the end
    before it is raised (a 2 TB source and a full disk: "disk full" at once, not after 2 TB of hashing): none for
    an error no source content causes (``_NOT_DATA_ERRNOS``, a full disk ``disk_full_named`` reworded); the
    source files an OSError in its chain names as its ``filename`` (a source truncated under the copy:
    ``torch_zip.pread_exact``); every source when none is named."""
    chain: list[BaseException] = []
    at: BaseException | None = exc
    while at is not None and at not in chain:
        chain.append(at)
        at = at.__cause__ or at.__context__
    if any(is_disk_full(e) or (isinstance(e, OSError) and e.errno in _NOT_DATA_ERRNOS) for e in chain):
        return []
    files = {Path(os.fsdecode(e.filename)) for e in chain if isinstance(e, OSError) and e.filename is not None}
    named = [(path, entry) for path, entry in sources if path in files]
    return named or list(sources)
