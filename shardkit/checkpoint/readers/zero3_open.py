"""Describe a DeepSpeed ZeRO-3 checkpoint without reading its tensors: ``open_zero3_layout`` finds its
files (``zero3.files.resolve_tag_dir``), checks that they come from one save, and returns its layout as
a ``zero3.checkpoint.Zero3Checkpoint``, whose tensors ``readers.zero3`` describes as byte ranges.

Layout (DeepSpeed 0.19.8; checked against ``deepspeed/utils/zero_to_fp32.py``
``_zero3_merge_trainable_params`` and ``deepspeed/checkpoint/ds_to_universal.py``
``extract_zero_shards_stage3``):

- ``<root>/latest`` holds the tag; ``<root>/<tag>/`` holds, for each data-parallel rank ``r``,
  ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` (``param_shapes``, ``dp_world_size``,
  ``ds_version``, buffers, client state) and ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt``
  (``optimizer_state_dict``: ``partition_count``, ``fp32_flat_groups`` and the inner torch
  optimizer's ``state``/``param_groups``).
- ``param_shapes`` is a list with one ordered dict per optimizer *sub-group* (``sub_group_size``
  splits a param group), and sub-group ``i`` is ``fp32_flat_groups[i]`` and inner state ``i``.
- Inside a sub-group's flat tensor each parameter takes ``ceil(numel / world_size)`` elements on
  every rank, in ``param_shapes`` order; rank ``r`` holds elements ``[r*p, (r+1)*p)`` of the
  flattened parameter and the last rank's tail is zero padding.

The files are parsed with ``read_structure`` (tensors become ``TensorRef``s holding file offsets), so
this never imports torch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from shardkit.checkpoint.zero3.checkpoint import ParamSlot, Zero3Checkpoint
from shardkit.checkpoint.zero3.files import MODEL_FILE, OPTIM_FILE, RANK_FILE, resolve_tag_dir
from shardkit.checkpoint.zero3.layout import partition_numel
from shardkit.config.view import deepspeed_view
from shardkit.core.deprecated import deprecated_alias
from shardkit.core.errors import CheckpointError
from shardkit.core.files import not_regular
from shardkit.storage.checkpoint_file import NOT_REGULAR_FIX
from shardkit.storage.listing import FolderListing, list_folder
from shardkit.storage.torch_load import TensorRef, read_structure


def _numel(t: Any) -> int:
    if not isinstance(t, TensorRef) and not callable(getattr(t, "numel", None)):
        raise TypeError(f"a {type(t).__name__} where a tensor belongs")
    return t.numel if isinstance(t, TensorRef) else int(t.numel())


def open_zero3_layout(path: str | Path, *, listing: FolderListing | None = None,
                      read: Callable[[Path], Any] = read_structure) -> Zero3Checkpoint:
    """Describe the ZeRO-3 checkpoint at ``path`` (root, tag folder or a rank file) without reading tensors.

    ``listing``: of the tag folder ``path``, taken by the caller (``storage.listing``): the folder is not
    listed, nor its rank files stat'ed, again. ``read`` parses a rank file (``read_structure``).
    """
    tag_dir, tag = resolve_tag_dir(path, listing)
    if listing is None or not listing.describes(tag_dir):
        listing = list_folder(tag_dir)  # one listing instead of a stat per rank file (2 x world)
    try:
        return _describe(tag_dir, tag, read, listing if listing is not None and listing.describes(tag_dir)
                         else None)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as exc:
        # Files that unpickle but hold values DeepSpeed never writes (an edited or bit-flipped
        # field: a string for a shape, a dict for a tensor, a missing key) end here, named, instead
        # of as a traceback from deep in the layout arithmetic (the hostile sweep's finding).
        raise CheckpointError(
            f"{tag_dir}: its rank files hold a structure DeepSpeed does not write ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}): a field of a model_states or optim_states "
            "file is corrupted or was edited. Re-copy the checkpoint, or resume from the previous one"
        ) from None


def _positive_int(value: Any, field: str, where: Path) -> int:
    """``value`` when it is a positive int (a bool, float or string is no count), else a CheckpointError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{where}: {field} is {value!r}, expected a positive int: the file is corrupted or "
                              "was edited; re-copy it or resume from the previous checkpoint")
    return value


def _describe(tag_dir: Path, tag: str, load: Callable[[Path], Any], listing: FolderListing | None) -> Zero3Checkpoint:
    def exists(f: Path) -> bool:  # any entry (a folder, a FIFO) named as a rank file "exists": the parse names it
        return listing.has(f.name) if listing is not None else f.exists()

    def names() -> list[str]:
        return list(listing.names) if listing is not None else [f.name for f in tag_dir.iterdir()]

    model0 = tag_dir / MODEL_FILE.format(rank=0)
    if not exists(model0):
        others = sorted(names())
        raise CheckpointError(f"{model0}: missing (rank 0's model states); the folder holds {others[:8]}")
    model_state = load(model0)
    if not isinstance(model_state, dict) or "param_shapes" not in model_state:
        raise CheckpointError(f"{model0}: has no param_shapes: not a DeepSpeed ZeRO-3 model-states file")
    world = _positive_int(model_state.get("dp_world_size"), "dp_world_size", model0)
    if _positive_int(model_state.get("mp_world_size") or 1, "mp_world_size", model0) != 1:
        raise CheckpointError(
            f"{model0}: mp_world_size is {model_state['mp_world_size']}; tensor/model-parallel ZeRO-3 "
            "checkpoints are not supported (only data-parallel ranks). Use ds_to_universal for those."
        )
    prefix = "bf16_" if exists(tag_dir / OPTIM_FILE.format(prefix="bf16_", rank=0)) else ""
    # rank by rank, stopping at the first missing file: an edited dp_world_size (2**63) costs the
    # files present, not a list of 2**63 paths
    for r in range(world):
        for f in (tag_dir / MODEL_FILE.format(rank=r), tag_dir / OPTIM_FILE.format(prefix=prefix, rank=r)):
            if not exists(f):
                raise CheckpointError(
                    f"{f}: missing, but dp_world_size is {world} so every rank 0..{world - 1} must have saved one. "
                    "A rank died during the save or the copy is partial; resume from the previous checkpoint."
                )
            # a FIFO, device or socket in a rank file's place: named now, even where this command never reads that file
            # (a reshard to another world size reads rank 0's model file only): the checkpoint is not whole
            refusal = not_regular(f, fix=NOT_REGULAR_FIX) if listing is not None and f.name not in listing.files else None
            if refusal is not None and refusal.reason != "folder":
                raise refusal
    model_files = [tag_dir / MODEL_FILE.format(rank=r) for r in range(world)]
    optim_files = [tag_dir / OPTIM_FILE.format(prefix=prefix, rank=r) for r in range(world)]
    extra = sorted(name for name in names() if (m := RANK_FILE.match(name)) and int(m.group(2)) >= world)
    if extra:
        raise CheckpointError(
            f"{tag_dir}: holds rank files beyond dp_world_size={world} ({extra[:4]}): two saves at "
            "different world sizes were written into the same tag folder. Save each run to its own tag."
        )

    osd = zero3_optimizer_sd(load(optim_files[0]), optim_files[0])
    stage = osd.get("zero_stage")
    stage_value = getattr(stage, "value", stage)
    if stage_value is not None and int(stage_value) != 3:
        raise CheckpointError(f"{optim_files[0]}: zero_stage is {stage_value}, expected 3")
    pc = osd.get("partition_count")
    if isinstance(pc, list):
        pc = max(pc)
    if pc is not None and int(pc) != world:
        raise CheckpointError(
            f"{optim_files[0]}: partition_count is {pc} but {model0.name} says dp_world_size={world}: "
            "the model and optimizer files come from different saves."
        )
    inner = osd["optimizer_state_dict"]
    param_groups = inner.get("param_groups") or []
    flats = osd["fp32_flat_groups"]
    shapes = model_state["param_shapes"]
    if len(shapes) != len(flats):
        raise CheckpointError(
            f"{tag_dir}: param_shapes has {len(shapes)} sub-groups but fp32_flat_groups has {len(flats)}"
        )
    sub_group_param_group = _sub_group_param_groups(param_groups, len(flats), optim_files[0])
    slots: list[ParamSlot] = []
    sub_group_numel: list[int] = []
    for j, group_shapes in enumerate(shapes):
        offset = 0
        for name, shape in group_shapes.items():
            if not isinstance(shape, (tuple, list)) or not all(type(d) is int and d >= 0 for d in shape):
                raise CheckpointError(f"{model0}: param_shapes gives {name!r} the shape {shape!r}, expected "
                                      "non-negative ints: the file is corrupted or was edited")
            numel = math.prod(shape)
            pn = partition_numel(numel, world)
            slots.append(ParamSlot(name, tuple(shape), numel, sub_group_param_group[j], j, offset, pn))
            offset += pn
        if _numel(flats[j]) != offset:
            raise CheckpointError(
                f"{optim_files[0]}: fp32 partition of sub-group {j} has {_numel(flats[j])} elements, but "
                f"param_shapes at world size {world} need {offset} (sum of ceil(numel/{world})). "
                "Unknown layout: was this written by a DeepSpeed with a different ZeRO-3 padding rule?"
            )
        sub_group_numel.append(offset)
    state = inner.get("state") or {}
    state_keys = sorted(
        {k for j, entry in state.items() for k, v in entry.items()
         if hasattr(v, "numel") and _numel(v) == sub_group_numel[j] and _numel(v) > 1}
    )
    cfg = model_state.get("ds_config")
    view = deepspeed_view(cfg if isinstance(cfg, dict) else {})
    precision = "bf16" if prefix or view.bf16 else ("fp16" if view.fp16 else "fp32")
    return Zero3Checkpoint(
        tag_dir=tag_dir,
        tag=tag,
        world_size=world,
        model_files=model_files,
        optim_files=optim_files,
        slots=slots,
        sub_group_numel=sub_group_numel,
        sub_group_param_group=sub_group_param_group,
        param_groups=[{k: v for k, v in g.items() if k != "params"} for g in param_groups],
        state_keys=state_keys,
        precision=precision,
        ds_version=model_state.get("ds_version"),
        ds_config=cfg if isinstance(cfg, dict) else {},
        model_state=model_state,
    )


def _sub_group_param_groups(param_groups: list[dict[str, Any]], n_sub: int, path: Path) -> list[int]:
    """Sub-group -> param group, from the inner optimizer's ``params`` index lists.

    DeepSpeed appends each sub-group's fp32 flat tensor to its param group in sub-group order
    (``_set_fp32_optimizer_param_groups``), so the state index of sub-group ``i`` is ``i`` only when
    the groups' index lists, concatenated, are ``0..n-1``; anything else is a layout we do not know.
    """
    if not param_groups:
        return [0] * n_sub
    owner: list[int] = []
    for g, group in enumerate(param_groups):
        owner.extend([g] * len(group.get("params", [])))
    flat_ids = [i for group in param_groups for i in group.get("params", [])]
    if flat_ids != list(range(n_sub)):
        raise CheckpointError(
            f"{path}: optimizer param groups index the sub-groups as {flat_ids}, expected 0..{n_sub - 1} in order; "
            "unknown ZeRO-3 layout"
        )
    return owner


def zero3_optimizer_sd(sd: Any, path: Path) -> dict[str, Any]:
    """The ``optimizer_state_dict`` of a loaded ZeRO-3 optim file; CheckpointError for any other file."""
    osd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
    if not isinstance(osd, dict) or "fp32_flat_groups" not in osd:
        raise CheckpointError(
            f"{path}: not a ZeRO-3 optimizer file (no optimizer_state_dict.fp32_flat_groups). "
            "ZeRO-1/2 checkpoints keep single_partition_of_fp32_groups instead; use DeepSpeed's zero_to_fp32.py for those."
        )
    return osd


def _open_zero3_checkpoint(path: str | Path, *, torch_free: bool = True,
                           listing: FolderListing | None = None) -> Zero3Checkpoint:
    """``open_zero3_layout`` under the old keywords: ``torch_free`` is accepted and changes nothing (the
    layout is always parsed without torch now; the tensors are read through ``readers.zero3``)."""
    del torch_free
    return open_zero3_layout(path, listing=listing)


#: The public name before the one ZeRO-3 reader: warns on call, goes in the next release.
open_zero3_checkpoint = deprecated_alias("open_zero3_checkpoint", "open_zero3_layout", _open_zero3_checkpoint)
