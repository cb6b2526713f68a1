"""`shardkit smoke`: train, checkpoint, resume in fresh ranks, compare loss curves (the main job)."""

from __future__ import annotations

import argparse

from shardkit.commands._parser import add_command


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "smoke",
        help="train N ranks, save, resume in fresh processes, check the loss curve is unchanged",
        example="shardkit smoke --engine all --nproc 2 --steps 4",
        description=(
            "For each engine: run A trains K steps uninterrupted; run B trains K/2 steps and saves; run C "
            "resumes in fresh processes, runs the placement preflight and trains the rest. Passes when the "
            "resumed losses equal run A's (bit-exact on CPU). Exit 0 all passed, 1 otherwise."
        ),
    )
    p.add_argument("--engine", choices=["zero3", "fsdp2", "all"], default="all", help="engine to exercise (default: all)")
    p.add_argument("--nproc", type=int, default=None, help="ranks per run (default: visible GPUs, else 2 CPU ranks)")
    p.add_argument(
        "--device", choices=["auto", "cpu", "gpu"], default="auto",
        help="auto: one rank per visible GPU (nccl), CPU ranks (gloo) without GPUs; cpu: gloo ranks that never touch "
        "a GPU (any --nproc); gpu: GPUs only. More ranks than visible GPUs is refused unless --device cpu",
    )
    p.add_argument("--steps", type=int, default=4, help="steps of the uninterrupted run; checkpoint after half (default: 4)")
    p.add_argument("--config", default=None, help="DeepSpeed ZeRO-3 or shardkit FSDP2 config to use instead of the preset (with --engine all: the engine it is for)")
    p.add_argument("--model", default="tiny", help="Llama size: tiny, small, 40m, 160m (default: tiny)")
    p.add_argument("--timeout", type=float, default=300.0, help="hard limit per run in seconds (default: 300)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON ('-' for stdout)")
    p.add_argument("--keep-checkpoint", default=None, metavar="DIR",
                   help="keep run B's verified checkpoint in DIR when the smoke passes (DIR/<engine> for --engine all); "
                   "DIR must be new or empty")
    p.add_argument("--quiet", action="store_true", help="no progress display (without a terminal: no progress lines on stderr)")
    p.set_defaults(func=smoke_command)


def smoke_command(args: argparse.Namespace) -> int:
    from shardkit.config.loading import config_kind, load_config
    from shardkit.core.render import write_json
    from shardkit.run.smoke.options import ENGINES, SmokeOptions
    from shardkit.run.smoke.report import print_smoke_report
    from shardkit.run.smoke.runs import run_smoke

    engines = ENGINES if args.engine == "all" else (args.engine,)
    if args.config and args.engine == "all":
        # one config file drives one engine: smoke the engine it is written for
        engines = ("fsdp2",) if config_kind(load_config(args.config)) == "fsdp" else ("zero3",)
    opts = SmokeOptions(
        engines=engines,
        nproc=args.nproc,
        device=args.device,
        steps=args.steps,
        config=args.config,
        model=args.model,
        timeout=args.timeout,
        keep_checkpoint=args.keep_checkpoint,
    )
    report = run_smoke(opts, progress=not args.quiet)
    print_smoke_report(report)
    if args.json:
        write_json(report.to_dict(), args.json)
    return report.exit_code
