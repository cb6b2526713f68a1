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

import json
import math
import struct
from pathlib import Path

from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.model.tensors import Piece, SourceTensor
from shardkit.core.errors import CheckpointError
from shardkit.core.files import open_regular

WEIGHTS_FILE = "model.safetensors"
#: safetensors dtype codes -> torch dtype names (the ones the checkpoint model carries).
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
           "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
#: A safetensors header is read only up to this size (the format's own limit is 100 MB).
_MAX_HEADER = 100_000_000


def read_accelerate_state(folder: Path) -> TrainingCheckpoint:
    """The weights of the ``save_state`` folder ``folder`` (see the module doc); CheckpointError naming
    ``model.safetensors`` when its header is damaged or describes bytes past the file's end."""
    file = folder / WEIGHTS_FILE
    with open_regular(file) as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{file}: shorter than a safetensors header (8 bytes): the file is truncated")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise CheckpointError(f"{file}: safetensors header of {n} bytes, over the format's 100 MB limit: not a "
                                  "safetensors file")
        try:
            header = json.loads(fh.read(n))
        except ValueError as exc:
            raise CheckpointError(f"{file}: its safetensors header is not JSON ({exc}): the file is damaged") from None
        size = fh.seek(0, 2)
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: its safetensors header is not a JSON object: the file is damaged")
    start = 8 + n
    weights: dict[str, SourceTensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = _DTYPES[entry["dtype"]], tuple(int(d) for d in entry["shape"])
            lo, hi = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: header entry {name!r} is {entry!r}, not a safetensors tensor entry "
                                  "(dtype, shape, data_offsets): the file is damaged") from None
        numel = math.prod(shape)
        if start + hi > size or hi - lo != numel * _ITEMSIZE[dtype]:
            raise CheckpointError(f"{file}: tensor {name!r} ({dtype}{list(shape)}) is said to lie at bytes {lo}-{hi} "
                                  f"of the data, which the file's {size} bytes do not hold: the file is truncated")
        weights[name] = SourceTensor(name, dtype, shape, [Piece(file, start + lo, 0, numel)])
    return TrainingCheckpoint("accelerate-state", folder, weights, notes=[
        f"Accelerate save_state folder {folder} ({WEIGHTS_FILE}); its optimizer.bin is keyed by parameter position, "
        "not read"])


_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
             "uint8": 1, "bool": 1}
