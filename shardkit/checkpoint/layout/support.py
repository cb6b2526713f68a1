"""The one place that decides which checkpoint layouts each shardkit command takes today, and why
the others are refused: ``verdicts`` for ``shardkit inspect``, ``refuse_unsupported`` for the
commands themselves, called by each operation's entry point before anything is read or written.

``refuse_unsupported`` raises for the layouts no command converts correctly (``Refusal`` markers:
AutoEP, native MoE experts, tensor/pipeline parallel ranks, NVMe-swapped optimizer state), for
ZeRO-0/1/2 (reshard, convert --to fsdp2, consolidate and export take ZeRO-1/2) and for universal checkpoints. The other layouts a command does not take (an FSDP
FULL_STATE_DICT folder given to ``export``, a DCP folder given to ``reshard``) keep the command's
own refusal, which already says what the folder is and what to do. A path this module cannot
describe is left to the command, whose reader names the problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardkit.checkpoint.hf_trainer.fsdp_files import SHARDED_PER_RANK, fsdp_layout, read_by_shardkit, unread_why
from shardkit.checkpoint.layout.deepspeed_files import describe_deepspeed, is_deepspeed_folder
from shardkit.checkpoint.layout.description import CheckpointDescription
from shardkit.checkpoint.layout.detect import locate_checkpoint, read_folder
from shardkit.core.errors import CheckpointError

#: The checkpoint commands, as ``inspect`` lists them.
COMMANDS = ("reshard", "convert --to fsdp2", "convert --to zero3", "consolidate", "export")


@dataclass(frozen=True)
class Verdict:
    """Whether one command takes a checkpoint today."""

    command: str
    applies: bool
    why: str
    """What it would do, or why it refuses and where to go instead."""


def _zero12_why(desc: CheckpointDescription) -> str:
    root = Path(desc.folder).parent
    return (f"a DeepSpeed ZeRO-{desc.stage} checkpoint ({desc.stage_source}): shardkit reshard, convert --to fsdp2, "
            "consolidate and export take it. For "
            f"the full weights, run the zero_to_fp32.py DeepSpeed saved beside it (python {root}/zero_to_fp32.py "
            f"{root} OUT_DIR --safe_serialization); for a universal checkpoint, DeepSpeed's ds_to_universal "
            f"(python -m deepspeed.checkpoint.ds_to_universal --input_folder {desc.folder} "
            "--output_folder UNIVERSAL --inject_missing_state) and checkpoint.load_universal: true")


#: What each command that takes a ZeRO-1/2 checkpoint (without a refusal marker) does with it.
_ZERO12_TAKEN = {
    "reshard": "new per-rank ZeRO-1/2 files for another world size, loaded by DeepSpeed's plain load_checkpoint",
    "convert --to fsdp2": "a DCP checkpoint FSDP2 resumes at any world size, masters and Adam state",
    "convert --to zero3": "per-rank ZeRO-3 files for --world-size N, loaded by DeepSpeed's plain load_checkpoint",
    # not refused here so that a marker is named first; the command itself then sends ZeRO-1/2 to reshard
    "convert --to zero2": "none: it is ZeRO-1/2 already, use reshard for another world size",
    "convert --to zero1": "none: it is ZeRO-1/2 already, use reshard for another world size",
    "convert --to universal": "a DeepSpeed universal checkpoint, resumed at any world size with load_universal",
    "consolidate": "the fp32 masters (and frozen parameters, buffers) as one safetensors file",
    "export": "a from_pretrained folder (needs the model's config.json)",
}


def _reshard_takes(desc: CheckpointDescription, command: str) -> bool:
    """ZeRO-1/2 without a refusal marker: reshard writes its rank files for another world size
    (``checkpoint.zero12``), consolidate and export read it (``readers.zero12``)."""
    return command in _ZERO12_TAKEN and desc.format == "deepspeed" and desc.stage in (1, 2) and not desc.refusals


#: What each command that takes a universal checkpoint (without a refusal marker) does with it
#: (``readers.universal``); reshard refuses it with ``_universal_why``.
_UNIVERSAL_TAKEN = {
    "convert --to fsdp2": "a DCP checkpoint FSDP2 resumes at any world size, masters and Adam state",
    "convert --to zero3": "per-rank ZeRO-3 files for --world-size N, loaded by DeepSpeed's plain load_checkpoint",
    "convert --to zero2": "per-rank ZeRO-2 files for --world-size N, loaded by DeepSpeed's plain load_checkpoint",
    "convert --to zero1": "per-rank ZeRO-1 files for --world-size N, loaded by DeepSpeed's plain load_checkpoint",
    "convert --to universal": "none: it is universal already (the command says so)",  # exit 2, as for DCP --to fsdp2
    "consolidate": "the fp32 masters (and frozen parameters, buffers) as one safetensors file",
    "export": "a from_pretrained folder (needs the model's config.json)",
}


def _universal_why(desc: CheckpointDescription) -> str:
    return ("a DeepSpeed universal checkpoint (ds_to_universal output): shardkit export, consolidate and convert --to "
            "fsdp2 read it; it needs no reshard (DeepSpeed resumes it at any world size with "
            "checkpoint.load_universal: true); convert --to zero3 writes ZeRO-3 files from it")


def _taken(desc: CheckpointDescription, command: str) -> str | None:
    """What ``command`` does with a layout ``blocking_reason`` refuses to the other commands (ZeRO-1/2,
    universal), or None when it refuses it too."""
    if _reshard_takes(desc, command):
        return _ZERO12_TAKEN[command]
    if desc.format == "deepspeed-universal" and not desc.refusals:
        return _UNIVERSAL_TAKEN.get(command)
    return None


def blocking_reason(desc: CheckpointDescription) -> str | None:
    """Why no checkpoint command takes ``desc`` at all (a marker, ZeRO-0/1/2, universal), or None."""
    if desc.refusals:
        return "; and ".join(r.message() for r in desc.refusals)
    if desc.format == "deepspeed" and desc.stage != 3:
        return _zero12_why(desc)
    if desc.format == "deepspeed-universal":
        return _universal_why(desc)
    return None


def _per_format(desc: CheckpointDescription) -> dict[str, tuple[bool, str]]:
    if desc.format == "deepspeed":  # ZeRO-3 (the others are blocked)
        return {
            "reshard": (True, "new per-rank files for another world size, loaded by DeepSpeed's plain load_checkpoint"),
            "convert --to fsdp2": (True, "a DCP checkpoint FSDP2 resumes at any world size, masters and Adam state"),
            "convert --to zero3": (False, "it is ZeRO-3 already: use reshard for another world size"),
            "consolidate": (True, "the fp32 masters as one safetensors file"),
            "export": (True, "a from_pretrained folder (needs the model's config.json)"),
        }
    if desc.format == "dcp":
        return {
            "reshard": (False, "DCP loads at any world size: there is nothing to reshard"),
            "convert --to fsdp2": (False, "it is DCP already"),
            "convert --to zero3": (True, "per-rank ZeRO-3 files for --world-size N (shardkit's FSDP2 saves)"),
            "consolidate": (True, "the weights as one safetensors file (the parameters as FSDP2 saved them)"),
            "export": (True, "a from_pretrained folder (needs the model's config.json)"),
        }
    if desc.format == "accelerate-fsdp":  # readers.fsdp1 reads SHARDED (DCP) and FULL; per-rank files are refused
        if desc.state_dict_type in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
            files = "pytorch_model_fsdp_0/ + optimizer_0/" if desc.state_dict_type == "SHARDED_STATE_DICT" else \
                "pytorch_model_fsdp.bin + optimizer.bin"
            return {"reshard": (False, "the Trainer resumes it at any world size as it is: there is nothing to reshard"),
                    "convert --to fsdp2": (True, f"a DCP checkpoint FSDP2 resumes at any world size, weights and Adam "
                                                 f"state from {files} (the optimizer keyed by parameter names)"),
                    "convert --to zero3": (True, f"per-rank ZeRO-3 files for --world-size N, weights and Adam state "
                                                 f"from {files}"),
                    "consolidate": (True, "the weights as one safetensors file"),
                    "export": (True, "a from_pretrained folder (needs the model's config.json)")}
        layout = fsdp_layout(Path(desc.folder))
        if layout is not None and layout.state_dict_type == SHARDED_PER_RANK and read_by_shardkit(layout, Path(desc.folder)):
            files = "pytorch_model_fsdp_0_rank*.bin + optimizer_0_rank*.bin (FSDP1 ShardedTensors, read without torch)"
            return {"reshard": (False, "shardkit does not rewrite per-rank FSDP files; convert --to fsdp2 writes a DCP "
                                       "checkpoint that loads at any world size"),
                    "convert --to fsdp2": (True, f"a DCP checkpoint FSDP2 resumes at any world size, from {files}"),
                    "convert --to zero3": (True, f"per-rank ZeRO-3 files for --world-size N, from {files}"),
                    "consolidate": (True, "the weights as one safetensors file"),
                    "export": (True, "a from_pretrained folder (needs the model's config.json)")}
        why = unread_why(layout) if layout is not None else "no accelerate FSDP files found"
        return {c: (False, why) for c in COMMANDS}
    why = "a from_pretrained folder already: load it as it is"
    return {c: (False, why) for c in COMMANDS}


def verdicts(desc: CheckpointDescription) -> list[Verdict]:
    """What each checkpoint command does with ``desc`` today, or why it refuses it."""
    blocked = blocking_reason(desc)
    if blocked is not None:
        return [Verdict(c, True, taken) if (taken := _taken(desc, c)) else Verdict(c, False, blocked) for c in COMMANDS]
    table = _per_format(desc)
    return [Verdict(c, *table[c]) for c in COMMANDS]


def refuse_unsupported(path: str | Path, command: str) -> None:
    """Raise CheckpointError when ``path`` is a layout ``command`` must not read (see the module doc),
    naming the marker, the file and where to go; nothing has been written when it raises.

    Reads small files only: the names of the folder, then rank 0's DeepSpeed model-states and
    optimizer pickles (no manifest, no DCP metadata). A path it cannot describe is not refused here:
    the command's own reader says what is wrong with it.
    """
    try:
        where = locate_checkpoint(path)
        # every layout refused here is DeepSpeed's: a DCP source's .metadata (megabytes at scale) is left unread
        if not is_deepspeed_folder(where.folder):
            return
        desc = read_folder(where.folder, str(path), describe_deepspeed)
    except (CheckpointError, OSError):
        return  # not a layout this module knows, or unreadable: the command's own reader names the problem
    blocked = blocking_reason(desc)
    if blocked is not None and _taken(desc, command) is None:
        raise CheckpointError(f"shardkit {command} refuses {path}: {blocked}. Nothing was written")
