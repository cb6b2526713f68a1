"""`shardkit export SRC -o DIR`: any checkpoint a reader takes (DeepSpeed, FSDP, Accelerate, Trainer) as a
from_pretrained folder."""

from __future__ import annotations

import argparse
import sys

from shardkit.commands._parser import add_command, add_dry_run, add_json, add_no_verify, add_quiet


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "export",
        help="write a ZeRO-1/2/3, universal, FSDP2/DCP, Trainer/Accelerate FSDP or Accelerate save_state checkpoint "
             "as a folder transformers from_pretrained loads",
        example="shardkit export checkpoints/ -o hf_model/ --model-config base_model/ --dtype bf16",
        description=(
            "Write sharded safetensors (model-0000k-of-0000n.safetensors + model.safetensors.index.json, or one "
            "model.safetensors), config.json, generation_config.json and tokenizer files: a folder "
            "AutoModelForCausalLM.from_pretrained(DIR) loads. SRC is a DeepSpeed ZeRO-1/2/3 or universal checkpoint "
            "(any world size, offload or not), an FSDP2/DCP checkpoint, the FSDP files the Trainer and Accelerate "
            "save, a one-process Accelerate save_state folder (with --model-config), or a Hugging Face Trainer "
            "checkpoint-N / output_dir holding one. Streaming: every piece is copied (or cast, chunk by chunk) from the rank files to its place in "
            "the output, so memory stays flat whatever the model size. Names, tied weights and shard split follow "
            "save_pretrained; a checkpoint that does not match the config (missing or extra tensors, other shapes) is "
            "refused. A PEFT/LoRA checkpoint becomes an adapter folder (adapter_model.safetensors + "
            "adapter_config.json). DIR appears complete or not at all, with a shardkit manifest; an existing DIR is "
            "replaced only when shardkit exported it and --force is given."
        ),
    )
    p.add_argument("checkpoint", metavar="SRC",
                   help="checkpoint folder (root or tag) of any layout above, or a Trainer checkpoint-N / output_dir")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="the model folder to write (new or empty)")
    p.add_argument("--model-config", default=None, metavar="DIR",
                   help="folder holding the model's config.json (and tokenizer files) when SRC has none beside it")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="dtype of floating-point tensors (default: the config's dtype/torch_dtype, else fp32)")
    p.add_argument("--max-shard-size", default="50GB", metavar="SIZE",
                   help="largest weight file, as save_pretrained's max_shard_size: 5GB, 500MB, 50KB (default: 50GB)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="shard files written at once, one thread each (default: one per shard, at most "
                        "max(cores, 8))")
    p.add_argument("--force", action="store_true", help="replace DIR when it holds an earlier shardkit export")
    add_no_verify(p)
    add_dry_run(p)
    add_json(p)
    add_quiet(p)
    p.set_defaults(func=export_command, sigterm_cleans_up=True)


def export_command(args: argparse.Namespace) -> int:
    from shardkit.checkpoint.ops.export.export_hf import export_hf_folder
    from shardkit.commands._parser import Stopwatch, emit_json
    from shardkit.commands._plan import byte_progress, result_base
    from shardkit.storage.pipeline import CHECKED_LEVELS

    if args.dry_run:
        return _dry_run(args)
    clock = Stopwatch()
    with byte_progress(args, "export"):
        result = export_hf_folder(
            args.checkpoint, args.output, dtype=args.dtype, max_shard_size=args.max_shard_size,
            model_config=args.model_config, workers=args.workers, force=args.force, verify=not args.no_verify,
            warn=lambda m: print(f"shardkit export: warning: {m}", file=sys.stderr),
        )
    if args.json or args.json_file:
        emit_json(args, result_base(
            "export", args.checkpoint, clock.seconds, rank=0, processes=1, launcher="single process",
            wrote={"path": str(result.output), "files": list(result.files), "bytes": result.bytes,
                   "tensors": result.tensors, "parameters": result.parameters, "dtype": result.dtype,
                   "model_class": result.model_class, "copied": list(result.copied)},
            source_kind=result.source_kind, checked=CHECKED_LEVELS[result.verified], notes=list(result.notes)))
    for note in result.notes:
        print(f"note: {note}")
    files = result.files[0] if len(result.files) == 1 else f"{len(result.files)} shards + model.safetensors.index.json"
    print(
        f"wrote {result.output}: {result.model_class}, {result.tensors} tensors, {result.parameters:,} parameters, "
        f"{result.bytes / 2**20:,.1f} MiB ({result.dtype}) in {files}; copied {', '.join(result.copied)}; source "
        f"({result.source_kind}) checked before reading: {CHECKED_LEVELS[result.verified]}"
    )
    return 0


def _dry_run(args: argparse.Namespace) -> int:
    """--dry-run: what would be read, and the folder and staging place the real run would use."""
    from pathlib import Path

    from shardkit.commands._parser import emit_json
    from shardkit.commands._plan import plan_of, print_plan, run_checks

    run_checks(args, export_command)  # the run's own checks, stopped before its first write
    out = Path(args.output)
    staging = f"a hidden .shardkit-tmp-{out.name}-<pid@host>-<nonce> folder beside {out}"
    plan = plan_of("export", args.checkpoint, out, staging, args.workers, dtype=args.dtype,
                   max_shard_size=args.max_shard_size)
    print_plan(plan)
    if args.json or args.json_file:
        emit_json(args, plan)
    return 0
