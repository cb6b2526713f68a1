"""`shardkit reshard CKPT --world-size M -o OUT`: a ZeRO-1/2/3 checkpoint for a new number of ranks."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from shardkit.commands._parser import add_command, add_dry_run, add_json, add_no_verify, add_quiet, add_world_size

if TYPE_CHECKING:
    from shardkit.checkpoint.hf_trainer.folder import TrainerCheckpoint
    from shardkit.checkpoint.ops.reshard import ReshardResult
    from shardkit.commands._parser import Stopwatch


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "reshard",
        help="repartition a ZeRO-1/2/3 checkpoint (or a Trainer checkpoint-N holding one) for another world size; "
             "DeepSpeed's plain load_checkpoint takes it",
        example="shardkit reshard checkpoints/ --world-size 3 -o checkpoints_ws3/",
        description=(
            "Write the per-rank files a ZeRO-1/2/3 run at M ranks would have saved itself: fp32 masters and "
            "Adam moments copied bit for bit into the new partitions (ceil(numel/M) per rank, zero-padded), "
            "step and hyperparameters kept. Resume with engine.load_checkpoint(OUT) as usual: no "
            "'load_universal', no conversion step. Rank files are written in parallel, hashed as they are written; "
            "memory stays near one 1 MiB buffer per thread. The source is first "
            "checked against its shardkit manifest (sizes and content digests; --no-verify: sizes only); OUT must be "
            "new, empty, or a shardkit checkpoint folder, and an existing OUT/<tag> is replaced only with --force. "
            "A Hugging Face Trainer checkpoint-N folder (or its output_dir: the newest checkpoint-N) is resharded "
            "whole: OUT is the new checkpoint-N folder for Trainer.train(resume_from_checkpoint=OUT), holding the "
            "resharded global_stepN/, the Trainer's files and the RNG files of the ranks that still exist."
        ),
    )
    p.add_argument("checkpoint", metavar="CKPT",
                   help="DeepSpeed checkpoint folder (with 'latest') or tag folder; a Trainer checkpoint-N or output_dir")
    add_world_size(p, "data-parallel ranks of the resuming run", required=True, metavar="M")
    p.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="new checkpoint folder (gets OUT/<tag>/ and OUT/latest; for a Trainer source, the new checkpoint-N)")
    p.add_argument("--tag", default=None, help="tag of the new checkpoint (default: the source tag)")
    p.add_argument("--sub-group-size", type=int, default=None, metavar="N",
                   help="zero_optimization.sub_group_size of the resuming run (default: the saved config's, else 1e9)")
    p.add_argument("--no-manifest", action="store_true", help="do not write shardkit_manifest.json")
    p.add_argument("--force", action="store_true",
                   help="replace OUT/<tag> when OUT already holds a shardkit checkpoint of that tag")
    add_no_verify(p)
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="files written at once by this process (default: one per file, at least the usable cores, "
                        "at most max(cores, 8)); under srun/torchrun every launched process writes its share")
    add_dry_run(p)
    add_json(p)
    add_quiet(p)
    p.set_defaults(func=reshard_command, sigterm_cleans_up=True)


def reshard_command(args: argparse.Namespace) -> int:
    from shardkit.checkpoint.hf_trainer.folder import locate_trainer_checkpoint, trainer_folder_of_tag
    from shardkit.checkpoint.ops.reshard import reshard_checkpoint
    from shardkit.commands._parser import Stopwatch
    from shardkit.commands._plan import byte_progress
    from shardkit.core.errors import UsageError
    from shardkit.storage.pipeline import CHECKED_LEVELS

    if args.world_size < 1:
        raise UsageError(f"--world-size {args.world_size}: must be at least 1")
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers {args.workers}: must be at least 1 (files written at once)")
    if args.sub_group_size is not None and args.sub_group_size < 1:
        raise UsageError(f"--sub-group-size {args.sub_group_size}: must be at least 1")
    if args.dry_run:
        return _dry_run(args, trainer=locate_trainer_checkpoint(args.checkpoint) is not None)
    clock = Stopwatch()
    trainer_checkpoint = locate_trainer_checkpoint(args.checkpoint)
    if trainer_checkpoint is not None:
        return _reshard_trainer(args, trainer_checkpoint, clock)
    parent = trainer_folder_of_tag(args.checkpoint)
    if parent is not None:
        print(f"shardkit reshard: warning: {args.checkpoint} is the DeepSpeed tag folder of the Trainer checkpoint "
              f"{parent}: {args.output} gets the DeepSpeed files only (no trainer_state.json, no RNG files). Pass "
              f"{parent} to write a checkpoint-N that Trainer.train(resume_from_checkpoint=...) resumes", file=sys.stderr)
    with byte_progress(args, "reshard"):
        r = reshard_checkpoint(args.checkpoint, args.output, args.world_size, tag=args.tag,
                               sub_group_size=args.sub_group_size, manifest=not args.no_manifest, force=args.force,
                               verify=not args.no_verify, workers=args.workers,
                               warn=lambda m: print(f"shardkit reshard: warning: {m}", file=sys.stderr))
    _emit_result(args, r, clock.seconds, r.output / r.tag)
    if r.rank != 0:
        print(f"rank {r.rank} of {r.processes} ({r.launcher}): wrote its share, {r.share_files} files, "
              f"{r.share_bytes / 2**20:,.1f} MiB, with {r.workers} writer(s); rank 0 seals {r.output / r.tag} once every "
              "process has reported")
        return 0
    split = f" by {r.processes} processes ({r.launcher})" if r.processes > 1 else ""
    print(
        f"wrote {r.output / r.tag}{split}: {len(r.files)} files, {r.bytes / 2**20:,.1f} MiB, world size "
        f"{r.source_world_size} -> {r.world_size}; resume with engine.load_checkpoint({str(r.output)!r}) "
        f"on {r.world_size} rank(s)"
    )
    print(f"source checked: {CHECKED_LEVELS[r.verified]}")
    if r.carried:
        print(f"copied unchanged: {', '.join(r.carried)}")
    for line in r.not_carried:
        print(f"not carried: {line}")
    for note in r.notes:
        print(f"note: {note}")
    return 0


def _reshard_trainer(args: argparse.Namespace, source: "TrainerCheckpoint", clock: "Stopwatch") -> int:
    """A Hugging Face Trainer checkpoint-N (or output_dir): -o is the new checkpoint-N folder."""
    from shardkit.checkpoint.ops.reshard_trainer import reshard_trainer_checkpoint
    from shardkit.core.errors import UsageError
    from shardkit.storage.pipeline import CHECKED_LEVELS
    from shardkit.storage.shared_save import launch_from_env

    launch = launch_from_env()
    if launch.distributed:
        # the Trainer folder is staged under a name of its own per process: one process does it
        raise UsageError(f"{args.checkpoint} is a Trainer checkpoint, resharded by one process; this is rank "
                         f"{launch.rank} of {launch.world} ({launch.launcher}). Run the command once, outside "
                         "srun/torchrun (--workers N sets its writer threads)")
    if source.note():
        print(f"note: {source.note()}")
    from shardkit.commands._plan import byte_progress

    with byte_progress(args, "reshard"):
        t = reshard_trainer_checkpoint(source, args.output, args.world_size, tag=args.tag,
                                       sub_group_size=args.sub_group_size, manifest=not args.no_manifest,
                                       force=args.force, verify=not args.no_verify, workers=args.workers,
                                       warn=lambda m: print(f"shardkit reshard: warning: {m}", file=sys.stderr))
    r = t.reshard
    _emit_result(args, r, clock.seconds, t.folder, trainer_files=t.copied, notes=t.notes, not_carried=t.not_carried)
    print(
        f"wrote {t.folder}: Trainer checkpoint with {r.tag}/ ({len(r.files)} files, {r.bytes / 2**20:,.1f} MiB), world "
        f"size {r.source_world_size} -> {r.world_size}; resume with Trainer.train(resume_from_checkpoint="
        f"{str(t.folder)!r}) on {r.world_size} rank(s)"
    )
    print(f"copied unchanged: {', '.join(t.copied) or 'nothing'}; RNG files: "
          f"{', '.join(b for _, b in t.rng.copies) or 'none'}")
    print(f"source checked: {CHECKED_LEVELS[r.verified]}")
    for note in t.notes:
        print(f"note: {note}")
    return 0


def _dry_run(args: argparse.Namespace, trainer: bool) -> int:
    """--dry-run: what would be read and written, the output folder checked as the real run checks it."""
    from pathlib import Path

    from shardkit.commands._parser import emit_json
    from shardkit.commands._plan import plan_of, print_plan, run_checks, source_tag_dir
    from shardkit.storage.atomic import staging_dir
    from shardkit.storage.pipeline import check_output_root

    run_checks(args, reshard_command)  # the run's own checks, stopped before its first write
    out = Path(args.output)
    if trainer:  # the new checkpoint-N folder is staged beside itself
        final, staging = out, f"a hidden .shardkit-tmp-{out.name}-<pid@host>-<nonce> folder beside {out}"
    else:
        tag_dir, source_tag = source_tag_dir(args.checkpoint)
        tag = args.tag or source_tag
        check_output_root(out, tag, tag_dir, force=args.force)  # a refusal now, not after the plan
        final, staging = out / tag, str(staging_dir(out, tag))
    plan = plan_of("reshard", args.checkpoint, final, staging, args.workers, world_size=args.world_size)
    print_plan(plan)
    if args.json or args.json_file:
        emit_json(args, plan)
    return 0


def _emit_result(args: argparse.Namespace, r: "ReshardResult", seconds: float, wrote: object,
                 trainer_files: list[str] | None = None, notes: list[str] | None = None,
                 not_carried: list[str] | None = None) -> None:
    """--json / --json-file: what was read, written and checked, and how long it took."""
    if not (args.json or args.json_file):
        return
    from shardkit.commands._parser import emit_json
    from shardkit.commands._plan import result_base
    from shardkit.storage.pipeline import CHECKED_LEVELS

    data = result_base("reshard", args.checkpoint, seconds, rank=r.rank, processes=r.processes, launcher=r.launcher)
    if r.rank != 0:
        data["wrote"] = {"share_files": r.share_files, "share_bytes": r.share_bytes, "workers": r.workers}
    else:
        data.update(wrote={"path": str(wrote), "files": len(r.files), "bytes": r.bytes},
                    world_size={"from": r.source_world_size, "to": r.world_size}, checked=CHECKED_LEVELS[r.verified],
                    notes=list(r.notes if notes is None else notes), carried=list(r.carried),
                    not_carried=list(r.not_carried if not_carried is None else not_carried))
        if trainer_files is not None:
            data["trainer_files"] = list(trainer_files)
    emit_json(args, data)
