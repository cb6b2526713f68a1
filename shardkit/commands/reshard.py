"""`shardkit reshard CKPT --world-size M -o OUT`: a ZeRO-3 checkpoint for a new number of ranks."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from shardkit.commands._parser import add_command

if TYPE_CHECKING:
    from shardkit.checkpoint.hf_trainer.folder import TrainerCheckpoint


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "reshard",
        help="repartition a ZeRO-3 checkpoint for another world size; DeepSpeed's plain load_checkpoint takes it",
        example="shardkit reshard checkpoints/ --world-size 3 -o checkpoints_ws3/",
        description=(
            "Write the per-rank files a ZeRO-3 run at M ranks would have saved itself: fp32 masters and "
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
    p.add_argument("--world-size", type=int, required=True, metavar="M", help="data-parallel ranks of the resuming run")
    p.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="new checkpoint folder (gets OUT/<tag>/ and OUT/latest; for a Trainer source, the new checkpoint-N)")
    p.add_argument("--tag", default=None, help="tag of the new checkpoint (default: the source tag)")
    p.add_argument("--sub-group-size", type=int, default=None, metavar="N",
                   help="zero_optimization.sub_group_size of the resuming run (default: the saved config's, else 1e9)")
    p.add_argument("--no-manifest", action="store_true", help="do not write shardkit_manifest.json")
    p.add_argument("--force", action="store_true",
                   help="replace OUT/<tag> when OUT already holds a shardkit checkpoint of that tag")
    p.add_argument("--no-verify", action="store_true",
                   help="check only the sizes of the source's files against its manifest, not their content digests (faster)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="files written at once by this process (default: one per file, at least the usable cores, "
                        "at most max(cores, 8)); under srun/torchrun every launched process writes its share")
    p.set_defaults(func=reshard_command, sigterm_cleans_up=True)


def reshard_command(args: argparse.Namespace) -> int:
    from shardkit.checkpoint.hf_trainer.folder import locate_trainer_checkpoint, trainer_folder_of_tag
    from shardkit.checkpoint.io.pipeline import CHECKED_LEVELS
    from shardkit.checkpoint.ops.reshard import reshard_zero3
    from shardkit.core.errors import UsageError

    if args.world_size < 1:
        raise UsageError(f"--world-size {args.world_size}: must be at least 1")
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers {args.workers}: must be at least 1 (files written at once)")
    if args.sub_group_size is not None and args.sub_group_size < 1:
        raise UsageError(f"--sub-group-size {args.sub_group_size}: must be at least 1")
    trainer_checkpoint = locate_trainer_checkpoint(args.checkpoint)
    if trainer_checkpoint is not None:
        return _reshard_trainer(args, trainer_checkpoint)
    parent = trainer_folder_of_tag(args.checkpoint)
    if parent is not None:
        print(f"shardkit reshard: warning: {args.checkpoint} is the DeepSpeed tag folder of the Trainer checkpoint "
              f"{parent}: {args.output} gets the DeepSpeed files only (no trainer_state.json, no RNG files). Pass "
              f"{parent} to write a checkpoint-N that Trainer.train(resume_from_checkpoint=...) resumes", file=sys.stderr)
    r = reshard_zero3(args.checkpoint, args.output, args.world_size, tag=args.tag,
                      sub_group_size=args.sub_group_size, manifest=not args.no_manifest, force=args.force,
                      verify=not args.no_verify, workers=args.workers,
                      warn=lambda m: print(f"shardkit reshard: warning: {m}", file=sys.stderr))
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
    for note in r.notes:
        print(f"note: {note}")
    return 0


def _reshard_trainer(args: argparse.Namespace, source: "TrainerCheckpoint") -> int:
    """A Hugging Face Trainer checkpoint-N (or output_dir): -o is the new checkpoint-N folder."""
    from shardkit.checkpoint.io.pipeline import CHECKED_LEVELS
    from shardkit.checkpoint.io.shared_save import launch_from_env
    from shardkit.checkpoint.ops.reshard_trainer import reshard_trainer_checkpoint
    from shardkit.core.errors import UsageError

    launch = launch_from_env()
    if launch.distributed:
        # the Trainer folder is staged under a name of its own per process: one process does it
        raise UsageError(f"{args.checkpoint} is a Trainer checkpoint, resharded by one process; this is rank "
                         f"{launch.rank} of {launch.world} ({launch.launcher}). Run the command once, outside "
                         "srun/torchrun (--workers N sets its writer threads)")
    if source.note():
        print(f"note: {source.note()}")
    t = reshard_trainer_checkpoint(source, args.output, args.world_size, tag=args.tag,
                                   sub_group_size=args.sub_group_size, manifest=not args.no_manifest, force=args.force,
                                   verify=not args.no_verify, workers=args.workers,
                                   warn=lambda m: print(f"shardkit reshard: warning: {m}", file=sys.stderr))
    r = t.reshard
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
