"""`shardkit convert SRC --to fsdp2|zero3|zero2|zero1|universal -o OUT`: a checkpoint of one engine for the other, optimizer state included."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from shardkit.commands._parser import add_command, add_dry_run, add_json, add_no_verify, add_quiet

if TYPE_CHECKING:
    from shardkit.checkpoint.ops.convert.result import ConvertResult

TARGETS = ("fsdp2", "zero3", "zero2", "zero1", "universal")


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "convert",
        help="convert a ZeRO-1/2/3, universal, FSDP2/DCP or Trainer/Accelerate FSDP checkpoint to ZeRO-1/2/3, "
             "FSDP2 (DCP) or universal, with fp32 masters and Adam state",
        example="shardkit convert checkpoints/ --to fsdp2 -o fsdp_ckpt/",
        description=(
            "SRC is a DeepSpeed ZeRO-1/2/3 or universal checkpoint, an FSDP2/DCP one, or the FSDP files the Trainer "
            "and Accelerate save (`shardkit inspect SRC` says what each --to does with it). "
            "--to fsdp2: read its fp32 masters, Adam exp_avg/exp_avg_sq, step, "
            "param-group hyperparameters, buffers and JSON client state and write a DCP checkpoint that "
            "shardkit's load_fsdp_checkpoint resumes at any world size, with or without CPU offload. "
            "--to zero3 --world-size N: the reverse, per-rank files DeepSpeed's plain load_checkpoint accepts "
            "at N ranks; --to zero2|zero1 --world-size N: the ZeRO-2/ZeRO-1 files (per-rank optimizer files and the "
            "module states) DeepSpeed's plain load_checkpoint accepts at N ranks, from any source whose optimizer state "
            "shardkit reads; --to universal: a DeepSpeed universal checkpoint (what ds_to_universal writes) that "
            "DeepSpeed's load_checkpoint with checkpoint.load_universal: true resumes at any world size. What "
            "cannot be carried (loss scaler, LR scheduler, optimizers other than Adam/AdamW, "
            "MoE experts, tensor-parallel checkpoints) is refused or reported by name. The source is first "
            "checked against its shardkit manifest (sizes and content digests; --no-verify: sizes only); the output is "
            "an atomic shardkit checkpoint with a manifest."
        ),
    )
    p.add_argument("source", metavar="SRC",
                   help="checkpoint folder (with 'latest') or tag folder; for --to fsdp2 also a Trainer checkpoint-N or output_dir")
    p.add_argument("--to", required=True, choices=TARGETS, help="engine of the new checkpoint")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="new checkpoint folder (gets OUT/<tag>/ and OUT/latest)")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="--to zero3/zero2/zero1 only: data-parallel ranks of the resuming DeepSpeed run")
    p.add_argument("--tag", default=None, help="tag of the new checkpoint (default: the source tag)")
    p.add_argument("--adam-w-mode", choices=("on", "off"), default=None,
                   help="--to fsdp2, for a client optimizer the checkpoint does not name: decoupled weight decay "
                        "(AdamW, on) or L2 (Adam, off); needed only when weight_decay is not 0")
    p.add_argument("--ds-config", default=None, metavar="FILE",
                   help="--to zero3/zero2/zero1 only: the resuming run's DeepSpeed config (sub_group_size, bf16, offload decide "
                        "the files' layout and param-group format; recorded as ds_config). Without it the precision "
                        "comes from the source (its recorded precision, or bf16 parameters) and a float32 source is "
                        "refused, since FSDP2 keeps float32 parameters whatever it trains in")
    p.add_argument("--name-prefix", choices=("module", "none"), default=None,
                   help="--to zero3/zero2/zero1 only: 'module' writes the parameter names with DeepSpeed's 'module.' prefix (a "
                        "target engine wrapping the model), 'none' strips it (default: the source's names; a ZeRO-3 "
                        "origin gets its own prefix back)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="files written at once by each process (default: one per file, at least the usable cores, "
                        "at most max(cores, 8)); under srun/torchrun every launched process writes its share of the "
                        "files")
    p.add_argument("--force", action="store_true",
                   help="replace OUT/<tag> when OUT already holds a shardkit checkpoint of that tag")
    add_no_verify(p)
    add_dry_run(p)
    add_json(p)
    add_quiet(p)
    p.set_defaults(func=convert_command, sigterm_cleans_up=True)


def convert_command(args: argparse.Namespace) -> int:
    from shardkit.checkpoint.hf_trainer.folder import locate_trainer_checkpoint, trainer_files_not_converted
    from shardkit.checkpoint.ops.convert.to_dcp import convert_to_dcp
    from shardkit.checkpoint.ops.convert.to_zero3 import convert_to_zero3
    from shardkit.checkpoint.ops.convert.to_zero12 import convert_to_zero12
    from shardkit.commands._parser import Stopwatch
    from shardkit.commands._plan import byte_progress
    from shardkit.core.errors import UsageError
    from shardkit.storage.pipeline import CHECKED_LEVELS

    clock = Stopwatch()

    def warn(message: str) -> None:
        print(f"shardkit convert: warning: {message}", file=sys.stderr)

    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers {args.workers}: must be at least 1 (files written at once)")
    if args.dry_run:  # the run below, stopped before its first write, then the plan
        return _dry_run(args)
    trainer = None
    if args.to == "universal":
        r = _to_universal(args, warn)
        resume = (f"engine.load_checkpoint({str(r.output)!r}) at any world size, with \"checkpoint\": "
                  "{\"load_universal\": true} in the DeepSpeed config")
    elif args.to == "fsdp2":
        if args.world_size is not None:
            raise UsageError(f"--world-size {args.world_size} with --to fsdp2: a DCP checkpoint loads at any world "
                             "size, so there is nothing to choose; drop --world-size")
        if args.ds_config is not None:
            raise UsageError(f"--ds-config {args.ds_config} with --to fsdp2: the ZeRO-3 checkpoint records its own "
                             "config; drop --ds-config")
        if args.name_prefix is not None:
            raise UsageError(f"--name-prefix {args.name_prefix} with --to fsdp2: DCP names are the model's own (the "
                             "'module.' prefix is removed and recorded); drop --name-prefix")
        adam_w = None if args.adam_w_mode is None else args.adam_w_mode == "on"
        # a Trainer output_dir -> its newest checkpoint-N (a checkpoint-N folder is a DeepSpeed root already)
        trainer = locate_trainer_checkpoint(args.source, fsdp_read=True)
        if trainer is not None and trainer.note():
            print(f"note: {trainer.note()}")
        source = args.source if trainer is None else trainer.folder
        with byte_progress(args, "convert"):
            r = convert_to_dcp(source, args.output, tag=args.tag, force=args.force,
                               verify=not args.no_verify, warn=warn, adam_w_mode=adam_w, workers=args.workers)
        if trainer is not None and r.rank == 0:  # trainer_state.json, scheduler.pt, rng_state_*.pth ...: named, never dropped silently
            r.not_carried.extend(trainer_files_not_converted(trainer.folder))
        resume = f"load_fsdp_checkpoint(model, optimizer, {str(r.output)!r}) at any world size"
    else:
        if args.world_size is None:
            raise UsageError(f"--to {args.to} needs --world-size N: DeepSpeed's plain load_checkpoint only takes "
                             "the per-rank files of its own world size; pass the resuming run's rank count")
        if args.world_size < 1:
            raise UsageError(f"--world-size {args.world_size}: must be at least 1")
        if args.adam_w_mode is not None:
            raise UsageError(f"--adam-w-mode {args.adam_w_mode} with --to {args.to}: the FSDP2 checkpoint's param "
                             "groups already record decoupled_weight_decay; drop --adam-w-mode")
        prefix = {"module": "module.", "none": "", None: None}[args.name_prefix]
        with byte_progress(args, "convert"):
            if args.to == "zero3":
                r = convert_to_zero3(args.source, args.output, world_size=args.world_size, tag=args.tag,
                                     force=args.force, verify=not args.no_verify, warn=warn, ds_config=args.ds_config,
                                     name_prefix=prefix, workers=args.workers)
            else:
                r = convert_to_zero12(args.source, args.output, stage=int(args.to[-1]), world_size=args.world_size,
                                      tag=args.tag, force=args.force, verify=not args.no_verify, warn=warn,
                                      ds_config=args.ds_config, name_prefix=prefix, workers=args.workers)
        resume = f"engine.load_checkpoint({str(r.output)!r}) on {r.world_size} rank(s)"
    if r.rank == 0 and (args.to != "fsdp2" or trainer is None):  # a Trainer folder's files are named above
        from pathlib import Path

        from shardkit.checkpoint.ops.carried_files import root_files_not_converted

        left, other_tags = root_files_not_converted(Path(args.source))
        r.not_carried.extend(left)
        if other_tags:
            r.notes.append(other_tags)
    _emit_result(args, r, clock.seconds)
    if r.rank != 0:  # under srun/torchrun: process 0 reports the whole result
        print(f"rank {r.rank} of {r.processes} ({r.launcher}): wrote its share, {r.share_files} files, "
              f"{r.share_bytes / 2**20:,.1f} MiB, {r.workers} writer thread(s)")
        return 0
    by = f" by {r.processes} processes ({r.launcher})" if r.processes > 1 else ""
    print(f"wrote {r.output / r.tag}{by}: {r.source_engine} -> {r.target_engine}, {r.params} parameters, "
          f"{r.bytes / 2**20:,.1f} MiB; resume with {resume}")
    print(f"source checked before reading: {CHECKED_LEVELS[r.verified]}")
    if r.carried:
        print(f"carried: {', '.join(r.carried)}")
    for line in r.not_carried:
        print(f"not carried: {line}")
    for note in r.notes:
        print(f"note: {note}")
    return 0


def _to_universal(args: argparse.Namespace, warn: Callable[[str], None]) -> "ConvertResult":
    """--to universal: the flags that choose per-rank files or names do not apply."""
    from shardkit.checkpoint.ops.convert.to_universal import convert_to_universal
    from shardkit.commands._plan import byte_progress
    from shardkit.core.errors import UsageError

    why = {"world_size": "a universal checkpoint loads at any world size, so there is nothing to choose",
           "ds_config": "the files do not depend on the resuming run's config (its load_universal reads them)",
           "name_prefix": "the files are named by the model's own parameter names, as DeepSpeed's engine reads them",
           "adam_w_mode": "the param groups are written as the source records them",
           "workers": "the universal writer writes one file at a time"}
    for dest, reason in why.items():
        if getattr(args, dest) is not None:
            flag = "--" + dest.replace("_", "-")
            raise UsageError(f"{flag} {getattr(args, dest)} with --to universal: {reason}; drop {flag}")
    with byte_progress(args, "convert"):
        return convert_to_universal(args.source, args.output, tag=args.tag, force=args.force,
                                    verify=not args.no_verify, warn=warn)


def _dry_run(args: argparse.Namespace) -> int:
    """--dry-run: what would be read and written, the output folder checked as the real run checks it."""
    from pathlib import Path

    from shardkit.commands._parser import emit_json
    from shardkit.commands._plan import plan_of, print_plan, run_checks, source_tag_dir
    from shardkit.storage.atomic import staging_dir
    from shardkit.storage.pipeline import check_output_root

    run_checks(args, convert_command)  # the run's own checks, stopped before its first write
    out = Path(args.output)
    tag_dir, source_tag = source_tag_dir(args.source)
    tag = args.tag or source_tag
    check_output_root(out, tag, tag_dir, force=args.force)  # a refusal now, not after the plan
    plan = plan_of("convert", args.source, out / tag, str(staging_dir(out, tag)), args.workers, to=args.to,
                   world_size=args.world_size)
    print_plan(plan)
    if args.json or args.json_file:
        emit_json(args, plan)
    return 0


def _emit_result(args: argparse.Namespace, r: "ConvertResult", seconds: float) -> None:
    """--json / --json-file: what was read, written, carried and checked, and how long it took."""
    if not (args.json or args.json_file):
        return
    from shardkit.commands._parser import emit_json
    from shardkit.commands._plan import result_base
    from shardkit.storage.pipeline import CHECKED_LEVELS

    data = result_base("convert", args.source, seconds, rank=r.rank, processes=r.processes, launcher=r.launcher)
    if r.rank != 0:
        data["wrote"] = {"share_files": r.share_files, "share_bytes": r.share_bytes, "workers": r.workers}
    else:
        data.update(wrote={"path": str(r.output / r.tag), "bytes": r.bytes, "parameters": r.params},
                    engines={"from": r.source_engine, "to": r.target_engine}, world_size=r.world_size,
                    checked=CHECKED_LEVELS[r.verified], carried=list(r.carried), not_carried=list(r.not_carried),
                    route=r.route, notes=list(r.notes))
    emit_json(args, data)
