"""`shardkit consolidate CKPT -o model.safetensors`: full weights out of any checkpoint a reader takes."""

from __future__ import annotations

import argparse
import sys

from shardkit.commands._parser import add_command, add_dry_run, add_json, add_no_verify, add_quiet


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "consolidate",
        help="write the full weights of a ZeRO-1/2/3, universal, FSDP2/DCP, Trainer/Accelerate FSDP or Accelerate "
             "save_state checkpoint to one .safetensors file (streaming zero_to_fp32)",
        example="shardkit consolidate checkpoints/ -o model.safetensors",
        description=(
            "Of a DeepSpeed ZeRO-1/2/3 or universal checkpoint, an FSDP2/DCP one, the FSDP files the Trainer and "
            "Accelerate save or a one-process Accelerate save_state folder, write the full weights to one safetensors "
            "file. "
            "ZeRO-3: gather every parameter's fp32 master from the per-rank partitions (any world size, "
            "bf16/fp16/fp32 training, with or without offload) and write one safetensors file. Memory "
            "stays near one rank's partition: rank files are memory-mapped one at a time and each piece "
            "is written straight to its place in the output. CKPT is the folder holding 'latest', a tag "
            "folder, or one rank file. No DeepSpeed import, no code from the checkpoint is run. The source "
            "is first checked against its shardkit manifest (sizes and content digests; --no-verify: sizes only); an "
            "existing FILE is replaced only with --force. Under srun/torchrun every launched process copies its "
            "share of the pieces into the one file (on storage every node shares) and rank 0 renames it into place. "
            "A ZeRO-1/2 checkpoint (or another source `shardkit inspect` says consolidate takes) is read through "
            "its reader and written the same way by one process."
        ),
    )
    p.add_argument("checkpoint", metavar="CKPT",
                   help="checkpoint folder (root with 'latest' or tag folder) of any layout above; a Trainer checkpoint-N "
                        "or output_dir")
    p.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="output .safetensors file (a folder gets model.safetensors inside)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="dtype of floating-point tensors in the output (default: fp32, the masters as saved)")
    p.add_argument("--exclude-frozen", action="store_true",
                   help="leave out parameters the optimizer did not train (frozen ones)")
    p.add_argument("--force", action="store_true",
                   help="replace FILE if it exists (only ever a regular file, never one inside a checkpoint)")
    add_no_verify(p)
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="source files hashed and output windows copied at once, per process (default: one per file, at least the "
                        "usable cores, at most max(cores, 8))")
    add_dry_run(p)
    add_json(p)
    add_quiet(p)
    p.set_defaults(func=consolidate_command, sigterm_cleans_up=True)


def consolidate_command(args: argparse.Namespace) -> int:
    from shardkit.checkpoint.hf_trainer.folder import resolve_source
    from shardkit.checkpoint.ops.consolidate import consolidate_checkpoint
    from shardkit.commands._parser import Stopwatch, emit_json
    from shardkit.commands._plan import byte_progress, result_base
    from shardkit.core.errors import UsageError
    from shardkit.storage.pipeline import CHECKED_LEVELS

    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers {args.workers}: must be at least 1 (output windows copied at once)")
    if args.dry_run:
        return _dry_run(args)
    clock = Stopwatch()

    # a Trainer output_dir -> its newest checkpoint-N (a checkpoint-N folder is a DeepSpeed root already)
    source = resolve_source(args.checkpoint, lambda m: print(f"note: {m}"), fsdp_read=True)
    with byte_progress(args, "consolidate"):
        result = consolidate_checkpoint(
            source, args.output, dtype=args.dtype, include_frozen=not args.exclude_frozen, force=args.force,
            verify=not args.no_verify, warn=lambda m: print(f"shardkit consolidate: warning: {m}", file=sys.stderr),
            workers=args.workers,
        )
    if args.json or args.json_file:
        data = result_base("consolidate", args.checkpoint, clock.seconds, rank=result.rank,
                           processes=result.processes, launcher=result.launcher)
        if result.rank != 0:
            data["wrote"] = {"share_pieces": result.share_pieces, "share_bytes": result.share_bytes}
        else:
            data.update(wrote={"path": str(result.output), "files": 1, "bytes": result.bytes, "tensors": result.tensors,
                               "parameters": result.parameters, "dtype": args.dtype},
                        source_world_size=result.source_world_size, tag=result.tag,
                        checked=CHECKED_LEVELS[result.verified])
        emit_json(args, data)
    if result.rank != 0:
        print(f"rank {result.rank} of {result.processes} ({result.launcher}): copied its share, {result.share_pieces} "
              f"pieces, {result.share_bytes / 2**20:,.1f} MiB; rank 0 renames {result.output} into place once every "
              "process has reported")
        return 0
    split = f" by {result.processes} processes ({result.launcher})" if result.processes > 1 else ""
    # a universal checkpoint does not record how many ranks saved it: say nothing rather than "1"
    saved_by = f" saved by {result.source_world_size} rank(s)" if result.source_world_size else ""
    print(
        f"wrote {result.output}{split}: {result.tensors} tensors, {result.parameters:,} parameters, "
        f"{result.bytes / 2**20:,.1f} MiB ({args.dtype}) from tag {result.tag!r}{saved_by}; source checked before "
        f"reading: {CHECKED_LEVELS[result.verified]}"
    )
    return 0


def _dry_run(args: argparse.Namespace) -> int:
    """--dry-run: what would be read, and the file and staging place the real run would use."""
    from pathlib import Path

    from shardkit.commands._parser import emit_json
    from shardkit.commands._plan import launch_summary, plan_of, print_plan, run_checks

    run_checks(args, consolidate_command)  # the run's own checks, stopped before its first write
    out = Path(args.output)
    if out.is_dir():
        out = out / "model.safetensors"
    if launch_summary()["processes"] > 1:
        staging = str(out.parent / f".shardkit-tmp-{out.name}")
    else:
        staging = f"a hidden temporary file .{out.name}.tmp-<pid>-<nonce> beside {out}"
    plan = plan_of("consolidate", args.checkpoint, out, staging, args.workers, dtype=args.dtype)
    print_plan(plan)
    if args.json or args.json_file:
        emit_json(args, plan)
    return 0
