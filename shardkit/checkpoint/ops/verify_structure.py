"""``shardkit verify`` of a checkpoint without a shardkit manifest: a plain DeepSpeed save (ZeRO-1/2/3,
universal), an FSDP2/DCP folder, a Trainer ``checkpoint-N`` or an Accelerate FSDP1 folder.

Nothing records what the bytes should be, so this is a structural check, in three steps:

1. every file the layout implies is there: each rank's files for the world size the files record
   (``zero_pp_rank_5_mp_rank_00_optim_states.pt of 8``), each ``.distcp`` ``.metadata`` references,
   FSDP1's per-rank files; none from another save beside them;
2. each file is intact as far as its structure tells, one file at a time (``verify_files``), and
   the ranks agree on what they all record (world size, ZeRO stage, step, DeepSpeed version);
3. the format's reader (``readers.registry``) describes the checkpoint and every tensor of the
   model and optimizer is covered by its pieces exactly once (``TrainingCheckpoint.uncovered``).

Layouts no command converts correctly (``layout`` refusals: AutoEP, MoE experts, tensor/pipeline
parallel ranks, NVMe) are named as warnings and step 3 is skipped: DeepSpeed's own load may still
resume them at the same world size. ``write_plain_manifest`` records sizes and digests of a folder
that passed, so later verifies compare bytes (``verify_manifest``).
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from zipfile import ZipInfo

from shardkit.checkpoint.layout.description import CheckpointDescription
from shardkit.checkpoint.layout.detect import describe_checkpoint
from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.ops.export.sources import Source, resolve_source
from shardkit.checkpoint.ops.verify_files import (
    RECOPY,
    FileProblem,
    check_torch_zip,
    dcp_problems,
    deepspeed_facts,
    parse_torch_file,
    zip_records_problem,
)
from shardkit.checkpoint.readers.registry import read_checkpoint
from shardkit.checkpoint.zero3.files import MODEL_FILE, OPTIM_FILE, RANK_FILE
from shardkit.checkpoint.zero12.files import MODEL_FILE as ZERO12_MODEL
from shardkit.core.errors import CheckpointError, UsageError
from shardkit.core.findings import Finding, Report, Severity
from shardkit.storage.links import LINK_OUTSIDE_FIX, link_outside_message, links_leaving, links_nowhere
from shardkit.storage.listing import list_folder, lists_source_once, walk
from shardkit.storage.manifest import MANIFEST_NAME
from shardkit.storage.structure_observers import observe_structures, reusing_parses

_TORCH_SUFFIXES = (".pt", ".bin", ".pth")
_FSDP_PER_RANK = re.compile(r"^(pytorch_model_fsdp|optimizer)_(\d+)_rank(\d+)\.bin$")
_FSDP_FULL = re.compile(r"^(pytorch_model_fsdp|optimizer)(_\d+)?\.bin$")
_DEEPSPEED_KINDS = ("zero3", "zero12", "universal")
_SHOWN = 5

NO_DIGESTS = ("structural check only: this checkpoint has no shardkit manifest, so no digests exist to compare its "
              "bytes with (a flipped bit inside a tensor is not seen)")


@dataclass
class StructureReport(Report):
    """What the structural check of one checkpoint found, and what it found the checkpoint to be."""

    path: str | None = None
    """The folder whose files were checked (a tag folder, a DCP folder, a Trainer checkpoint-N)."""
    tensor_folder: str | None = None
    """The folder the reader reads tensors from (the tag or DCP folder)."""
    kind: str | None = None
    """The reader's kind (``zero3``, ``zero12``, ``dcp``, ``fsdp1-sharded``...); None: not recognized."""
    layout: str | None = None
    """The layout in words (``DeepSpeed ZeRO-2``), from ``layout.detect``."""
    world_size: int | None = None
    stage: int | None = None
    step: int | None = None
    files: int = 0
    """Files checked."""
    bytes: int = 0
    """Their size on disk."""
    tensors: int = 0
    """Logical tensors (weights and optimizer states) whose coverage was checked."""

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "check": "structure", "digests": NO_DIGESTS, "folder": self.path,
                "tensor_folder": self.tensor_folder, "kind": self.kind, "layout": self.layout,
                "world_size": self.world_size, "zero_stage": self.stage, "step": self.step, "files": self.files,
                "bytes": self.bytes, "tensors": self.tensors}


def _error(report: StructureReport, key: str, value: Any, message: str, fix: str, rule: str) -> None:
    report.add(Finding(Severity.ERROR, key, value, message, fix, rule))


def _add_problem(report: StructureReport, p: FileProblem) -> None:
    report.add(Finding(Severity.WARNING if p.warning else Severity.ERROR, p.file, None, p.message, p.fix, p.rule))


def _parsed(kind: str, rel: str) -> bool:
    """Whether the reader of ``kind`` parses ``rel``'s pickle (then verify parses it too, through the
    same allow-list); other torch files (RNG states, scheduler, training_args.bin) are checked as zips."""
    name = rel.rsplit("/", 1)[-1]
    if kind in _DEEPSPEED_KINDS:
        return bool(RANK_FILE.match(name)) or name == ZERO12_MODEL or (kind == "universal" and rel.startswith("zero/"))
    return kind == "fsdp1-full" and "/" not in rel and bool(_FSDP_FULL.match(name))


def _walk(source: Source) -> tuple[Path, list[str]]:
    """(the folder checked, its files relative to it, sorted): the tag folder for DeepSpeed and DCP
    (other tags of the same root are not this checkpoint), the whole checkpoint-N for FSDP, plus the
    Trainer's own files beside a DeepSpeed tag (as ``../name``)."""
    top = source.folder if source.kind.startswith("fsdp") else source.tag_dir
    rels = []
    for dirpath, dirnames, filenames in walk(top):  # ``top`` itself: the command's one listing of it
        dirnames.sort()
        for name in filenames:
            if name != MANIFEST_NAME:
                rels.append(Path(dirpath, name).relative_to(top).as_posix())
    if top != source.folder and top.parent == source.folder:
        beside = list_folder(source.folder)
        rels += [f"../{n}" for n in beside.names if n in beside.files and Path(n).suffix in _TORCH_SUFFIXES]
    return top, sorted(rels)


def _compare_facts(report: StructureReport, seen: dict[str, tuple[str, Any]], rel: str, facts: dict[str, Any]) -> None:
    """Every rank file must record the same run-wide values; the first file giving each is the reference."""
    for key, value in facts.items():
        first = seen.setdefault(key, (rel, value))
        if first[1] != value:
            _error(report, rel, value, f"ranks disagree: {rel} records {key}={value!r} where {first[0]} records "
                   f"{first[1]!r}: files of two saves are mixed in one folder",
                   "re-copy the tag folder from one save (every rank's files of the same step)", "ckpt.structure.ranks")


def _check_links(report: StructureReport, top: Path, rels: list[str]) -> tuple[list[str], set[str]]:
    """Links leading out of the folder checked (errors, as verify of a sealed checkpoint names them: never read
    through) and links leading nowhere (warnings: a missing target or a loop, which no command reads). Returns the
    files without the links that lead nowhere (no files: a rank file's name among them is then missing), and the
    links leading out (not read)."""
    leaving = links_leaving(top)
    for rel, real in leaving:
        _error(report, rel, real, link_outside_message(top, rel, real), LINK_OUTSIDE_FIX, "ckpt.link.outside")
    nowhere = links_nowhere(top)
    for rel, target in nowhere:
        try:
            os.stat(top / rel)
            why = "its target is gone"
        except OSError as exc:
            why = "a loop of links" if exc.errno == errno.ELOOP else "its target does not exist"
        report.add(Finding(Severity.WARNING, rel, target, f"{top / rel}: a symbolic link to {target!r}, which leads "
                           f"nowhere ({why}): no file of this checkpoint, and no command reads it",
                           "remove the link (--write-manifest refuses to run while it is there)", "ckpt.link.nowhere"))
    dropped = {rel for rel, _ in nowhere}
    return [r for r in rels if r not in dropped], {rel for rel, _ in leaving}


def _check_files(report: StructureReport, source: Source, top: Path, rels: list[str]) -> list[str]:
    """Step 2's byte checks, file by file: zip structures, DCP folders; returns the files whose pickle the
    reader parses, their zips unchecked (``_parse_pending`` checks both once the reader has run, most of them
    from its own pass: each file's central directory read once)."""
    pending: list[str] = []
    dcp_dirs = {str(Path(r).parent) for r in rels if r.rsplit("/", 1)[-1] == ".metadata"}
    orphans: set[str] = set()
    for rel in rels:
        path = top / rel
        report.files += 1
        report.bytes += path.stat().st_size
        name = rel.rsplit("/", 1)[-1]
        folder = str(Path(rel).parent)
        if name == ".metadata":
            prefix = "" if folder == "." else f"{folder}/"
            for p in dcp_problems(path.parent, prefix=prefix):
                _add_problem(report, p)
        elif name.endswith(".distcp") and folder not in dcp_dirs and folder not in orphans:
            orphans.add(folder)
            _error(report, rel, None, f"{path.parent}: holds .distcp files but no .metadata, which DCP writes last "
                   "(rank 0, after every rank's data): the save did not complete or the copy lost it",
                   "re-copy the folder's .metadata, or resume from another checkpoint", "ckpt.structure.metadata")
        elif name.endswith(_TORCH_SUFFIXES):
            problem = None if _parsed(source.kind, rel) else check_torch_zip(top, rel)
            if problem is not None:
                _add_problem(report, problem)
            elif _parsed(source.kind, rel):
                pending.append(rel)
    return pending


def _parse_pending(report: StructureReport, source: Source, top: Path, pending: list[str],
                   parsed: dict[str, _Parsed]) -> dict[str, tuple[str, Any]]:
    """Step 2's zip and pickle checks: each file in ``pending`` is a whole zip and parses, and the ranks agree
    (``_compare_facts``); a file the reader's pass parsed (``parsed``: its absolute path -> what it found) is
    not opened again, the others (the reader stopped early, or does not read them) one at a time. Returns the
    facts seen."""
    seen: dict[str, tuple[str, Any]] = {}
    facts_wanted = source.kind in _DEEPSPEED_KINDS
    for rel in pending:
        found = parsed.get(os.path.abspath(top / rel))
        if found is not None and found.zip_problem is not None:
            _add_problem(report, FileProblem(rel, f"{top / rel}: {found.zip_problem}", RECOPY, "ckpt.structure.zip"))
            continue
        facts = found.facts if found is not None else None
        if facts is None:
            structure, problem = parse_torch_file(top, rel)
            if problem is not None:
                _add_problem(report, problem)
                continue
            facts = deepspeed_facts(structure)
            del structure  # one file's structure at a time
        if facts_wanted and not rel.startswith("zero/"):
            _compare_facts(report, seen, rel, facts)
    return seen


def _missing(report: StructureReport, folder: Path, names: list[str], present: set[str], world: int, why: str) -> None:
    """Name the first few of ``names`` (one per rank) absent from ``present`` (the files of ``folder``), then
    count the rest; a directory of that name is said to be one (the readers refuse it as such)."""
    lost = [n for n in names if n not in present]
    for n in lost[:_SHOWN]:
        if (folder / n).is_dir():
            _error(report, n, None, f"{n} of {world}: {folder / n} is a directory, not the rank file ({why})",
                   "a copy made a folder of the file (or a save into it failed): replace it with the file from the "
                   "node that wrote it, or resume from another checkpoint", "ckpt.structure.rank_file")
            continue
        _error(report, n, None, f"{n} of {world}: missing ({why})", "the save or the copy is incomplete: re-copy the "
               "file from the node that wrote it, or resume from another checkpoint", "ckpt.structure.rank_file")
    if len(lost) > _SHOWN:
        _error(report, "ranks", len(lost) - _SHOWN, f"{len(lost) - _SHOWN:,} more rank file(s) missing ({why})",
               "re-copy the whole tag folder, or resume from another checkpoint", "ckpt.structure.rank_file")


def _deepspeed_world(desc: CheckpointDescription | None, seen: dict[str, tuple[str, Any]],
                     ranks: set[int]) -> tuple[int, str]:
    """(world size, where it was read): rank 0's dp_world_size, else partition_count, else the files."""
    if "dp_world_size" in seen and isinstance(seen["dp_world_size"][1], int):
        return seen["dp_world_size"][1], f"dp_world_size in {seen['dp_world_size'][0]}"
    if desc is not None and desc.world_size:
        return desc.world_size, f"the world size of {desc.folder}"
    count = seen.get("partition_count", ("", None))
    if isinstance(count[1], int) or (isinstance(count[1], list) and count[1] and isinstance(count[1][0], int)):
        return (count[1] if isinstance(count[1], int) else count[1][0]), f"partition_count in {count[0]}"
    return max(ranks, default=-1) + 1, "the highest rank file present"


def _check_ranks(report: StructureReport, source: Source, names: set[str], desc: CheckpointDescription | None,
                 seen: dict[str, tuple[str, Any]], top: Path) -> None:
    """Step 1: every rank file the world size implies (``names``: the files of ``top``), none beyond it."""
    if source.kind in ("zero3", "zero12"):
        matched = [m for n in names if (m := RANK_FILE.match(n))]
        ranks = {int(m.group(2)) for m in matched}
        world, where = _deepspeed_world(desc, seen, ranks)
        report.world_size = world
        prefixes = sorted({m.group(1) or "" for m in matched if m.group(4) == "optim"})
        prefix = prefixes[0] if len(prefixes) == 1 else ("bf16_" if report.layout and "bf16" in report.layout else "")
        if len(prefixes) > 1:
            _error(report, "optimizer files", prefixes, f"{source.tag_dir}: holds optimizer files named both with and "
                   "without the bf16_ prefix: two saves of different precisions in one folder",
                   "keep the files of one save only", "ckpt.structure.ranks")
        shown = min(world, max(ranks, default=0) + _SHOWN + 1)  # an edited dp_world_size of 2**40 lists nothing huge
        why = f"{where} is {world}"
        optim = [OPTIM_FILE.format(prefix=prefix, rank=r) for r in range(shown)]
        model = [MODEL_FILE.format(rank=r) for r in range(shown)] if source.kind == "zero3" else [ZERO12_MODEL]
        _missing(report, top, optim, names, world, why)
        _missing(report, top, model, names, world if source.kind == "zero3" else 1, why)
        if shown < world:  # no file of any rank past ``shown`` exists: counted, not listed
            _error(report, "ranks", world - shown, f"ranks {shown}..{world - 1} ({world - shown:,} more) have no rank "
                   f"files ({why})", "re-copy the whole tag folder, or resume from another checkpoint",
                   "ckpt.structure.rank_file")
        extra = sorted(n for m in matched if int(m.group(2)) >= world for n in [m.group(0)])
        if extra:
            _error(report, extra[0], len(extra), f"{source.tag_dir}: {len(extra)} rank file(s) beyond rank {world - 1} "
                   f"({', '.join(extra[:3])}) although {why}: files of a save at another world size are mixed in",
                   "remove the other save's files, or re-copy the tag folder", "ckpt.structure.ranks")
    elif source.kind.endswith("-sharded-bins"):  # FSDP1's and FSDP2's per-rank files (use_dcp=False)
        per: dict[str, set[int]] = {}
        for n in names:
            if (m := _FSDP_PER_RANK.match(n)):
                per.setdefault(f"{m.group(1)}_{m.group(2)}", set()).add(int(m.group(3)))
        world = max((r for rs in per.values() for r in rs), default=-1) + 1
        report.world_size = world
        for stem in sorted(per):
            _missing(report, top, [f"{stem}_rank{r}.bin" for r in range(world)], names, world,
                     f"the folder holds rank files up to rank {world - 1}")


@dataclass(frozen=True)
class _Parsed:
    """What verify keeps of one file the reader parsed (the structure itself is not kept)."""

    facts: dict[str, Any]
    """``deepspeed_facts`` of its structure."""
    zip_problem: str | None
    """``zip_records_problem`` of its central directory, as the parse read it."""


@dataclass
class _ReaderPass:
    """What the format's reader made of the checkpoint, run once: its model or what stopped it, and the
    run-wide facts of every file whose pickle it parsed (so step 2 does not parse them again)."""

    ckpt: TrainingCheckpoint | None = None
    failure: Exception | None = None
    parsed: dict[str, _Parsed] = field(default_factory=dict)
    """A parsed file's absolute path (``os.path.abspath``: no system call per file) -> what verify keeps of it."""


def _run_reader(source: Source) -> _ReaderPass:
    out = _ReaderPass()

    def keep(path: Path, structure: Any, records: list[ZipInfo]) -> None:
        key = os.path.abspath(path)
        if key not in out.parsed:  # a file the reader parses twice (rank 0's) is checked once
            out.parsed[key] = _Parsed(deepspeed_facts(structure), zip_records_problem(path, records))

    with observe_structures(keep):
        try:
            out.ckpt = read_checkpoint(source.kind, source.tag_dir)
        except Exception as exc:  # reported by _check_reader, only where the file checks found nothing first
            out.failure = exc
    return out


def _check_reader(report: StructureReport, source: Source, done: _ReaderPass) -> None:
    """Step 3: the reader describes the checkpoint; every tensor is covered by its pieces exactly once."""
    exc = done.failure
    if isinstance(exc, CheckpointError):
        _error(report, source.kind, None, str(exc), "re-copy the file it names, or resume from another checkpoint",
               "ckpt.structure.reader")
        return
    if exc is not None:
        # verify reports, it never ends in a traceback: a reader that meets damage it does not name itself is
        # one more finding, the exception's first line shown (torch's DCP CheckpointException, a BaseException,
        # no longer leaves the readers: dcp.safe_load.load_dcp_state names the item's file instead)
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        _error(report, source.kind, None, f"{source.tag_dir}: its files do not hold what their names promise "
               f"({type(exc).__name__}: {first})", "re-copy the checkpoint, or resume from another one",
               "ckpt.structure.reader")
        return
    ckpt = done.ckpt
    assert ckpt is not None  # _run_reader keeps either a model or what stopped it
    report.tensors = len(ckpt.weights) + sum(len(states) for states in ckpt.optimizer.values())
    uncovered = ckpt.uncovered()
    for name in uncovered[:_SHOWN]:
        _error(report, name, None, f"{source.tag_dir}: tensor {name!r} is not covered exactly once by the pieces the "
               "rank files hold (a rank's share is missing or two saves overlap)", "re-copy the tag folder, or "
               "resume from another checkpoint", "ckpt.structure.coverage")
    if len(uncovered) > _SHOWN:
        _error(report, "tensors", len(uncovered) - _SHOWN, f"{len(uncovered) - _SHOWN:,} more tensor(s) not covered",
               "re-copy the tag folder, or resume from another checkpoint", "ckpt.structure.coverage")
    if report.world_size is None:
        report.world_size = ckpt.world_size
    if report.step is None and isinstance(ckpt.scalars.get("global_steps"), int):
        report.step = ckpt.scalars["global_steps"]


def _describe(report: StructureReport, path: str | Path) -> CheckpointDescription | None:
    """The layout's description, or None when its small files do not read (step 2 names the damage)."""
    try:
        desc = describe_checkpoint(path, check_manifest=False)
    except (CheckpointError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None
    report.layout, report.stage, report.step = desc.layout, desc.stage, desc.step
    for r in desc.refusals:
        report.add(Finding(Severity.WARNING, r.marker, r.where, f"{r.where}: {r.marker}: {r.why}; its tensors are not "
                           "checked for coverage (shardkit's readers do not read this layout)", r.fix,
                           "ckpt.structure.refusal"))
    return desc


@lists_source_once("path")  # the resolver, layout detection, file walk and reader share one listing of each folder
def verify_structure(path: str | Path, *, world_size: int | None = None,
                     engine: str | None = None) -> StructureReport:
    """Check the checkpoint at ``path`` (no shardkit manifest) for everything its structure tells.

    ``world_size``/``engine`` (``deepspeed``, ``fsdp2``): the run that will resume it; a DeepSpeed
    checkpoint at another world size is an error (its own load cannot repartition ZeRO state)."""
    report = StructureReport(subject=str(path))
    try:
        source = resolve_source(path)
    except (CheckpointError, UsageError) as exc:
        why = str(exc)
        try:  # the layout detection's words say what the folder holds, where it knows none of it
            describe_checkpoint(path, check_manifest=False)
        except CheckpointError as unknown:
            why = str(unknown)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            pass
        _error(report, "path", str(path), why, "pass a checkpoint root, tag folder, DCP folder or Trainer "
               "checkpoint-N (`shardkit inspect PATH` says what a folder is)", "ckpt.structure.unknown")
        return report
    report.kind, report.tensor_folder = source.kind, str(source.tag_dir)
    # the layout detection, the reader's opening and its description each parse rank 0's files: parsed once
    with reusing_parses():
        desc = _describe(report, path)
        top, rels = _walk(source)
        report.path = str(top)
        rels, leaving = _check_links(report, top, rels)
        pending = _check_files(report, source, top, [r for r in rels if r not in leaving])
        # the reader parses most rank files anyway: it runs first, where the byte checks passed, and the zip and
        # pickle checks take its parses (one per file); its verdict is reported only if the files check whole
        refused = desc is not None and bool(desc.refusals)
        done = _run_reader(source) if report.ok and not refused else _ReaderPass()
        seen = _parse_pending(report, source, top, pending, done.parsed)
    _check_ranks(report, source, {r for r in rels if "/" not in r}, desc, seen, top)
    if report.step is None and isinstance(seen.get("global_steps", ("", None))[1], int):
        report.step = seen["global_steps"][1]
    if report.world_size is None and desc is not None:
        report.world_size = desc.world_size
    if report.ok and not refused:
        _check_reader(report, source, done)
    elif not report.ok:
        report.add(Finding(Severity.INFO, "tensors", None, "tensor coverage not checked: the reader needs the files "
                           "above whole first", "fix the errors above, then verify again", "ckpt.structure.skipped"))
    _check_resume(report, source, world_size, engine, done.ckpt)
    return report


def _check_resume(report: StructureReport, source: Source, world_size: int | None, engine: str | None,
                  ckpt: TrainingCheckpoint | None) -> None:
    deepspeed = source.kind in _DEEPSPEED_KINDS
    if engine is not None and engine in ("deepspeed", "fsdp2") and (engine == "deepspeed") != deepspeed:
        # saved without optimizer state: every convert target refuses it (a writer needs Adam's state), so the
        # way to this run is a new start from its weights
        weights_only = ckpt is not None and not ckpt.optimizer
        fix = (f"it holds no optimizer state, so no convert makes it resumable: start the run from its weights "
               f"(shardkit export {source.folder} -o HF_DIR writes a from_pretrained folder)" if weights_only else
               f"convert it first: shardkit convert {source.folder} --to {'zero3' if engine == 'deepspeed' else 'fsdp2'}")
        _error(report, "engine", source.kind, f"a {report.layout or source.kind} checkpoint; this run uses {engine!r}",
               fix, "ckpt.structure.engine")
    if world_size is None or report.world_size is None or world_size == report.world_size:
        return
    if source.kind in ("zero3", "zero12"):
        _error(report, "world_size", report.world_size, f"saved by {report.world_size} ranks, this run has {world_size}: "
               "DeepSpeed's load_checkpoint cannot repartition ZeRO state to a new world size",
               f"run with {report.world_size} ranks, or reshard it first: shardkit reshard {source.folder} --world-size "
               f"{world_size} -o NEW_DIR", "ckpt.world_size.mismatch")
    else:
        report.add(Finding(Severity.INFO, "world_size", report.world_size, f"saved at world size {report.world_size}, "
                           f"resuming at {world_size}", "nothing to do where the loader reshards (DCP, universal)",
                           "ckpt.world_size.reshard"))
