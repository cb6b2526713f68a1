"""`shardkit smoke`: train, checkpoint, resume in fresh ranks, compare loss curves (the main job)."""

from __future__ import annotations

import argparse

from shardkit.commands._parser import add_command, add_engine, add_json, add_quiet, add_world_size, llama_size


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "smoke",
        help="train N ranks, save, resume in fresh processes, check the loss curve is unchanged",
        example="shardkit smoke --engine all --world-size 2 --steps 4",
        description=(
            "For each engine: run A trains K steps uninterrupted; run B trains K/2 steps and saves; run C "
            "resumes in fresh processes, runs the placement preflight and trains the rest. Passes when the "
            "resumed losses equal run A's (bit-exact on CPU). Exit 0 all passed, 1 otherwise."
        ),
    )
    add_engine(p, ["zero3", "fsdp2", "all"], "engine to exercise (default: all)", default="all")
    add_world_size(p, "ranks per run (default: visible GPUs, else 2 CPU ranks)", nproc_alias=True)
    p.add_argument(
        "--device", choices=["auto", "cpu", "gpu"], default="auto",
        help="auto: one rank per visible GPU (nccl), CPU ranks (gloo) without GPUs; cpu: gloo ranks that never touch "
        "a GPU (any --world-size); gpu: GPUs only. More ranks than visible GPUs is refused unless --device cpu",
    )
    p.add_argument("--steps", type=int, default=4, help="steps of the uninterrupted run; checkpoint after half (default: 4)")
    p.add_argument("--config", default=None, help="DeepSpeed ZeRO-3 or shardkit FSDP2 config to use instead of the preset (with --engine all: the engine it is for)")
    p.add_argument("--model", type=llama_size, default="llama:tiny", metavar="llama:SIZE",
                   help="the Llama to train: llama:tiny, llama:small, llama:40m, llama:160m (default: llama:tiny)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S", help="hard limit per run in seconds (default: 300)")
    add_json(p, file_after_json=True)
    p.add_argument("--keep-checkpoint", default=None, metavar="DIR",
                   help="keep run B's verified checkpoint in DIR when the smoke passes (DIR/<engine> for --engine all); "
                   "DIR must be new or empty")
    add_quiet(p)
    p.set_defaults(func=smoke_command)


def smoke_command(args: argparse.Namespace) -> int:
    from shardkit.commands._parser import emit_json
    from shardkit.config.loading import config_kind, load_config
    from shardkit.run.smoke.options import ENGINES, SmokeOptions
    from shardkit.run.smoke.report import print_smoke_report
    from shardkit.run.smoke.runs import run_smoke

    engines = ENGINES if args.engine == "all" else (args.engine,)
    if args.config and args.engine == "all":
        # one config file drives one engine: smoke the engine it is written for
        engines = ("fsdp2",) if config_kind(load_config(args.config)) == "fsdp" else ("zero3",)
    opts = SmokeOptions(
        engines=engines,
        nproc=args.world_size,
        device=args.device,
        steps=args.steps,
        config=args.config,
        model=args.model,
        timeout=args.timeout,
        keep_checkpoint=args.keep_checkpoint,
    )
    report = run_smoke(opts, progress=not args.quiet)
    print_smoke_report(report)
    if args.json or args.json_file:
        # "nproc" kept for scripts that read it; "world_size" is its name in the one vocabulary
        emit_json(args, {"command": "smoke", **report.to_dict(), "world_size": report.nproc})
    return report.exit_code
