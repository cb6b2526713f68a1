"""`shardkit verify CKPT`: check a checkpoint against its manifest (sizes, digests, rank files,
world size, engine) before a resume trusts it."""

from __future__ import annotations

import argparse

from shardkit.commands._parser import add_command


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
    p.add_argument("--world-size", type=int, default=None, help="world size of the run that will resume")
    p.add_argument("--engine", choices=["deepspeed", "fsdp2", "torch"], default=None,
                   help="engine of the run that will resume")
    p.add_argument("--no-checksum", action="store_true", help="check sizes only, skip the content digests (fast)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shardkit.checkpoint.hf_trainer.folder import verify_trainer_checkpoint
    from shardkit.checkpoint.io.verify import verify_checkpoint
    from shardkit.core.errors import UsageError
    from shardkit.core.render import print_report, write_json

    if args.world_size is not None and args.world_size < 1:
        raise UsageError(f"--world-size must be at least 1, got {args.world_size}")
    kw = dict(world_size=args.world_size, engine=args.engine, checksums=not args.no_checksum)
    # a Trainer checkpoint-N or output_dir (None: not Trainer-shaped, the plain rules apply)
    report = verify_trainer_checkpoint(args.checkpoint, **kw) or verify_checkpoint(args.checkpoint, **kw)
    if args.json:
        write_json(report.to_dict(), None)
    else:
        print_report(report)
        if report.ok and report.manifest is not None:
            m = report.manifest
            print(f"resumable: {report.tag_dir} (engine {m.engine}, world size {m.world_size}, step {m.step}, "
                  f"{len(m.files)} files)")
    return report.exit_code
