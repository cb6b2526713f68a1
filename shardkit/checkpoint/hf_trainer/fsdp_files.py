"""What a Hugging Face Trainer ``checkpoint-N`` saved under FSDP holds, from its files and folders.

The Trainer (transformers 5.24, ``Trainer._save_optimizer_and_scheduler``) calls accelerate's
``save_fsdp_model`` and ``save_fsdp_optimizer`` (accelerate 1.15, ``utils/fsdp_utils.py``) with
``model_index``/``optimizer_index`` 0; ``save_model`` adds ``model.safetensors`` only under
``FULL_STATE_DICT``. What they write depends on ``fsdp_state_dict_type``, the same for FSDP1 and
FSDP2 (FSDP2 has no ``LOCAL_STATE_DICT``):

- ``SHARDED_STATE_DICT`` (``use_dcp=True``, the Trainer's and accelerate's default): two
  ``torch.distributed.checkpoint`` folders, ``pytorch_model_fsdp_0/`` (``{"model": ...}``) and
  ``optimizer_0/`` (``{"optimizer": ...}``), each ``.metadata`` plus one ``__R_0.distcp`` per rank.
  DCP reshards while loading: the Trainer resumes them at any world size.
- ``SHARDED_STATE_DICT`` with ``use_dcp=False`` (accelerate's own ``save_state`` option for very
  large jobs): ``pytorch_model_fsdp_0_rank{R}.bin`` and ``optimizer_0_rank{R}.bin``, one
  ``torch.save`` per rank, loadable only by the same number of ranks.
- ``FULL_STATE_DICT``: ``pytorch_model_fsdp.bin`` (the whole model, rank 0) and ``optimizer.bin``
  (the whole optimizer state, rank 0), plus ``model.safetensors``: resumable at any world size.
- ``LOCAL_STATE_DICT`` (FSDP1 only): ``pytorch_model_fsdp_rank{R}.bin`` (each rank's flat
  shard, the same number of ranks only) and the optimizer as ``optimizer_0/`` (DCP).

``tests/test_trainer_checkpoint.py`` writes each layout with accelerate's own save functions over
real FSDP1 and FSDP2 models on 2 gloo ranks and checks what is said about it. ``readers.fsdp1``
reads the SHARDED_STATE_DICT and FULL_STATE_DICT layouts and ``readers.fsdp1_bins`` the per-rank
SHARDED files of FSDP1 (ShardedTensors) and FSDP2 (DTensors) (``read_by_shardkit``) for export,
consolidate and convert; reshard refuses every layout here, and every command LOCAL_STATE_DICT
(``unread_why`` says why).
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from shardkit.core.errors import CheckpointError
from shardkit.core.files import open_regular
from shardkit.storage.torch_load import read_structure

#: ``accelerate.utils.constants.FSDP_MODEL_NAME`` and ``OPTIMIZER_NAME``.
FSDP_MODEL_NAME = "pytorch_model_fsdp"
OPTIMIZER_NAME = "optimizer"
_DCP_METADATA = ".metadata"
_MODEL_DCP = re.compile(rf"^{FSDP_MODEL_NAME}_(\d+)$")
_OPTIM_DCP = re.compile(rf"^{OPTIMIZER_NAME}_(\d+)$")
_MODEL_PER_RANK = re.compile(rf"^{FSDP_MODEL_NAME}_(\d+)_rank(\d+)\.bin$")
_OPTIM_PER_RANK = re.compile(rf"^{OPTIMIZER_NAME}_(\d+)_rank(\d+)\.bin$")
_MODEL_LOCAL = re.compile(rf"^{FSDP_MODEL_NAME}_rank(\d+)\.bin$")
_MODEL_FULL = re.compile(rf"^{FSDP_MODEL_NAME}(?:_\d+)?\.bin$")
_OPTIM_FULL = re.compile(rf"^{OPTIMIZER_NAME}(?:_\d+)?\.bin$")


@dataclass(frozen=True)
class FsdpLayout:
    """What one FSDP Trainer checkpoint holds."""

    state_dict_type: str
    """'SHARDED_STATE_DICT', 'SHARDED_STATE_DICT (use_dcp=False)', 'FULL_STATE_DICT' or 'LOCAL_STATE_DICT'."""
    model: list[str]
    """The model's files/folders, as named in the checkpoint (a folder with a trailing '/')."""
    optimizer: list[str]
    """The optimizer's files/folders (empty: saved without optimizer state)."""
    ranks: int | None
    """How many ranks wrote it, where the files tell (.distcp files, or rank files)."""


def _distcp_ranks(folder: Path) -> int | None:
    n = sum(1 for f in folder.iterdir() if f.name.endswith(".distcp"))
    return n or None


def fsdp_layout(folder: Path) -> FsdpLayout | None:
    """The FSDP layout of the Trainer checkpoint ``folder``, or None when it holds no FSDP file."""
    entries = sorted(folder.iterdir(), key=lambda e: e.name)
    dirs = {e.name: e for e in entries if e.is_dir()}
    files = [e.name for e in entries if e.is_file()]
    model_dcp = [n for n, d in dirs.items() if _MODEL_DCP.match(n) and (d / _DCP_METADATA).is_file()]
    optim_dcp = [n for n, d in dirs.items() if _OPTIM_DCP.match(n) and (d / _DCP_METADATA).is_file()]
    per_rank = [n for n in files if _MODEL_PER_RANK.match(n)]
    per_rank_optim = [n for n in files if _OPTIM_PER_RANK.match(n)]
    local = [n for n in files if _MODEL_LOCAL.match(n)]
    full = [n for n in files if _MODEL_FULL.match(n)]
    full_optim = [n for n in files if _OPTIM_FULL.match(n)]

    def shown(names: list[str]) -> list[str]:
        return [f"{n}/" if n in dirs else n for n in names]

    if model_dcp:
        return FsdpLayout("SHARDED_STATE_DICT", shown(model_dcp), shown(optim_dcp), _distcp_ranks(dirs[model_dcp[0]]))
    if per_rank:
        return FsdpLayout(SHARDED_PER_RANK, per_rank, per_rank_optim,
                          len({m.group(2) for n in per_rank if (m := _MODEL_PER_RANK.match(n))}))
    if local:
        return FsdpLayout("LOCAL_STATE_DICT", local, shown(optim_dcp), len(local))
    if full:
        return FsdpLayout("FULL_STATE_DICT", full, full_optim, None)
    return None


def read_by_shardkit(layout: FsdpLayout, folder: Path) -> bool:
    """True for the layouts ``readers.fsdp1`` and ``readers.fsdp1_bins`` read (export, consolidate, convert
    take them): SHARDED_STATE_DICT's DCP folders, FULL_STATE_DICT's ``pytorch_model_fsdp.bin``, and
    the per-rank SHARDED_STATE_DICT files (``use_dcp=False``) of FSDP1 and FSDP2."""
    return layout.state_dict_type == "SHARDED_STATE_DICT" or (
        layout.state_dict_type == "FULL_STATE_DICT" and (folder / f"{FSDP_MODEL_NAME}.bin").is_file()) or (
        layout.state_dict_type == SHARDED_PER_RANK and (holds_sharded_tensors(folder / layout.model[0])
                                                        or holds_dtensors(folder / layout.model[0])))


#: ``fsdp_layout``'s name for accelerate's ``use_dcp=False`` SHARDED_STATE_DICT files.
SHARDED_PER_RANK = "SHARDED_STATE_DICT (use_dcp=False)"
#: The pickle's GLOBAL opcode naming FSDP1's ShardedTensor (protocol 2, as torch.save writes it).
_SHARDED_TENSOR_GLOBAL = b"ctorch.distributed._shard.sharded_tensor.api\nShardedTensor\n"
#: FSDP2's DTensor (``torch.distributed.tensor`` since torch 2.5, ``torch.distributed._tensor...`` before).
_DTENSOR_GLOBAL = re.compile(rb"ctorch\.distributed\.[\w.]*\nDTensor\n")


def _rank_pickle(rank_file: Path) -> bytes | None:
    """The ``data.pkl`` of a per-rank ``torch.save`` file (no tensor byte is read); None when damaged."""
    try:
        with open_regular(rank_file) as fh, zipfile.ZipFile(fh) as z:
            pkl = next((n for n in z.namelist() if n.endswith("data.pkl")), None)
            return z.read(pkl) if pkl is not None else b""
    except (OSError, zipfile.BadZipFile, KeyError):
        return None


def holds_sharded_tensors(rank_file: Path) -> bool:
    """True when a per-rank ``torch.save`` file holds FSDP1 ShardedTensors (FSDP2's holds DTensors under
    the same name): its ``data.pkl`` names the class."""
    pkl = _rank_pickle(rank_file)
    return pkl is None or _SHARDED_TENSOR_GLOBAL in pkl  # damaged: the reader names the damage, not the layout


def holds_dtensors(rank_file: Path) -> bool:
    """True when a per-rank ``torch.save`` file names FSDP2's DTensor class (and not FSDP1's ShardedTensor)."""
    pkl = _rank_pickle(rank_file)
    return pkl is not None and _SHARDED_TENSOR_GLOBAL not in pkl and _DTENSOR_GLOBAL.search(pkl) is not None


def per_rank_kind(rank_file: Path) -> str:
    """The reader kind of a per-rank SHARDED_STATE_DICT save whose rank file is ``rank_file``."""
    return "fsdp2-sharded-bins" if holds_dtensors(rank_file) else "fsdp1-sharded-bins"


def fsdp_refusal(head: str, layout: FsdpLayout, folder: Path) -> str:
    """Why ``folder`` (an FSDP Trainer checkpoint) is not something shardkit reshards, consolidates
    or converts, and what the user can do with it instead, true to the layout found."""
    what = (f"it was saved by FSDP through Accelerate with fsdp_state_dict_type {layout.state_dict_type} "
            f"(model: {', '.join(layout.model)}; optimizer: {', '.join(layout.optimizer) or 'none saved'}"
            f"{f'; written by {layout.ranks} rank(s)' if layout.ranks else ''})")
    read = read_by_shardkit(layout, folder)
    not_ours = ("shardkit's reshard reads DeepSpeed checkpoint-N folders, not accelerate's FSDP files; export, "
                "consolidate and convert --to fsdp2 read its SHARDED_STATE_DICT and FULL_STATE_DICT layouts (DCP "
                "folders or per-rank files)" if read else
                "shardkit's export, consolidate and convert read accelerate's SHARDED_STATE_DICT (DCP, or "
                f"per-rank files) and FULL_STATE_DICT layouts, not accelerate's FSDP files of this kind: {unread_why(layout, folder)}")
    if not layout.optimizer:
        return (f"{head}; {what}. It holds no optimizer state (TrainingArguments.save_only_model=True, or the save "
                f"was interrupted), so it can start a new run but not resume one. {not_ours}")
    if layout.state_dict_type == "SHARDED_STATE_DICT":
        return (f"{head}; {what}: torch.distributed.checkpoint folders, the same layout under FSDP1 and FSDP2. "
                "The Trainer resumes it at any world size as it is (DCP reshards while loading), so there is nothing "
                f"to reshard. {not_ours}")
    if layout.state_dict_type == "FULL_STATE_DICT":
        safetensors = " and model.safetensors" if (folder / "model.safetensors").is_file() else ""
        return (f"{head}; {what}: the whole model and the whole, unsharded optimizer state, saved by rank 0. The "
                f"Trainer resumes it at any world size as it is, so there is nothing to reshard, and "
                f"{layout.model[0]}{safetensors} already hold the full weights. {not_ours}")
    ranks = f"{layout.ranks} ranks" if layout.ranks else "the ranks that wrote it"
    who = "accelerate does not repartition it" if read else "neither accelerate nor shardkit repartitions it"
    return (f"{head}; {what}: each rank's own shard in its own file, which only {ranks} can load ({who}). Resume with {ranks}; to change the world size, resume once at "
            f"{ranks} and save again with fsdp_state_dict_type SHARDED_STATE_DICT (DCP folders, reshardable on load). "
            f"{not_ours}")


def refused_global(layout: FsdpLayout, folder: Path) -> str | None:
    """The weights-only unpickler's refusal of the first per-rank file of ``folder`` whose pickle names a global
    outside what ``torch.save`` writes (``os.system``...: nothing is run), or None. Asked only of per-rank files
    that hold neither ShardedTensors nor DTensors, so the refusal, naming the file and the global, is what the
    user reads instead of a layout that only looks unfamiliar."""
    for name in [*layout.model, *layout.optimizer]:
        if name.endswith("/"):
            continue  # a DCP folder: read through .metadata, not a pickle
        try:
            read_structure(folder / name, what="the per-rank files accelerate's FSDP save writes")
        except CheckpointError as exc:
            if "refused to load" in str(exc):
                return str(exc)
    return None


def unread_why(layout: FsdpLayout, folder: Path | None = None) -> str:
    """Why shardkit reads no tensor of a per-rank layout it refuses, and the fix (export, consolidate,
    convert and inspect say the same). ``folder``: where the files are, so that a file the weights-only
    unpickler refuses is named with the global it refused."""
    refusal = (refused_global(layout, folder) if folder is not None and layout.state_dict_type == SHARDED_PER_RANK
               else None)
    if refusal is not None:
        return (f"{refusal.rstrip('.')}; a per-rank file that calls a global torch.save never writes is not one FSDP "
                "saved (tampered with, or written by something else), so no file of this save is read. Re-copy the "
                "checkpoint from the run that saved it, or resume from another checkpoint")
    if layout.state_dict_type == "LOCAL_STATE_DICT":
        # FSDP1's _local_post_state_dict_hook (torch 2.13 fsdp/_state_dict_utils.py) saves each FSDP unit's
        # flat parameter shard as a 1-D ShardedTensor; the FlatParamShardMetadata (names, shapes, padding)
        # stays in memory on the FlatParameter and is never saved
        return ("LOCAL_STATE_DICT rank files hold each FSDP unit's flat parameter (<unit>._flat_param: this rank's "
                "1-D slice of the unit's parameters flattened, concatenated and padded), and FSDP saves neither which "
                "parameters were flattened into it, nor their shapes, nor the alignment padding between them (with "
                "use_orig_params=True each parameter's local slice is saved too, but as a 1-D run without its shape or "
                "offset). Load it with FSDP1 at the same world size and wrapping, and save again with "
                "fsdp_state_dict_type SHARDED_STATE_DICT (or FULL_STATE_DICT)")
    if layout.state_dict_type != SHARDED_PER_RANK:
        return (f"its model file is {', '.join(layout.model)}, not the {FSDP_MODEL_NAME}.bin of model_index 0 the "
                "Trainer writes. Rename it or pass the weights file to the command that reads it")
    return ("its per-rank files hold neither FSDP1's ShardedTensors nor FSDP2's DTensors, so which rows of each tensor "
            "a rank holds is not recorded. Resume at the same world size and save again with fsdp_state_dict_type "
            "SHARDED_STATE_DICT and use_dcp=True (the default): DCP folders")
