"""`shardkit verify CKPT`: check a checkpoint against its manifest (sizes, digests, rank files,
world size, engine) before a resume trusts it."""

from __future__ import annotations

import argparse

from shardkit.commands._parser import add_command, add_engine, add_json, add_no_verify, add_world_size


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "verify",
        help="check a checkpoint's files against its shardkit manifest",
        example="shardkit verify checkpoints/ --world-size 8",
        description=(
            "Check a checkpoint written by shardkit: every file present with its recorded size and digest (blake3, or sha256 in older manifests), "
            "every rank file the world size needs, and (when given) the engine and world size of the run "
            "that will resume it. CKPT is the root holding 'latest' or one tag directory; a Hugging Face Trainer "
            "checkpoint-N folder is such a root, and a Trainer output_dir is checked at its newest checkpoint-N. "
            "Exit 0: resumable; 1: problems found; 2: usage error."
        ),
    )
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint root (with 'latest') or a tag directory")
    add_world_size(p, "world size of the run that will resume")
    add_engine(p, ["zero3", "fsdp2", "torch"], "engine of the run that will resume (zero3: a DeepSpeed checkpoint; "
               "'deepspeed' is the old spelling)")
    add_no_verify(p, "check sizes only, skip the content digests (fast)", no_checksum_alias=True)
    add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shardkit.checkpoint.hf_trainer.folder import verify_trainer_checkpoint
    from shardkit.commands._parser import Stopwatch, emit_json
    from shardkit.core.errors import UsageError
    from shardkit.core.render import print_report
    from shardkit.storage.verify import verify_checkpoint

    if args.world_size is not None and args.world_size < 1:
        raise UsageError(f"--world-size must be at least 1, got {args.world_size}")
    clock = Stopwatch()
    # the manifests name a ZeRO-3 checkpoint's engine 'deepspeed'
    engine = "deepspeed" if args.engine == "zero3" else args.engine
    kw = dict(world_size=args.world_size, engine=engine, checksums=not args.no_verify)
    # a Trainer checkpoint-N or output_dir (None: not Trainer-shaped, the plain rules apply)
    report = verify_trainer_checkpoint(args.checkpoint, **kw) or verify_checkpoint(args.checkpoint, **kw)
    if args.json or args.json_file:
        files = report.manifest.files if report.manifest is not None else []
        emit_json(args, {**report.to_dict(), "command": "verify", "files": len(files),
                         "bytes": sum(f.size for f in files),
                         "checked": "sizes only" if args.no_verify else "sizes and content digests",
                         "seconds": clock.seconds})
    if not args.json:
        print_report(report)
        if report.ok and report.manifest is not None:
            m = report.manifest
            print(f"resumable: {report.tag_dir} (engine {m.engine}, world size {m.world_size}, step {m.step}, "
                  f"{len(m.files)} files)")
    return report.exit_code
