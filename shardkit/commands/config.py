"""`shardkit config zero3|zero2|fsdp`: write a config that is known to work (it passes `shardkit check`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from shardkit.commands._parser import HelpFormatter, add_command, add_json
from shardkit.commands.estimate import add_fit_flags


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "config",
        help="generate a validated DeepSpeed ZeRO-2/3 or FSDP2 config",
        example="shardkit config zero3 --offload-optimizer cpu --offload-param cpu --world-size 8 -o ds_config.json",
        description=(
            "Generate a config with every value concrete (or HF Trainer 'auto' values with --hf-auto). "
            "The file is checked with `shardkit check` before it is written; combinations DeepSpeed would "
            "silently ignore (param offload at stage 2, nvme without a path) are refused (exit 2)."
        ),
    )
    kinds = p.add_subparsers(dest="kind", metavar="KIND", required=True)
    for stage in (3, 2):
        name = f"zero{stage}"
        k = kinds.add_parser(
            name,
            help=f"DeepSpeed ZeRO-{stage} JSON",
            description=f"Write a DeepSpeed ZeRO-{stage} config (JSON).",
            epilog=f"example:\n  shardkit config {name} --offload-optimizer cpu --precision bf16 --world-size 8 -o ds_config.json",
            formatter_class=HelpFormatter,
        )
        k.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"] if stage == 3 else ["none", "cpu"],
                       default="none", help="where optimizer states and the fp32 masters live (default: none)")
        if stage == 3:
            k.add_argument("--offload-param", choices=["none", "cpu", "nvme"], default="none",
                           help="where 16-bit parameter partitions live between uses (default: none)")
            k.add_argument("--nvme-path", default=None, help="directory on a local NVMe drive (required with nvme)")
        k.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16", help="default: bf16")
        k.add_argument("--micro-batch", type=int, default=1, help="train_micro_batch_size_per_gpu (default: 1)")
        k.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps (default: 1)")
        k.add_argument("--world-size", type=int, default=None,
                       help="also write train_batch_size = micro x accum x world size (default: let DeepSpeed compute it)")
        k.add_argument("--clip", type=float, default=1.0, help="gradient_clipping; 0 disables (default: 1.0)")
        k.add_argument("--optimizer", choices=["adamw", "adam", "lion", "adagrad"], default="adamw",
                       help="optimizer built by DeepSpeed (CPU version when offloaded) (default: adamw)")
        k.add_argument("--lr", type=float, default=1e-4, help="learning rate (default: 1e-4)")
        k.add_argument("--weight-decay", type=float, default=0.0, help="default: 0.0")
        k.add_argument("--pin-memory", action=argparse.BooleanOptionalAction, default=None,
                       help="pin offloaded host memory, written explicitly since the default changed in 0.19.5 "
                       "(default: on when the run has an accelerator, see --accelerator; --no-pin-memory on hosts "
                       "with tight memlock limits)")
        _accelerator_flag(k)
        k.add_argument("--hf-auto", action="store_true",
                       help='emit "auto" for the values the HF Trainer/Accelerate fills in')
        k.add_argument("-o", "--output", default="-", metavar="FILE", help="output file ('-' for stdout, the default)")
        add_json(k)
        add_fit_flags(k, name)
        k.set_defaults(func=config_command, stage=stage)

    f = kinds.add_parser(
        "fsdp",
        aliases=["fsdp2"],  # the --engine vocabulary's name for it (estimate, smoke, verify)
        help="shardkit FSDP2 JSON (or an Accelerate config with --format accelerate)",
        description="Write shardkit's FSDP2 config, applied by shardkit.apply_fsdp (torch fully_shard).",
        epilog="example:\n  shardkit config fsdp --wrap LlamaDecoderLayer --mixed-precision bf16 -o fsdp.json",
        formatter_class=HelpFormatter,
    )
    f.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="free gathered params after forward (FULL_SHARD); --no-... keeps them (SHARD_GRAD_OP) (default: on)")
    f.add_argument("--cpu-offload", action="store_true", help="offload params, grads and optimizer states to CPU")
    # --no-pin-memory too, the spelling `config zero3` accepts, so one script works for both kinds
    f.add_argument("--pin-memory", action=argparse.BooleanOptionalAction, default=False,
                   help="pin offloaded memory (needs an accelerator; torch's own default is on, shardkit's off: "
                   "--no-pin-memory states it)")
    f.add_argument("--mixed-precision", choices=["bf16", "fp16", "none"], default="bf16", help="default: bf16")
    f.add_argument("--wrap", nargs="+", default=["LlamaDecoderLayer"], metavar="CLASSNAME",
                   help="module classes sharded as their own unit (default: LlamaDecoderLayer)")
    f.add_argument("--state-dict", choices=["sharded", "full"], default="sharded", help="checkpoint format (default: sharded)")
    f.add_argument("--micro-batch", type=int, default=1, help="default: 1")
    f.add_argument("--grad-accum", type=int, default=1, help="default: 1")
    f.add_argument("--lr", type=float, default=1e-4, help="default: 1e-4")
    f.add_argument("--weight-decay", type=float, default=0.0, help="default: 0.0")
    f.add_argument("--clip", type=float, default=1.0, help="max grad norm; 0 disables (default: 1.0)")
    f.add_argument("--world-size", type=int, default=None, help="num_processes for --format accelerate")
    _accelerator_flag(f)
    f.add_argument("--format", choices=["shardkit", "accelerate"], default="shardkit",
                   help="shardkit JSON (default) or an Accelerate config (YAML unless FILE ends in .json)")
    f.add_argument("-o", "--output", default="-", metavar="FILE", help="output file ('-' for stdout, the default)")
    add_json(f)
    add_fit_flags(f, "fsdp")
    # kind="fsdp" whichever name chose it: the code asks for "fsdp"
    f.set_defaults(func=config_command, stage=None, kind="fsdp")


def _accelerator_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--accelerator", action=argparse.BooleanOptionalAction, default=None,
                   help="whether the run has a GPU/accelerator: sets the pin_memory default and the check the file "
                   "must pass (default: whether DeepSpeed picks one on this machine: DS_ACCELERATOR, else CUDA)")


def run_has_accelerator(args: argparse.Namespace, facts: Any = None) -> bool:
    """--accelerator / --no-accelerator, else the accelerator DeepSpeed picks on this machine
    (shardkit.platform.environment.facts.run_has_accelerator: DS_ACCELERATOR, else CUDA; an MPS/XPU torch or
    DS_ACCELERATOR=cpu is a CPU run), the answer `smoke`, `launch` and `check`'s environment rows use."""
    from shardkit.platform.environment.facts import run_has_accelerator as _environment_answer

    return _environment_answer(getattr(args, "accelerator", None), facts)


def build_config(args: argparse.Namespace, facts: Any = None) -> dict[str, Any]:
    """The config dict the parsed arguments describe (``facts``: the machine judged when
    --accelerator is not given; default: this one)."""
    from shardkit.checks.offload import pin_memory_for
    from shardkit.config import generate

    if args.kind == "fsdp":
        cfg = generate.fsdp_config(
            reshard_after_forward=args.reshard_after_forward,
            cpu_offload=args.cpu_offload,
            pin_memory=args.pin_memory,
            mixed_precision=args.mixed_precision,
            wrap=args.wrap,
            state_dict=args.state_dict,
            micro_batch=args.micro_batch,
            grad_accum=args.grad_accum,
            lr=args.lr,
            weight_decay=args.weight_decay,
            clip=args.clip,
        )
        if args.format == "accelerate":
            return generate.accelerate_fsdp_config(cfg, num_processes=args.world_size)
        return cfg
    return generate.deepspeed_config(
        args.stage,
        offload_optimizer=args.offload_optimizer,
        offload_param=getattr(args, "offload_param", "none"),
        nvme_path=getattr(args, "nvme_path", None),
        precision=args.precision,
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        world_size=args.world_size,
        clip=args.clip,
        optimizer=args.optimizer,
        lr=args.lr,
        weight_decay=args.weight_decay,
        pin_memory=args.pin_memory if args.pin_memory is not None else pin_memory_for(run_has_accelerator(args, facts)),
        hf_auto=args.hf_auto,
    )


def config_command(args: argparse.Namespace, facts: Any = None) -> int:
    """``facts``: the machine's EnvironmentFacts (default: probed, as `shardkit check FILE` does)."""
    from shardkit.checks import check_config
    from shardkit.core.errors import ConfigError
    from shardkit.platform.environment.facts import probe_environment
    from shardkit.platform.environment.report import one_line
    from shardkit.platform.environment.rows import environment_rule_ids

    # The file is judged exactly as the `shardkit check FILE ...` it is said to pass: that command
    # (check_file) probes this machine's environment, so this check does too.
    facts = facts or probe_environment()
    if getattr(args, "fit", None):  # sets the offload flags to the least offloading config that fits
        from shardkit.commands.estimate import fit

        fit(args, lambda ns: build_config(ns, facts))
    cfg = build_config(args, facts)
    accelerator = run_has_accelerator(args, facts)
    world_size = getattr(args, "world_size", None) if args.kind != "fsdp" else None
    hf_auto = getattr(args, "hf_auto", False)
    report = check_config(cfg, source=args.output, world_size=world_size, expect_hf_auto=hf_auto,
                          accelerator=accelerator, environment=facts)
    machine = [f for f in report.errors if f.rule in environment_rule_ids()]
    if machine:  # a fine config this machine's run cannot use: say so rather than claim it passes
        judged = ("" if getattr(args, "accelerator", None) is not None else
                  "; the run's accelerator was judged from this machine: pass --accelerator if it runs on a GPU machine")
        raise ConfigError(
            f"{'nothing printed' if args.output == '-' else args.output + ': not written'}: `{check_command(args, accelerator, world_size, hf_auto)}` would report "
            f"{len(machine)} error(s) on this machine: " + "; ".join(one_line(f) for f in machine) + judged
        )
    if report.errors:  # a generator bug: never write a file that shardkit itself refuses
        raise ConfigError(
            "generated config fails `shardkit check`: "
            + "; ".join(f"{f.key}: {f.message}" for f in report.errors)
            + ". Please report this."
        )
    _write(cfg, args.output, yaml=args.kind == "fsdp" and args.format == "accelerate" and not args.output.endswith(".json"))
    if args.output != "-":
        print(f"wrote {args.output}: {passed_message(args, report, accelerator, world_size, hf_auto)}", file=sys.stderr)
    if args.json or args.json_file:
        from shardkit.commands._parser import emit_json

        emit_json(args, {"command": "config", "kind": args.kind, "output": None if args.output == "-" else args.output,
                         "config": cfg, "check": report.to_dict()})
    return 0


def passed_message(args: argparse.Namespace, report: Any, accelerator: bool, world_size: int | None, hf_auto: bool) -> str:
    """Exactly which `shardkit check` the file passed, and what that does not cover."""
    command = check_command(args, accelerator, world_size, hf_auto)
    notes = []
    if report.warnings:
        notes.append(f"{len(report.warnings)} warning(s), shown by that command")
    if hf_auto:
        notes.append('plain `shardkit check` refuses its "auto" values, which only the HF Trainer/Accelerate fill in')
    if world_size is not None:
        notes.append(f"train_batch_size is fixed for {world_size} rank(s): regenerate with --world-size N for another count")
    if getattr(args, "pin_memory", None) is None and _has_offload(args):
        has = "has an" if accelerator else "has no"
        origin = "as --accelerator/--no-accelerator says" if getattr(args, "accelerator", None) is not None else "judged from this machine"
        other = "--no-accelerator or --no-pin-memory for a CPU run" if accelerator else "--accelerator or --pin-memory for a GPU run"
        notes.append(f"pin_memory {str(accelerator).lower()} because the run {has} accelerator ({origin}; pass {other})")
    return f"passes `{command}`" + (f" ({'; '.join(notes)})" if notes else "")


def check_command(args: argparse.Namespace, accelerator: bool, world_size: int | None, hf_auto: bool) -> str:
    """The `shardkit check` command line the written file is judged by (on this machine)."""
    import shlex

    flags = [args.output]
    if world_size is not None:
        flags += ["--world-size", str(world_size)]
    if hf_auto:
        flags.append("--hf-auto")
    flags.append("--accelerator" if accelerator else "--no-accelerator")
    return "shardkit check " + shlex.join(flags)


def _has_offload(args: argparse.Namespace) -> bool:
    return "none" != getattr(args, "offload_optimizer", "none") or "none" != getattr(args, "offload_param", "none")


def _write(cfg: dict[str, Any], path: str, yaml: bool) -> None:
    if yaml:
        import yaml as _yaml

        text = _yaml.safe_dump(cfg, sort_keys=False)
    else:
        import json

        text = json.dumps(cfg, indent=2) + "\n"
    if path == "-":
        sys.stdout.write(text)
        return
    from pathlib import Path

    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(p)
