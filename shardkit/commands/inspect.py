"""`shardkit inspect SRC [--json]`: what a checkpoint is and which shardkit commands take it today."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import TYPE_CHECKING

from shardkit.commands._parser import add_command, add_json

if TYPE_CHECKING:
    from shardkit.checkpoint.layout.description import CheckpointDescription
    from shardkit.checkpoint.layout.support import Verdict


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = add_command(
        sub,
        "inspect",
        help="say what a checkpoint is (format, stage, world size, dtypes, parameters, optimizer, step, size) and "
             "which shardkit commands take it",
        example="shardkit inspect output/checkpoint-500",
        description=(
            "Describe a checkpoint from its small files only (model states, .metadata, pickled structures, "
            "safetensors headers; never tensor bytes, so time and memory do not grow with the checkpoint): "
            "DeepSpeed ZeRO-0..3 (precision, offload), universal checkpoints, FSDP2/DCP, the FSDP files "
            "Accelerate and the Trainer write, Hugging Face folders, and a Trainer checkpoint-N or output_dir "
            "wrapping any of them. Lists each checkpoint command (reshard, convert --to zero1|zero2|zero3|fsdp2|"
            "universal, consolidate, export, verify) with what it would do or why it refuses, and the markers "
            "nothing converts correctly (AutoEP, MoE expert files, tensor/pipeline parallel ranks, NVMe-swapped "
            "optimizer state). A shardkit manifest "
            "is checked for sizes (`shardkit verify` checks the digests). Exit 0: described; 1: not a "
            "checkpoint shardkit knows."
        ),
    )
    p.add_argument("checkpoint", metavar="SRC",
                   help="checkpoint folder, tag folder, rank file, Trainer checkpoint-N or output_dir")
    add_json(p)
    p.set_defaults(func=inspect_command)


def _count(n: int | None) -> str:
    return "?" if n is None else f"{n:,}"


def _precision(desc: "CheckpointDescription") -> str:
    """The training precision, or why the files do not say it (float32 parameters: FSDP2's bf16
    MixedPrecisionPolicy keeps and saves them as an fp32 run does)."""
    if desc.precision is not None:
        return desc.precision
    weights = desc.dtypes.get("weights")
    if weights == "float32":
        return "not recorded (parameters saved as float32, as both an fp32 run and a bf16/fp16 mixed-precision run save them)"
    return "?" if weights is None else f"not recorded (parameters saved as {weights})"


def _lines(desc: "CheckpointDescription", verdicts: "list[Verdict]") -> list[str]:
    rows = [
        ("checkpoint", desc.folder),
        ("layout", desc.layout),
        ("world size", "any (loads at any world size)" if desc.world_size is None else str(desc.world_size)),
        ("precision", _precision(desc)),
        ("dtypes", ", ".join(f"{k} {v}" for k, v in desc.dtypes.items()) or "?"),
        ("parameters", f"{_count(desc.parameters)} tensors, {_count(desc.elements)} elements"),
        ("optimizer", f"{desc.optimizer or 'none saved'}"
                      + (f" (state: {', '.join(desc.optimizer_state_keys)})" if desc.optimizer_state_keys else "")),
        ("step", str(desc.step) if desc.step is not None else "?" if desc.optimizer else "not recorded (no optimizer state)"),
        ("size", f"{desc.size_bytes / 2**20:,.1f} MiB in {desc.files} files"),
        ("manifest", desc.manifest),
    ]
    if desc.offload:
        rows.insert(4, ("offload", f"optimizer on {desc.offload}"))
    width = max(len(k) for k, _ in rows)
    out = [f"{k:<{width}}  {v}" for k, v in rows]
    for r in desc.refusals:
        out.append(f"refused: {r.message()}")
    if not any(v.applies for v in verdicts) and len({v.why for v in verdicts}) == 1:
        out.append(f"commands: none takes it today: {verdicts[0].why}")
    else:
        out.append("commands:")
        marked = "; and ".join(r.message() for r in desc.refusals)
        for v in verdicts:  # a marker's refusal is printed once, above; --json carries it in every cell
            why = "refused for the marker above" if desc.refusals and v.why == marked else v.why
            out.append(f"  {'yes' if v.applies else 'no ':<3}  {v.command:<22} {why}")
    out.extend(f"note: {n}" for n in desc.notes)
    return out


def _fill(desc: "CheckpointDescription", kind: str) -> None:
    """What the reader of ``desc`` says beyond its small files (a reader that cannot read it: a note)."""
    from pathlib import Path

    from shardkit.checkpoint.readers.registry import read_checkpoint
    from shardkit.core.errors import CheckpointError

    try:
        desc.fill_from(read_checkpoint(kind, Path(desc.folder)))
    except CheckpointError as exc:
        desc.notes.append(f"parameters, dtypes and step unread: {exc}")


def inspect_command(args: argparse.Namespace) -> int:
    from shardkit.checkpoint.layout.detect import describe_checkpoint
    from shardkit.checkpoint.layout.support import verdicts
    from shardkit.commands._parser import Stopwatch, emit_json
    from shardkit.storage.links import links_leaving_refusal

    clock = Stopwatch()
    desc = describe_checkpoint(args.checkpoint)
    if desc.reader_kind is not None:
        _fill(desc, desc.reader_kind)
    found = verdicts(desc)
    leaving = links_leaving_refusal(desc.folder, "read")
    if leaving is not None:  # every command's reader refuses the folder with these words (storage.links)
        found = [replace(v, applies=False, why=leaving, guarded=False) for v in found]
    if args.json or args.json_file:
        emit_json(args, {"command": "inspect", "ok": True, **desc.to_dict(),
                         "commands": [{"command": v.command, "applies": v.applies, "why": v.why, "guarded": v.guarded}
                                      for v in found],
                         "seconds": clock.seconds})
    if not args.json:
        print("\n".join(_lines(desc, found)))
    return 0
