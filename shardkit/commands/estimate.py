"""`shardkit estimate`: memory per GPU and per host of a ZeRO or FSDP2 run, before it starts."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from shardkit.commands._parser import add_command, add_engine, add_json, add_world_size


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "estimate",
        help="memory per GPU and per host of a ZeRO/FSDP2 run, item by item, before it starts",
        example="shardkit estimate ds_config.json --model ./llama-7b --world-size 8 --gpu-memory 80GiB --host-memory 512GiB",
        description=(
            "Estimate what each rank holds on its GPU and on the host: parameters, gradients, fp32 masters, optimizer "
            "state, ZeRO's buckets and prefetch, pinned host memory and an activation estimate, each with the "
            "formula and the config key behind it, read from DeepSpeed 0.19.8's and torch's code. The model is built "
            "on the meta device from its config.json (nothing downloaded). Exit 0 when it fits the memory given "
            "(or none is given), 1 when it does not, 2 on usage errors."
        ),
    )
    p.add_argument("config", nargs="?", default=None, metavar="CONFIG",
                   help="DeepSpeed JSON/YAML or shardkit FSDP2 JSON (or describe one with --engine and its flags)")
    add_model_flags(p)
    add_engine(p, ["zero3", "zero2", "fsdp2"], "instead of CONFIG: the config `shardkit config` would write for this "
               "engine with the flags below ('fsdp' is the old spelling of fsdp2)")
    p.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"], default="none",
                   help="with --engine zero*: where fp32 masters and optimizer state live (default: none)")
    p.add_argument("--offload-param", choices=["none", "cpu", "nvme"], default="none",
                   help="with --engine zero3: where 16-bit parameter partitions live (default: none)")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16", help="with --engine zero*: default bf16")
    p.add_argument("--cpu-offload", action="store_true", help="with --engine fsdp2: CPUOffloadPolicy")
    p.add_argument("--mixed-precision", choices=["bf16", "fp16", "none"], default="bf16",
                   help="with --engine fsdp2: default bf16")
    add_run_flags(p)
    p.add_argument("--gpu-memory", default=None, metavar="SIZE", help="usable memory per GPU, e.g. 80GiB or 80GB")
    p.add_argument("--host-memory", default=None, metavar="SIZE", help="usable RAM per host, e.g. 512GiB")
    add_json(p)
    p.set_defaults(func=estimate_command)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """--model / --params / --largest-layer / --wrap: shared with `shardkit config ... --fit`."""
    p.add_argument("--model", default=None, metavar="PATH",
                   help="a config.json, a model folder holding one, or a hub id where the hub is reachable")
    p.add_argument("--params", default=None, metavar="N", help="instead of --model: a parameter count (6.8e9, 7B)")
    p.add_argument("--largest-layer", default=None, metavar="N",
                   help="with --params: parameters of the largest module (what ZeRO-3 gathers at once)")
    p.add_argument("--wrap", nargs="+", default=None, metavar="CLASSNAME",
                   help="FSDP2 unit classes (default: the FSDP2 config's wrap, else LlamaDecoderLayer)")


def add_run_flags(p: argparse.ArgumentParser, world_size: bool = True, micro_batch: bool = True) -> None:
    """The run around the model; shared with `shardkit config ... --fit` (which has its own --world-size and
    --micro-batch)."""
    if world_size:
        add_world_size(p, "data-parallel ranks, one per GPU (default: 1)", default=1)
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="ranks per host, for host memory (default: the world size, at most 8)")
    if micro_batch:
        p.add_argument("--micro-batch", type=int, default=None,
                       help="sequences per rank per step (default: the config's, else 1)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default: 2048)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each decoder layer in backward (keeps only its input)")
    p.add_argument("--whole-model-init", action="store_true",
                   help="every rank builds the whole model before sharding (no zero.Init / meta-device init)")


def run_shape(args: argparse.Namespace, world_size: int, micro_batch: int) -> Any:
    from shardkit.estimate.report import RunShape

    gpus = args.gpus_per_node if args.gpus_per_node is not None else min(world_size, 8)
    return RunShape(world_size=world_size, gpus_per_node=gpus, micro_batch=micro_batch, seq_len=args.seq_len,
                    activation_checkpointing=args.activation_checkpointing, whole_model_init=args.whole_model_init)


def limits(gpu: str | None, host: str | None, flags: tuple[str, str] = ("--gpu-memory", "--host-memory")
           ) -> tuple[int | None, int | None]:
    from shardkit.estimate.units import parse_size

    return (parse_size(gpu, flags[0]) if gpu else None, parse_size(host, flags[1]) if host else None)


def _engine_config(args: argparse.Namespace) -> dict[str, Any]:
    from shardkit.config import generate
    from shardkit.core.errors import UsageError

    if args.config and args.engine:
        raise UsageError(f"CONFIG {args.config} and --engine {args.engine}: give one (a file, or the flags of "
                         "`shardkit config`)")
    if args.config:
        from shardkit.estimate.inputs import read_engine_config

        return read_engine_config(args.config)
    engine = args.engine or "zero3"
    if engine == "fsdp2":
        return generate.fsdp_config(cpu_offload=args.cpu_offload, mixed_precision=args.mixed_precision)
    if engine == "zero2" and args.offload_param != "none":
        raise UsageError("--offload-param needs --engine zero3: ZeRO-2 would ignore it silently")
    return generate.deepspeed_config(int(engine[-1]), offload_optimizer=args.offload_optimizer,
                                     offload_param=args.offload_param, precision=args.precision)


def estimate_command(args: argparse.Namespace) -> int:
    from shardkit.core.render import console
    from shardkit.estimate.compute import estimate_memory
    from shardkit.estimate.inputs import micro_batch_of, resolve_model, wrap_of
    from shardkit.estimate.report import print_estimate
    from shardkit.estimate.settings import settings_from_config

    gpu, host = limits(args.gpu_memory, args.host_memory)
    cfg = _engine_config(args)
    model = resolve_model(args.model, args.params, args.largest_layer, args.wrap or wrap_of(cfg) or ["LlamaDecoderLayer"])
    settings = settings_from_config(cfg, model.hidden_size)
    micro = args.micro_batch
    if micro is None and micro_batch_of(cfg) is not None:  # the config's: refused naming its key, not a flag
        from shardkit.estimate.bounds import MICRO_BATCH, check_config_number

        micro = check_config_number(micro_batch_of(cfg), "train_micro_batch_size_per_gpu", MICRO_BATCH,
                                    args.config or "the --engine config")
    run = run_shape(args, args.world_size, micro or 1)
    est = estimate_memory(model, settings, run, gpu, host)
    if args.json or args.json_file:
        import json

        from shardkit.commands._parser import emit_json

        emit_json(args, json.loads(est.to_json()))
    if not args.json:
        print_estimate(est, file=None if sys.stdout.isatty() else sys.stdout)
        if not est.fits():
            console(sys.stderr).print("[red]does not fit[/red]: try `shardkit config zero3 --fit ...` for the least "
                                      "offloading config that does")
    return 0 if est.fits() else 1


def add_fit_flags(p: argparse.ArgumentParser, kind: str) -> None:
    """`shardkit config KIND --fit GPU_MEM[,HOST_MEM]` and what it needs to know about the model and the run."""
    g = p.add_argument_group("--fit: choose the least offloading config that fits (see `shardkit estimate`)")
    g.add_argument("--fit", default=None, metavar="GPU_MEM[,HOST_MEM]",
                   help="memory per GPU (and per host), e.g. 80GiB,512GiB: the offload flags are chosen, least "
                        "offloading first, and the estimate that decided is printed to stderr")
    g.add_argument("--model", default=None, metavar="PATH", help="with --fit: a config.json or model folder")
    g.add_argument("--params", default=None, metavar="N", help="with --fit: instead of --model, a parameter count")
    g.add_argument("--largest-layer", default=None, metavar="N", help="with --fit --params: the largest module's size")
    add_run_flags(g, world_size=False, micro_batch=False)  # type: ignore[arg-type]


def fit(args: argparse.Namespace, build: Any) -> None:
    """Set the offload flags of ``args`` (a `shardkit config` namespace) to the least offloading rung whose
    estimate fits --fit; print the estimate and the ladder to stderr. ``build(namespace)`` makes the config dict."""
    import copy

    from shardkit.core.errors import ConfigError, UsageError
    from shardkit.estimate.compute import estimate_memory
    from shardkit.estimate.fit import find_fit, ladder
    from shardkit.estimate.inputs import resolve_model
    from shardkit.estimate.report import print_estimate
    from shardkit.estimate.settings import settings_from_config

    chosen_flags = [f"--offload-{k}" for k in ("optimizer", "param") if getattr(args, f"offload_{k}", "none") != "none"]
    if args.kind == "fsdp" and args.cpu_offload:
        chosen_flags.append("--cpu-offload")
    if chosen_flags:
        raise UsageError(f"--fit chooses the offload itself: drop {' and '.join(chosen_flags)} (or drop --fit to "
                         "write exactly what you asked for)")
    gpu_text, _, host_text = args.fit.partition(",")
    if not gpu_text.strip():
        raise UsageError(f"--fit {args.fit!r}: no GPU memory before the comma. Write GPU_MEM[,HOST_MEM], e.g. 80GiB,512GiB")
    gpu, host = limits(gpu_text, host_text or None, ("--fit GPU_MEM", "--fit HOST_MEM"))
    wrap = args.wrap if args.kind == "fsdp" else ["LlamaDecoderLayer"]
    model = resolve_model(args.model, args.params, args.largest_layer, wrap)
    from shardkit.estimate.bounds import WORLD_SIZE, check_flag

    check_flag(args.world_size, "--world-size", WORLD_SIZE)  # 0 was taken as 1 without a word
    world = args.world_size or 1
    run = run_shape(args, world, args.micro_batch)

    def estimate_of(rung: Any) -> Any:
        ns = copy.copy(args)
        for key, value in rung.overrides.items():
            setattr(ns, key, value)
        if args.kind == "fsdp":
            ns.format = "shardkit"
        cfg = build(ns)
        return estimate_memory(model, settings_from_config(cfg, model.hidden_size), run, gpu, host)

    result = find_fit(ladder(args.kind, nvme=bool(getattr(args, "nvme_path", None))), estimate_of)
    err = sys.stderr
    if result.chosen is None:
        best = min((est for _, est in result.tried), key=lambda e: e.per_gpu_peak())
        print_estimate(best, file=err)
        raise ConfigError(
            f"--fit {args.fit}: no {args.kind} config fits {run.world_size} rank(s) of this model: "
            + "; ".join(result.summary())
            + ". Fixes: more ranks (--world-size), --activation-checkpointing, a smaller --micro-batch or --seq-len"
            + (", --nvme-path DIR for NVMe offload" if args.kind == "zero3" else "")
        )
    rung, est = result.tried[result.chosen]
    for key, value in rung.overrides.items():
        setattr(args, key, value)
    print_estimate(est, file=err)
    print("--fit: " + " | ".join(result.summary()), file=err)
