"""Describe the checkpoints torch itself writes, from their small files only: a DCP folder (FSDP2,
shardkit's ``save_fsdp_checkpoint``) from its ``.metadata`` (``read_plain_metadata``, no torch);
the FSDP files accelerate and the Trainer write (``hf_trainer.fsdp_files``: SHARDED_STATE_DICT as
DCP folders, FULL_STATE_DICT, per-rank ``*_rank{R}.bin``, LOCAL_STATE_DICT); and a Hugging Face
model folder from its safetensors headers (8-byte length + JSON)."""

from __future__ import annotations

import math
from pathlib import Path

from shardkit.checkpoint.dcp.plain_metadata import METADATA_NAME, DcpMetadata, read_plain_metadata
from shardkit.checkpoint.dcp.slices import DcpSlices
from shardkit.checkpoint.hf_trainer.fsdp_files import (
    SHARDED_PER_RANK,
    FsdpLayout,
    holds_sharded_tensors,
    read_by_shardkit,
)
from shardkit.checkpoint.layout.description import CheckpointDescription
from shardkit.core.errors import CheckpointError
from shardkit.storage.safetensors_file import TORCH_DTYPE, read_header
from shardkit.storage.torch_load import TensorRef, read_structure

#: Weight files of a folder from_pretrained loads as it is.
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _model_and_state(md: DcpMetadata) -> tuple[dict[str, tuple[str, int]], set[str], set[str]]:
    """(parameter -> (dtype, numel), optimizer state keys, optimizer state dtypes) of a DCP ``.metadata``.

    shardkit's FSDP2 save nests ``{"model", "optim"}``, accelerate's two folders ``{"model"}`` and
    ``{"optimizer"}``; the optimizer's per-parameter state is ``<optim>.state.<param>.<key>``."""
    params: dict[str, tuple[str, int]] = {}
    state_keys: set[str] = set()
    state_dtypes: set[str] = set()
    for key, meta in md.tensors.items():
        head, _, rest = key.partition(".")
        if head == "model":
            params[rest] = (meta.dtype, math.prod(meta.size))
        elif head in ("optim", "optimizer") and rest.startswith("state."):
            state_keys.add(rest.rsplit(".", 1)[-1])
            if math.prod(meta.size) > 1:
                state_dtypes.add(meta.dtype)
    for key in md.values:
        head, _, rest = key.partition(".")
        if head in ("optim", "optimizer") and rest.startswith("state."):
            state_keys.add(rest.rsplit(".", 1)[-1])
    return params, state_keys, state_dtypes


def _dcp_step(folder: Path, md: DcpMetadata) -> int | None:
    """The training step a DCP optimizer state records: every parameter's Adam ``step``
    (``<optim>.state.<param>.step``, a 0-dim tensor or a plain number; a few bytes each, read without torch)
    when all agree on one whole number; None where none is readable or they differ (frozen layers...)."""
    keys = [k for k in (*md.tensors, *md.values) if k.split(".", 1)[0] in ("optim", "optimizer")
            and k.split(".", 1)[-1].startswith("state.") and k.endswith(".step")]
    if not keys:
        return None
    slices = DcpSlices(folder, md)
    values: set[float] = set()
    try:
        for key in keys:
            ref = slices.tensor_ref(key) if key in md.tensors else None
            value = slices.scalar(ref) if ref is not None else slices.value(key)[1]
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                return None  # stored another way (a transformed item): the reader's load would say
            values.add(float(value))
    except (CheckpointError, OSError, ValueError):
        return None  # a damaged item: `shardkit verify` names it; inspect describes what it can
    finally:
        slices.close()
    return int(values.pop()) if len(values) == 1 and next(iter(values)).is_integer() else None


def _distcp_files(folder: Path) -> int:
    return sum(1 for f in folder.iterdir() if f.name.endswith(".distcp"))


def _fill_from_dcp(desc: CheckpointDescription, model_dir: Path, optim_dir: Path | None) -> None:
    md = read_plain_metadata(model_dir / METADATA_NAME)
    params, keys, state_dtypes = _model_and_state(md)
    if optim_dir is not None and optim_dir != model_dir:
        md = read_plain_metadata(optim_dir / METADATA_NAME)
        _, keys, state_dtypes = _model_and_state(md)
    desc.step = _dcp_step(optim_dir or model_dir, md)
    desc.parameters = len(params)
    desc.elements = sum(n for _, n in params.values())
    desc.world_size = _distcp_files(model_dir) or None
    weights = sorted({d for d, _ in params.values()})
    if weights:
        desc.dtypes["weights"] = ", ".join(weights)
    if weights in (["bfloat16"], ["float16"]):  # parameters kept in 16 bits: trained so (float32 ones tell nothing)
        desc.precision = {"bfloat16": "bf16", "float16": "fp16"}[weights[0]]
    if state_dtypes:
        desc.dtypes["optimizer state"] = ", ".join(sorted(state_dtypes))
    desc.optimizer_state_keys = sorted(keys)
    desc.optimizer = "saved" if keys else None


def describe_dcp(folder: Path, given: str) -> CheckpointDescription:
    """A DCP folder holding ``.metadata`` (FSDP2; shardkit's save nests ``{"model", "optim"}``)."""
    desc = CheckpointDescription(path=given, folder=str(folder), format="dcp",
                                 layout="FSDP2 / torch.distributed.checkpoint (DCP)")
    _fill_from_dcp(desc, folder, None)
    desc.notes.append("DCP loads at any world size (it reshards while loading)")
    return desc


def _full_state_file(desc: CheckpointDescription, file: Path) -> None:
    """Parameters and dtypes of a whole-model ``torch.save`` file (FULL_STATE_DICT), from its pickle."""
    try:
        sd = read_structure(file)
    except CheckpointError as exc:
        desc.notes.append(f"{file.name}: its structure could not be read without torch ({exc})")
        return
    tensors = {k: v for k, v in sd.items() if isinstance(v, TensorRef)} if isinstance(sd, dict) else {}
    desc.parameters = len(tensors)
    desc.elements = sum(t.numel for t in tensors.values())
    if tensors:
        desc.dtypes["weights"] = ", ".join(sorted({t.dtype for t in tensors.values()}))


def describe_accelerate_fsdp(folder: Path, layout: FsdpLayout, given: str) -> CheckpointDescription:
    """What accelerate's ``save_fsdp_model``/``save_fsdp_optimizer`` wrote into ``folder``."""
    kind = {"SHARDED_STATE_DICT": "DCP folders", "SHARDED_STATE_DICT (use_dcp=False)": "per-rank torch.save files",
            "FULL_STATE_DICT": "whole model and optimizer saved by rank 0",
            "LOCAL_STATE_DICT": "each rank's flat FSDP1 shard"}.get(layout.state_dict_type, "")
    desc = CheckpointDescription(
        path=given, folder=str(folder), format="accelerate-fsdp", state_dict_type=layout.state_dict_type,
        layout=f"FSDP (Accelerate/Trainer) {layout.state_dict_type}: {kind} ({', '.join(layout.model + layout.optimizer)})",
        world_size=layout.ranks)
    if layout.state_dict_type == "SHARDED_STATE_DICT":
        optim = folder / layout.optimizer[0].rstrip("/") if layout.optimizer else None
        _fill_from_dcp(desc, folder / layout.model[0].rstrip("/"), optim)
        desc.world_size = layout.ranks
    else:
        desc.optimizer = "saved" if layout.optimizer else None
        if layout.state_dict_type == "FULL_STATE_DICT":
            _full_state_file(desc, folder / layout.model[0])
        if layout.state_dict_type in ("FULL_STATE_DICT", SHARDED_PER_RANK) and read_by_shardkit(layout, folder):
            # what their pickles hold beyond names (ShardedTensor/DTensor shapes, the optimizer) is the reader's to say
            desc.reader_kind = "fsdp1-full" if layout.state_dict_type == "FULL_STATE_DICT" else (
                "fsdp1-sharded-bins" if holds_sharded_tensors(folder / layout.model[0]) else "fsdp2-sharded-bins")
    if not layout.optimizer:
        desc.notes.append("no optimizer state saved: it can start a run, not resume one")
    return desc


#: What ``Accelerator.save_state`` writes beside ``model.safetensors`` in one process without FSDP or DeepSpeed
#: (accelerate's OPTIMIZER_NAME and RNG_STATE_NAME, index 0): either marks the folder as its save.
ACCELERATE_STATE_FILES = ("optimizer.bin", "random_states_0.pkl")
_CONFIG = "config.json"


def is_accelerate_state(folder: Path) -> bool:
    """True for a plain ``Accelerator.save_state`` folder: ``model.safetensors`` beside ``optimizer.bin`` or
    ``random_states_0.pkl`` (a Trainer checkpoint-N saves ``optimizer.pt`` and ``rng_state.pth`` instead)."""
    return (folder / "model.safetensors").is_file() and any((folder / n).is_file() for n in ACCELERATE_STATE_FILES)


def describe_accelerate_state(folder: Path, given: str) -> CheckpointDescription:
    """A plain ``Accelerator.save_state`` folder: the weights from ``model.safetensors``'s header (through its
    reader, ``reader_kind``), the optimizer's state keys from ``optimizer.bin``'s pickled structure."""
    extra = sorted(f.name for f in folder.iterdir() if f.is_file() and f.name != "model.safetensors")
    desc = CheckpointDescription(path=given, folder=str(folder), format="accelerate-state",
                                 layout=f"Accelerate save_state folder (model.safetensors, {', '.join(extra[:5])}"
                                        f"{' ...' if len(extra) > 5 else ''})", reader_kind="accelerate-state")
    optim = folder / "optimizer.bin"
    if optim.is_file():
        desc.optimizer = "saved"
        try:
            state = read_structure(optim, what="torch optimizer state dicts").get("state")
        except (CheckpointError, AttributeError):
            state = None
        first = next(iter(state.values()), None) if isinstance(state, dict) and state else None
        if isinstance(first, dict):
            desc.optimizer_state_keys = sorted(str(k) for k in first)
            moment = next((v for v in first.values() if isinstance(v, TensorRef) and v.numel > 1), None)
            if moment is not None:
                desc.dtypes["optimizer state"] = moment.dtype
        desc.notes.append("optimizer.bin is torch's optimizer.state_dict(), keyed by parameter position (an order "
                          "the folder does not record): Accelerator.load_state resumes it; no convert target reads it")
    if (folder / _CONFIG).is_file():
        desc.notes.append("from_pretrained loads model.safetensors with the config.json beside it")
    else:
        desc.notes.append("no config.json: from_pretrained cannot load this folder as it is; shardkit export writes a "
                          "from_pretrained folder from it with --model-config DIR (the model's config.json)")
    return desc


def describe_hf_model(folder: Path, given: str) -> CheckpointDescription:
    """A folder ``from_pretrained`` loads: its safetensors headers give names, dtypes and shapes."""
    desc = CheckpointDescription(path=given, folder=str(folder), format="hf-model",
                                 layout="Hugging Face model folder (save_pretrained)")
    files = sorted(folder.glob("*.safetensors"))
    dtypes: set[str] = set()
    params = elements = 0
    for f in files:
        for name, entry in read_header(f)[0].items():
            if name == "__metadata__" or not isinstance(entry, dict):
                continue
            params += 1
            elements += math.prod(int(d) for d in entry.get("shape", []))
            dtypes.add(TORCH_DTYPE.get(str(entry.get("dtype")), str(entry.get("dtype"))))
    if files:
        desc.parameters, desc.elements = params, elements
        desc.dtypes["weights"] = ", ".join(sorted(dtypes))
    else:
        desc.notes.append("weights in pytorch_model.bin: not read (torch.save files need torch)")
    desc.notes.append("from_pretrained loads this folder as it is; it holds no optimizer state")
    return desc
