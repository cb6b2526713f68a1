"""`shardkit versions`: installed torch/deepspeed/transformers and the known-bad table rows that apply."""

from __future__ import annotations

import argparse
import sys

from shardkit.commands._parser import add_command, add_json


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "versions",
        help="show installed versions and every known DeepSpeed problem that applies, with the pip fix",
        example="shardkit versions --config ds_config.json",
        description=(
            "Report installed torch/deepspeed/transformers and every row of shardkit's known-bad DeepSpeed "
            "table that applies to the installed (or --deepspeed-version) release; with --config only rows "
            "whose trigger matches that config. Exit 1 when an error-level row applies."
        ),
    )
    p.add_argument("--config", default=None, metavar="CONFIG", help="only rows whose trigger matches this DeepSpeed config")
    p.add_argument("--deepspeed-version", default=None, metavar="V", help="evaluate this release instead of the installed one")
    add_json(p)
    p.set_defaults(func=versions_command)


def versions_command(args: argparse.Namespace) -> int:
    from shardkit.config.loading import load_config
    from shardkit.core.render import console, print_report
    from shardkit.platform.environment.report import version_report

    cfg = None
    if args.config:
        cfg = load_config(args.config)
    data, report = version_report(cfg, deepspeed_version=args.deepspeed_version, source=args.config)
    if args.json or args.json_file:
        from shardkit.commands._parser import emit_json

        emit_json(args, {**data, "report": report.to_dict()})
        if args.json:
            return report.exit_code
    con = console()
    for name, version in data["installed"].items():
        con.print(f"{name:13} {version or 'not installed'}")
    status = data["support"]
    con.print(f"{'supported':13} {status['supported']} (shardkit is tested with deepspeed {status['range']})")
    verified = status["verified"] if status["verified"] is not None else "no verified list"
    con.print(f"{'verified':13} {verified}" + (f" ({status['verified_why']})" if status.get("verified_why") else ""),
              markup=False)
    for note in status["notes"]:
        con.print(f"[yellow]note[/yellow] {note}")
    if data["deepspeed"] is None:
        con.print("deepspeed is not installed and no --deepspeed-version was given: nothing to look up")
        return 0
    print_report(report, file=None if sys.stdout.isatty() else sys.stdout)
    return report.exit_code
