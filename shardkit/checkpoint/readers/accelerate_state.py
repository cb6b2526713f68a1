"""The reader of a plain (one-process, no FSDP, no DeepSpeed) ``Accelerator.save_state`` folder: the model as
``model.safetensors`` (``save_model``'s default), the optimizer as ``optimizer.bin``, ``random_states_0.pkl``
and, where registered, ``scheduler.bin``, ``sampler.bin`` and ``custom_checkpoint_<i>.pkl``; no
``config.json``, so ``from_pretrained`` does not load it as it is.

Only the weights are described: each tensor one byte range of ``model.safetensors`` (its header: names,
dtypes, shapes, offsets; no tensor byte read). ``optimizer.bin`` is torch's ``optimizer.state_dict()``,
keyed by the position of each parameter among those the optimizer was given, an order the folder does
not record, so its state is not matched to names (convert refuses the source as weights-only; export
and consolidate take it).
"""

from __future__ import annotations

import math
from pathlib import Path

from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.model.tensors import Piece, SourceTensor
from shardkit.core.errors import CheckpointError
from shardkit.storage.safetensors_file import TORCH_DTYPE, read_header
from shardkit.storage.torch_load import ITEMSIZE

WEIGHTS_FILE = "model.safetensors"


def read_accelerate_state(folder: Path) -> TrainingCheckpoint:
    """The weights of the ``save_state`` folder ``folder`` (see the module doc); CheckpointError naming
    ``model.safetensors`` when its header is damaged or describes bytes past the file's end."""
    file = folder / WEIGHTS_FILE
    header, start, size = read_header(file)
    weights: dict[str, SourceTensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = TORCH_DTYPE[entry["dtype"]], tuple(int(d) for d in entry["shape"])
            lo, hi = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: header entry {name!r} is {entry!r}, not a safetensors tensor entry "
                                  "(dtype, shape, data_offsets): the file is damaged") from None
        numel = math.prod(shape)
        if start + hi > size or hi - lo != numel * ITEMSIZE[dtype]:
            raise CheckpointError(f"{file}: tensor {name!r} ({dtype}{list(shape)}) is said to lie at bytes {lo}-{hi} "
                                  f"of the data, which the file's {size} bytes do not hold: the file is truncated")
        weights[name] = SourceTensor(name, dtype, shape, [Piece(file, start + lo, 0, numel)])
    return TrainingCheckpoint("accelerate-state", folder, weights, notes=[
        f"Accelerate save_state folder {folder} ({WEIGHTS_FILE}); its optimizer.bin is keyed by parameter position, "
        "not read"])
