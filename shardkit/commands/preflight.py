"""`shardkit preflight CONFIG`: static checks, then a real multi-rank placement preflight and one step."""

from __future__ import annotations

import argparse

from shardkit.cli import add_command


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "preflight",
        help="check that every rank's tensors sit on the device CONFIG implies, before the first step",
        example="shardkit preflight ds_config.json --nproc 2 --json placement.json",
        description=(
            "Runs the static config checks (stops on errors; --static stops there), then spawns N ranks that "
            "build the model, initialize DeepSpeed or FSDP2 from CONFIG, run the placement preflight "
            "(parameters, ZeRO partitions, fp32 masters, gradients, optimizer state vs. the devices the config "
            "implies; versions, config digest and parameter set across ranks) and one training step. "
            "Exit 0 clean, 1 findings, 2 usage error."
        ),
    )
    p.add_argument("config", help="DeepSpeed config (JSON/YAML) or shardkit FSDP2 config (top-level \"fsdp\" key)")
    p.add_argument("--nproc", type=int, default=None, help="ranks to spawn (default: visible GPUs, else 2 CPU ranks with gloo)")
    p.add_argument(
        "--device", choices=["auto", "cpu", "gpu"], default="auto",
        help="auto: one rank per visible GPU (nccl), CPU ranks (gloo) without GPUs; cpu: gloo ranks that never touch "
        "a GPU (any --nproc); gpu: GPUs only. More ranks than visible GPUs is refused unless --device cpu",
    )
    p.add_argument("--model", default=None, metavar="SPEC", help="llama:SIZE (tiny, small, 40m, 160m) or pkg.module:factory (default: llama:tiny)")
    p.add_argument("--static", action="store_true", help="only the static config checks; spawn nothing")
    p.add_argument("--json", default=None, metavar="FILE", help="write the full placement report as JSON ('-' for stdout)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="seconds to wait for a late rank at the preflight (default: 60)")
    p.set_defaults(func=preflight_command)


def preflight_command(args: argparse.Namespace) -> int:
    from shardkit.placement.run import PreflightOptions, run_preflight

    return run_preflight(
        PreflightOptions(
            config=args.config,
            nproc=args.nproc,
            device=args.device,
            model=args.model,
            static=args.static,
            json_path=args.json,
            timeout=args.timeout,
        )
    )
