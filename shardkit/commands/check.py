"""`shardkit check CONFIG`: static checks of a DeepSpeed or shardkit FSDP2 config."""

from __future__ import annotations

import argparse
import sys

from shardkit.commands._parser import MODEL_SPEC_HELP, add_command, add_json, add_world_size


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "check",
        help="check a DeepSpeed / FSDP2 config for settings that fail or silently misbehave",
        example="shardkit check ds_config.json --world-size 8 --deepspeed-version 0.14.1",
        description=(
            "Print every finding with its severity, key path, the value seen, why it is wrong (with the "
            "upstream issue) and the fix. Exit 0 when there is no error, 1 when there is, 2 on usage errors."
        ),
    )
    p.add_argument("config", metavar="CONFIG", help="DeepSpeed JSON/YAML, shardkit FSDP2 JSON, or Accelerate FSDP config")
    add_world_size(p, "number of data-parallel ranks the run will use")
    p.add_argument("--deepspeed-version", default=None, metavar="V",
                   help="check against this DeepSpeed release (default: the installed one)")
    p.add_argument("--torch-version", default=None, metavar="V",
                   help="torch release for version-table rows that depend on it (default: the installed one)")
    p.add_argument("--accelerator", action=argparse.BooleanOptionalAction, default=None,
                   help="state whether the run has a GPU/accelerator, for the pin_memory and fp16 rules (default: "
                   "unknown; `shardkit config` and `shardkit preflight` use this machine's answer)")
    p.add_argument("--hf-auto", action="store_true", help='"auto" values are expected (HF Trainer/Accelerate fills them)')
    p.add_argument("--model", default=None, metavar="SPEC",
                   help=f"model ({MODEL_SPEC_HELP}) to check FSDP wrap classes against")
    add_json(p)
    p.set_defaults(func=check_command)


def check_command(args: argparse.Namespace) -> int:
    from shardkit.checks import check_file
    from shardkit.commands._parser import emit_json
    from shardkit.core.errors import UsageError
    from shardkit.core.render import print_report

    if args.world_size is not None and args.world_size < 1:
        raise UsageError(f"--world-size {args.world_size}: must be at least 1")
    report = check_file(
        args.config,
        world_size=args.world_size,
        deepspeed_version=args.deepspeed_version,
        torch_version=args.torch_version,
        accelerator=args.accelerator,
        expect_hf_auto=args.hf_auto,
        model=args.model,
    )
    if args.json or args.json_file:
        emit_json(args, report.to_dict())
    if not args.json:
        # captured output (CI logs, pipes) gets render's fixed 160 columns so key paths do not fold
        print_report(report, file=None if sys.stdout.isatty() else sys.stdout)
    return report.exit_code
