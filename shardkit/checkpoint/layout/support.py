"""Which checkpoint commands take each layout, in one table: ``TABLE`` has a row per layout and a cell
per command in ``COMMANDS`` saying what the command does with it, or why it refuses and where to go.
``verdicts`` reads the row of a described checkpoint for ``shardkit inspect``; ``refuse_unsupported``
raises, at each operation's entry point before anything is read, for the cells marked ``guarded``.

Rules the table keeps (``tests/test_inspect_table.py`` runs every command on a real save of every
layout and checks each cell against what the command does):

- A refusal marker (AutoEP, native MoE experts, tensor/pipeline parallel ranks, NVMe-swapped
  optimizer state) refuses every command that reads tensors, first, naming the marker; ``verify``
  still checks the files (its structural check names the marker as a warning).
- A refusal's first sentence is the command's own words: either the command's own check says it
  (``guarded=False``: "is a DeepSpeed ZeRO-3 checkpoint already", FSDP's per-rank refusals), or
  ``refuse_unsupported`` raises with it (``guarded=True``: markers, a universal or DCP checkpoint
  given to reshard, a from_pretrained folder).
- ``verify`` is decided by the files, not the row alone: with a shardkit manifest it checks sizes
  and digests; without one, the row's ``plain_verify`` cell (a structural check, or a refusal).

Adding a layout: one ``_key`` branch and one row.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardkit.checkpoint.hf_trainer.folder import CHECKPOINT_DIR, TRAINER_STATE
from shardkit.checkpoint.hf_trainer.fsdp_files import SHARDED_PER_RANK, fsdp_layout, read_by_shardkit, unread_why
from shardkit.checkpoint.layout.deepspeed_files import describe_deepspeed, is_deepspeed_folder
from shardkit.checkpoint.layout.description import CheckpointDescription
from shardkit.checkpoint.layout.detect import locate_checkpoint, read_folder
from shardkit.checkpoint.layout.torch_files import HF_WEIGHTS, METADATA_NAME, describe_dcp, is_accelerate_state
from shardkit.core.errors import CheckpointError

#: The checkpoint commands, as ``inspect`` lists them.
COMMANDS = ("reshard", "convert --to zero1", "convert --to zero2", "convert --to zero3", "convert --to fsdp2",
            "convert --to universal", "consolidate", "export", "verify")


@dataclass(frozen=True)
class Verdict:
    """Whether one command takes a checkpoint today."""

    command: str
    applies: bool
    why: str
    """What it would do, or why it refuses and where to go instead."""
    guarded: bool = False
    """A refusal ``refuse_unsupported`` raises (the command's own check would say less, or nothing)."""


@dataclass(frozen=True)
class Cell:
    """One command on one layout; ``why`` may name {path}, {folder}, {world}, {stage} and {unread}."""

    applies: bool
    why: str
    guarded: bool = False


def _yes(why: str) -> Cell:
    return Cell(True, why)


def _own(why: str) -> Cell:
    """Refused by the command's own check, whose message begins with ``why``'s first sentence."""
    return Cell(False, why)


def _guard(why: str) -> Cell:
    """Refused by ``refuse_unsupported`` with ``why``, before anything is read."""
    return Cell(False, why, guarded=True)


_RESUMED = "loaded by DeepSpeed's plain load_checkpoint at that world size, masters and Adam state"
_TO_ZERO = {f"convert --to zero{n}": _yes(f"per-rank ZeRO-{n} files for --world-size N, {_RESUMED}") for n in (1, 2, 3)}
_TO_FSDP2 = _yes("a DCP checkpoint FSDP2 resumes at any world size (load_fsdp_checkpoint), masters and Adam state")
_TO_UNIVERSAL = _yes("a DeepSpeed universal checkpoint, resumed at any world size with checkpoint.load_universal: true")
_MASTERS = _yes("the fp32 masters (and frozen parameters, buffers) as one safetensors file")
_WEIGHTS = _yes("the weights as one safetensors file")
_EXPORT = _yes("a from_pretrained folder (the model's config.json: --model-config DIR, or the one beside it)")
_STRUCTURE = _yes("a structural check, there being no manifest (every rank file present, byte ranges inside their "
                  "files, ranks agreeing, every tensor covered; no digests to compare)")
_MANIFEST = _yes("checks every file's size and content digest against its shardkit manifest")

# The first sentences of reshard's refusals of a DCP folder and of accelerate's FSDP files outside a Trainer
# checkpoint-N: each refusal below begins with one, whether the save holds optimizer state or not.
_DCP_NO_RESHARD = "a DCP checkpoint needs no reshard: FSDP2 loads it at any world size (DCP reshards while loading)"
_FSDP_NO_RESHARD = "accelerate's FSDP files need no reshard: shardkit reshard rewrites DeepSpeed rank files"
_TO_DEEPSPEED = "For DeepSpeed: convert --to zero3 (or zero2/zero1) --world-size N"
_ZERO12_ALREADY = ("is a DeepSpeed ZeRO-1/2 checkpoint already; --to zero{n} converts other formats. For another "
                   "world size: shardkit reshard {path} --world-size N -o OUT")
_FSDP_RESHARD = ("The Trainer resumes it at any world size as it is{how}, so there is nothing to reshard. "
                 f"{_TO_DEEPSPEED}; for FSDP2: convert --to fsdp2")
_HF = ("a from_pretrained folder holds full weights already and no optimizer state: from_pretrained loads it as it "
       "is, so there is nothing to {what}")

#: The cells of every layout a reader takes with its optimizer state; a row overrides what differs.
_READ = {**_TO_ZERO, "convert --to fsdp2": _TO_FSDP2, "convert --to universal": _TO_UNIVERSAL, "export": _EXPORT,
         "plain_verify": _STRUCTURE}

#: layout -> command -> what it does or why not. ``plain_verify`` is verify's cell without a manifest.
TABLE: dict[str, dict[str, Cell]] = {
    "zero3": {
        **_READ, "consolidate": _MASTERS,
        "reshard": _yes("new per-rank ZeRO-3 files for --world-size M, loaded by DeepSpeed's plain load_checkpoint"),
        "convert --to zero3": _own("is a DeepSpeed ZeRO-3 checkpoint already; --to zero3 converts other formats. "
                                   "For another world size: shardkit reshard {path} --world-size N -o OUT"),
    },
    "zero12": {
        **_READ, "consolidate": _MASTERS,
        "reshard": _yes("new per-rank ZeRO-{stage} files for --world-size M, loaded by DeepSpeed's plain "
                        "load_checkpoint"),
        "convert --to zero1": _own(_ZERO12_ALREADY.replace("{n}", "1")),
        "convert --to zero2": _own(_ZERO12_ALREADY.replace("{n}", "2")),
    },
    "zero0": {
        **{c: _guard("a DeepSpeed ZeRO-0 checkpoint (no optimizer partition files): shardkit reads ZeRO-1/2/3 "
                     "partitions. Load it with DeepSpeed and save with ZeRO-1, 2 or 3") for c in COMMANDS if c != "verify"},
    },
    "universal": {
        **_READ, "consolidate": _MASTERS,
        "reshard": _guard("a DeepSpeed universal checkpoint needs no reshard: DeepSpeed's load_checkpoint resumes it "
                          "at any world size with checkpoint.load_universal: true. For per-rank files: convert --to "
                          "zero3 (or zero2/zero1) --world-size N"),
        "convert --to universal": _own("is a DeepSpeed universal checkpoint already; DeepSpeed resumes it at any "
                                       "world size as it is (checkpoint.load_universal: true), so there is nothing "
                                       "to convert"),
    },
    "dcp": {
        **_READ, "consolidate": _WEIGHTS,
        "reshard": _guard(f"{_DCP_NO_RESHARD}. {_TO_DEEPSPEED}"),
        "convert --to fsdp2": _own("is an FSDP2/DCP checkpoint already; FSDP2 loads it at any world size as it is "
                                   "(load_fsdp_checkpoint), so there is nothing to convert"),
    },
    # accelerate's FSDP files (the Trainer's checkpoint-N), FSDP1 or FSDP2 (hf_trainer.fsdp_files)
    "fsdp-sharded": {**_READ, "consolidate": _WEIGHTS,
                     "reshard": _own(_FSDP_RESHARD.replace("{how}", " (DCP reshards while loading)"))},
    "fsdp-full": {**_READ, "consolidate": _WEIGHTS, "reshard": _own(_FSDP_RESHARD.replace("{how}", ""))},
    "fsdp-per-rank": {  # use_dcp=False: FSDP1's ShardedTensors (and FSDP2's DTensors where read_by_shardkit reads them)
        **_READ, "consolidate": _WEIGHTS,
        "reshard": _own("each rank's own shard in its own file, which only {world} ranks can load (accelerate does "
                        "not repartition it). convert --to fsdp2 writes DCP folders that load at any world size"),
    },
    # LOCAL_STATE_DICT, per-rank files of a kind no reader reads: unread_why says what they lack (or names the file
    # and the global the weights-only unpickler refused). Guarded: outside a Trainer checkpoint-N (whose own check
    # says the same) reshard's own check would only say it is not DeepSpeed
    "fsdp-unread": {
        **{c: _guard("{unread}") for c in COMMANDS if c != "verify"}, "plain_verify": _own("{unread}"),
    },
    "hf-model": {
        "reshard": _guard(_HF.replace("{what}", "reshard")),
        **{c: _guard(_HF.replace("{what}", "convert")) for c in COMMANDS if c.startswith("convert")},
        "consolidate": _guard(_HF.replace("{what}", "consolidate")),
        "export": _guard(_HF.replace("{what}", "export")),
        "plain_verify": _own("no completed checkpoint under {path}. A from_pretrained folder holds no training state "
                             "to verify"),
    },
    # Accelerator.save_state in one process without FSDP or DeepSpeed (readers.accelerate_state: the weights)
    "accelerate-state": {
        "reshard": _guard("an Accelerate save_state folder needs no reshard: one process saved the full weights and "
                          "the whole optimizer state, which Accelerator.load_state resumes at any number of processes "
                          "as it is"),
        **{c: _guard("shardkit's accelerate-state reader describes this checkpoint's weights only, not its optimizer "
                     "state: optimizer.bin is torch's optimizer.state_dict(), keyed by parameter position, an order "
                     "the folder does not record. For the weights alone: shardkit export or consolidate")
           for c in COMMANDS if c.startswith("convert")},
        "consolidate": _WEIGHTS,
        "export": _yes("a from_pretrained folder; the save_state folder holds no config.json, so from_pretrained "
                       "cannot load it as it is: pass --model-config DIR (the model's config.json)"),
        "plain_verify": _STRUCTURE,
    },
    # a Trainer checkpoint-N saved without DeepSpeed or sharded FSDP (DDP, one process, save_only_model): the
    # Trainer's own checks say what it holds
    "trainer-weights": {
        **{c: _own("holds full weights already. from_pretrained loads it as it is; there is no sharded training "
                   "state to convert") for c in COMMANDS if c != "verify"},
        **{c: _own("a Hugging Face Trainer checkpoint without a DeepSpeed checkpoint inside (no 'latest', no "
                   "global_step*/ folder). It holds the full weights, which from_pretrained loads as they are")
           for c in ("reshard", "convert --to fsdp2", "consolidate", "plain_verify")},
    },
}


def _key(desc: CheckpointDescription) -> str:
    """The ``TABLE`` row of a described checkpoint."""
    if desc.format == "deepspeed":
        return "zero3" if desc.stage == 3 else "zero12" if desc.stage in (1, 2) else "zero0"
    if desc.format == "deepspeed-universal":
        return "universal"
    if desc.format == "dcp":
        return "dcp"
    if desc.format == "accelerate-state":
        return "accelerate-state"
    if desc.format == "accelerate-fsdp":
        layout = fsdp_layout(Path(desc.folder))
        if layout is None or not read_by_shardkit(layout, Path(desc.folder)):
            return "fsdp-unread"
        return {"SHARDED_STATE_DICT": "fsdp-sharded", "FULL_STATE_DICT": "fsdp-full",
                SHARDED_PER_RANK: "fsdp-per-rank"}.get(layout.state_dict_type, "fsdp-unread")
    return "hf-model" if desc.trainer_folder is None else "trainer-weights"


def _facts(desc: CheckpointDescription) -> dict[str, str]:
    layout = fsdp_layout(Path(desc.folder)) if desc.format == "accelerate-fsdp" else None
    return {"path": desc.path, "folder": desc.folder, "stage": str(desc.stage),
            "world": str(desc.world_size) if desc.world_size else "the same number of",
            "unread": unread_why(layout, Path(desc.folder)) if layout is not None else "no accelerate FSDP files found",
            "reader": desc.reader_kind or _READER.get(_key(desc), "")}


#: The registry kind each row's reader is (the weights-only refusals name it); per-rank files: ``reader_kind``.
_READER = {"fsdp-sharded": "fsdp1-sharded", "fsdp-full": "fsdp1-full", "dcp": "dcp"}
_WEIGHTS_ONLY = _own("shardkit's {reader} reader describes this checkpoint's weights only, not its optimizer state. "
                     "For the weights alone: shardkit export or consolidate")
_NO_OPTIMIZER = _own("It holds no optimizer state (TrainingArguments.save_only_model=True, or the save was "
                     "interrupted), so it can start a new run but not resume one")
_NOT_TRAINER = _guard(f"{_FSDP_NO_RESHARD}. {_TO_DEEPSPEED}; for FSDP2: convert --to fsdp2")
# weights alone: every convert refuses them (_WEIGHTS_ONLY), so reshard's refusal names what takes them instead
_FOR_WEIGHTS = ("It holds no optimizer state, so no convert takes it (convert writes training state to resume). For "
                "the weights alone: shardkit export or consolidate")
_RESHARD_WEIGHTS = {
    "dcp": _guard(f"{_DCP_NO_RESHARD}. {_FOR_WEIGHTS}"),
    "accelerate-fsdp": _guard(f"{_FSDP_NO_RESHARD}. {_FOR_WEIGHTS}"),
}


def _weights_only(desc: CheckpointDescription) -> bool:
    """Saved without optimizer state, as far as ``desc`` read: a DCP folder only once its ``.metadata``
    was read (``parameters`` set; ``_cheap_description`` leaves it unread for other commands)."""
    return desc.optimizer is None and (desc.format != "dcp" or desc.parameters is not None)


def _wrapped(desc: CheckpointDescription, command: str) -> Cell | None:
    """What the save around a layout changes in its row, or None: accelerate's FSDP files or a DCP folder
    saved without optimizer state (no convert target), accelerate's files outside a Trainer checkpoint-N
    (reshard's Trainer check does not see them)."""
    if desc.format not in ("accelerate-fsdp", "dcp") or _key(desc) == "fsdp-unread":
        return None
    already = desc.format == "dcp" and command == "convert --to fsdp2"  # the command says so first
    if desc.optimizer is None and command.startswith("convert --to ") and not already:
        return _WEIGHTS_ONLY
    if command == "reshard" and desc.trainer_folder is None and _weights_only(desc):
        return _RESHARD_WEIGHTS[desc.format]
    if desc.format == "accelerate-fsdp" and command == "reshard":
        return _NOT_TRAINER if desc.trainer_folder is None else _NO_OPTIMIZER if desc.optimizer is None else None
    return None


def verdicts(desc: CheckpointDescription) -> list[Verdict]:
    """What each command in ``COMMANDS`` does with ``desc`` today, or why it refuses it."""
    row, facts = TABLE[_key(desc)], _facts(desc)
    blocked = "; and ".join(r.message() for r in desc.refusals)
    out = []
    for command in COMMANDS:
        if command == "verify":
            has_manifest = desc.manifest != "absent"
            cell = _MANIFEST if has_manifest else row.get("plain_verify", _own("no shardkit manifest, and no "
                                                                               "structural check of this layout"))
        elif blocked:
            cell = _guard(blocked)
        else:
            cell = _wrapped(desc, command) or row[command]
        why = cell.why
        for name, value in facts.items():
            why = why.replace("{" + name + "}", value)
        # refuse_unsupported leaves accelerate's files inside a Trainer checkpoint-N to the Trainer's own check
        guarded = cell.guarded and not (desc.format == "accelerate-fsdp" and desc.trainer_folder is not None)
        out.append(Verdict(command, cell.applies, why, guarded))
    return out


def _cheap_description(folder: Path, given: str, command: str) -> CheckpointDescription | None:
    """What ``refuse_unsupported`` needs of ``folder``, reading names and, for DeepSpeed, rank 0's small
    pickles only (a DCP ``.metadata``, megabytes at scale, is read only for reshard, which refuses every
    DCP folder and names what takes it: convert with optimizer state, export without); None for the layouts
    whose refusals are the commands' own (accelerate's FSDP files) or that this module does not know."""
    if is_deepspeed_folder(folder):
        return read_folder(folder, given, describe_deepspeed)
    if (folder / METADATA_NAME).is_file():
        if command == "reshard":
            try:
                return describe_dcp(folder, given)
            except CheckpointError:
                pass  # a .metadata that does not read: reshard refuses the DCP folder all the same
        return CheckpointDescription(path=given, folder=str(folder), format="dcp", layout="DCP")
    fsdp = fsdp_layout(folder)
    if fsdp is not None and not _trainer(folder):  # reshard's Trainer check names the Trainer's own FSDP folders
        return CheckpointDescription(path=given, folder=str(folder), format="accelerate-fsdp", layout="FSDP",
                                     state_dict_type=fsdp.state_dict_type, optimizer="saved" if fsdp.optimizer else None)
    if fsdp is None and is_accelerate_state(folder) and not _trainer(folder):
        return CheckpointDescription(path=given, folder=str(folder), format="accelerate-state", layout="Accelerate")
    if fsdp is None and any((folder / n).is_file() for n in HF_WEIGHTS) and not _trainer(folder):
        return CheckpointDescription(path=given, folder=str(folder), format="hf-model", layout="Hugging Face")
    return None  # a Trainer checkpoint-N's own refusals say what the Trainer saved and why it does not resume


def _trainer(folder: Path) -> bool:
    return (folder / TRAINER_STATE).is_file() or CHECKPOINT_DIR.match(folder.name) is not None


def refuse_unsupported(path: str | Path, command: str) -> None:
    """Raise CheckpointError when ``path`` is a layout whose ``command`` cell is a guarded refusal (see
    the module doc), naming the marker or the layout and where to go; nothing has been written when it
    raises. A path it cannot describe is not refused here: the command's own reader names the problem.
    """
    try:
        desc = _cheap_description(locate_checkpoint(path).folder, str(path), command)
    except (CheckpointError, OSError):
        return  # not a layout this module knows, or unreadable: the command's own reader names the problem
    if desc is None:
        return
    found = next((v for v in verdicts(desc) if v.command == command), None)
    if found is not None and not found.applies and found.guarded:
        raise CheckpointError(f"shardkit {command} refuses {path}: {found.why}. Nothing was written")
