"""Where a DeepSpeed ZeRO-1/2 checkpoint's files are: the names DeepSpeed gives them, whether a folder holds
that layout (``is_zero12_folder``), and a rank file's tensor read through torch where byte ranges cannot
describe it (``tensor_from_ref``). What the files hold is described, and checked, by ``readers.zero12``;
``writers.zero12`` writes them at any world size.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from shardkit.checkpoint.zero3.files import OPTIM_FILE
from shardkit.core.errors import CheckpointError
from shardkit.core.files import open_regular
from shardkit.storage.listing import FolderListing, list_folder
from shardkit.storage.torch_load import TensorRef

if TYPE_CHECKING:
    import torch

#: One data-parallel rank's optimizer file, ``zero3.files.OPTIM_FILE`` (DeepSpeed names it alike at every ZeRO
#: stage), as a pattern; groups: the bf16 prefix and the rank.
OPTIM_FILE_PATTERN = re.compile(
    "^" + re.escape(OPTIM_FILE).replace(r"\{prefix\}", "(bf16_)?").replace(r"\{rank\}", r"(\d+)") + "$")
MODEL_FILE = "mp_rank_00_model_states.pt"
"""The one model-states file: the full 16-bit module, ``param_shapes``, frozen fragments, the DeepSpeed config."""
OPTIMIZER_KEY = "optimizer_state_dict"


def is_zero12_folder(tag_dir: Path, listing: FolderListing | None = None) -> bool:
    """True when ``tag_dir`` holds a ZeRO-1/2 layout: rank optimizer files and one ``mp_rank_00`` model file.
    ``listing``: of ``tag_dir``, already taken (not listed again)."""
    if listing is None or not listing.describes(tag_dir):
        if not (tag_dir / MODEL_FILE).is_file():  # no folder, or no ZeRO-1/2 save: nothing to list
            return False
        listing = list_folder(tag_dir)  # the command's one listing of it, where a command holds one
    return MODEL_FILE in listing.files and any(OPTIM_FILE_PATTERN.match(name) for name in listing.names)


def tensor_from_ref(ref: TensorRef) -> "torch.Tensor":
    """The tensor ``ref`` describes, read with torch from its file: its storage record, then the view (any
    stride or offset). For what byte ranges cannot express: a strided view some tool saved, a cast."""
    import torch  # lazy: only a source the byte ranges cannot describe pays for torch

    if ref.path is None:
        raise CheckpointError(f"{ref!r} was not read from a file: its bytes are unknown")
    with open_regular(ref.path) as fh:
        fh.seek(ref.record_offset)
        raw = bytearray(fh.read(ref.record_nbytes))
    dtype = getattr(torch, ref.dtype)
    storage = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    return storage.as_strided(ref.shape, ref.stride, ref.storage_offset)
