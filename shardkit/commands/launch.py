"""`shardkit launch`: static checks + version table on the script's config (or the Accelerate
config an `accelerate launch` run reads), then the real launcher."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from shardkit.commands._parser import CommandParser, add_command, add_json
from shardkit.commands._result import launch_own_options

USAGE = (
    "shardkit launch [--launcher deepspeed|torchrun|accelerate] [--no-preflight] [--dry-run] [--json] "
    "[--json-file PATH] [launcher args] "
    "script.py [script args]"
)


class _PassThroughParser(CommandParser):
    """Parses shardkit's own options at the front and hands everything after them to the real
    launcher untouched: argparse would otherwise reject the launcher's options (--nproc_per_node)."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        args = list(sys.argv[1:] if args is None else args)
        own = launch_own_options(args)
        i = len(own)
        ns, extras = super().parse_known_args(own, namespace)
        ns.argv = args[i:]
        return ns, extras


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "launch",
        help="check the script's config, then start deepspeed/torchrun/accelerate with a placement preflight on every rank",
        example="shardkit launch --launcher torchrun --nproc_per_node 2 train.py --deepspeed_config ds_config.json",
        description=(
            "Finds the config the script will use (--deepspeed_config/--deepspeed/--config, also NAME=PATH; with "
            "--launcher accelerate the Accelerate config from --config_file or accelerate's default location, with "
            "the command line's overrides), runs "
            "`shardkit check` and the known-bad version table on it (errors stop the launch, exit 1), then starts "
            "the real launcher with every argument passed through untouched. Unless --no-preflight, each rank "
            "runs the placement preflight before its first optimizer step (no change to the script) and reports to "
            "the launch; a failing preflight stops all ranks (exit 3), and the launch's last line says on how many "
            "ranks it passed, or names the ranks where it never ran and why. shardkit's own options must come first."
        ),
    )
    p.__class__ = _PassThroughParser
    p.usage = USAGE
    p.add_argument(
        "--launcher", choices=["deepspeed", "torchrun", "accelerate"], default="deepspeed",
        help="the real launcher (default: deepspeed); accelerate runs `accelerate launch [accelerate args] script.py ...`",
    )
    p.add_argument("--no-preflight", action="store_true", help="do not run the placement preflight in the ranks")
    p.add_argument("--dry-run", action="store_true", help="check the config and print the launcher command, start nothing")
    add_json(p)
    p.add_argument("argv", nargs=argparse.REMAINDER, help="launcher arguments, the script, and its arguments")
    p.set_defaults(func=launch_command)


def launch_command(args: argparse.Namespace) -> int:
    import shlex

    from shardkit.core.render import print_report
    from shardkit.platform.environment.report import require_no_hang_traps
    from shardkit.run.launcher import build_launch, check_launch_config, expected_ranks, missing_script, run_launch

    plan = build_launch(args.argv, args.launcher, preflight=not args.no_preflight)
    why = missing_script(plan)
    if why:
        return _not_started(args, plan.argv, None, why)
    report = check_launch_config(plan)
    # accelerate without a config file: its command-line settings were checked all the same
    checked_something = plan.config_path is not None or plan.accelerate is not None
    if report.findings:  # the launching shell's variables are checked with or without a config
        print_report(report)
    for note in plan.notes:
        print(f"shardkit launch: {note}", file=sys.stderr)
    subject = plan.config_path or (
        "accelerate's command-line settings (no config file)" if plan.accelerate is not None else "the launching environment"
    )
    if not report.ok:
        return _not_started(args, plan.argv, report, f"{len(report.errors)} error(s) in {subject}")
    # a stale op-build lock or a socket interface this host lacks: every rank would wait in silence
    rdzv = plan.rendezvous
    require_no_hang_traps(plan.env, cross_node=(rdzv.host, rdzv.min_nodes) if rdzv is not None else None)
    checked = f"{subject} checked" if checked_something else "no config named"
    # a request, not a promise: the closing line says on how many ranks it ran (launch_reports)
    expected = expected_ranks(plan) if plan.preflight else None
    preflight = "placement preflight requested on every rank" if plan.preflight else "no preflight"
    if expected is not None and expected.unreachable:
        print(f"shardkit launch: warning: the preflight will not reach the other nodes' ranks: {expected.unreachable}",
              file=sys.stderr, flush=True)
    if args.dry_run:
        print(f"shardkit launch: {checked}; {preflight}; would run: {shlex.join(plan.argv)}", file=sys.stderr, flush=True)
        _emit_launch(args, plan.argv, report, None)
        return 0
    print(f"shardkit launch: {checked}; {preflight}; starting: {shlex.join(plan.argv)}", file=sys.stderr, flush=True)
    if not args.json:
        code = run_launch(plan, expected)
    else:
        with _children_print_to_stderr():
            code = run_launch(plan, expected)
    _emit_launch(args, plan.argv, report, code)
    return code


def _emit_launch(args: argparse.Namespace, argv: list[str], report: Any, code: int | None) -> None:
    """--json / --json-file: the command run (or that would run), the config findings, the exit status."""
    if args.json or args.json_file:
        from shardkit.commands._parser import emit_json

        emit_json(args, {"command": "launch", "dry_run": code is None, "ok": code in (None, 0), "argv": argv,
                         "preflight": not args.no_preflight, "exit_code": code, "check": report.to_dict()})


def _not_started(args: argparse.Namespace, argv: list[str], report: Any, why: str) -> int:
    """The checks refused the launch (a dry run's too): exit 1, and under --json the object saying why."""
    print(f"shardkit launch: not started: {why}", file=sys.stderr)
    if args.json or args.json_file:
        from shardkit.commands._parser import emit_json

        emit_json(args, {"command": "launch", "dry_run": bool(args.dry_run), "ok": False, "exit_code": 1,
                         "error": f"not started: {why}", "argv": argv, "preflight": not args.no_preflight,
                         "check": report.to_dict() if report is not None else None})
    return 1


def _children_print_to_stderr() -> Any:
    """With --json the launched ranks' own output (file descriptor 1, inherited) goes to stderr, so stdout
    holds the JSON result alone; descriptor 1 is restored before the result is written."""
    import contextlib
    import os

    @contextlib.contextmanager
    def swapped() -> Any:
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            os.dup2(2, 1)
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)

    return swapped()
