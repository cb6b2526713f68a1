"""The ZeRO-3 writer for a ZeRO-3 source written back as its own run at another world size (``reshard``):
each new rank's optimizer and model-states file as a pickle plus storage records that are byte ranges of
the source rank files and zero runs, without torch.

``writers.zero3.RankStates`` builds the files of a run the target config describes (``convert --to
zero3``: the resuming optimizer's param-group format, a static loss scale, one Adam step per sub-group).
A reshard keeps everything of the source run but its partitions, so the dicts written here are rank 0's
own (the ZeRO-3 reader keeps them as ``scalars["native"]``, as parsed by ``read_structure``) with the new
``fp32_flat_groups``, per-element optimizer states, ``partition_count``, param groups' sub-group indices,
``dp_world_size``, ``param_shapes`` and frozen fragments: fp16 and its loss scaler, offload, any
optimizer's scalar state and the client state are carried as the source has them.

A new rank's flat partition of sub-group ``j`` is, parameter by parameter, its elements' pieces in the
source (``SourceTensor.pieces_in``, computed from the reader's layout: only the few source ranks that
hold them are parsed) and its zero padding. A file's pickle and records are built by the worker that
writes it (``Zero3SameRun.files``' ``build``), so a process writing 8 of 1,024 new ranks reads the few
source files those ranks draw from.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from shardkit.checkpoint.model.checkpoint import FP32, TrainingCheckpoint
from shardkit.checkpoint.writers.zero3 import new_flat, new_fragment
from shardkit.checkpoint.zero3.files import MODEL_FILE, OPTIM_FILE
from shardkit.checkpoint.zero3.repartition import TargetLayout, new_model_dict, new_optimizer_state, optim_dict
from shardkit.core.errors import CheckpointError
from shardkit.storage.torch_load import ITEMSIZE, TensorRef, TorchSize, read_structure
from shardkit.storage.torch_pickle import pickle_structure
from shardkit.storage.torch_zip import RecordData

#: What a worker writes for one output file: ``data.pkl`` and the storage records, in order.
Built = tuple[bytes, list[tuple[str, RecordData]]]


@dataclass(frozen=True)
class OutputFile:
    """One file of the new tag folder."""

    name: str
    nbytes: int
    """About how many bytes it will hold (the tensor records): what the writers' shares are balanced on."""
    build: Callable[[], Built]


class Zero3SameRun:
    """The files of the ZeRO-3 checkpoint ``ckpt`` (``readers.zero3``) at ``layout.world_size`` ranks."""

    def __init__(self, ckpt: TrainingCheckpoint, layout: TargetLayout):
        native = ckpt.scalars.get("native")
        if ckpt.format != "zero3" or not isinstance(native, dict):
            raise CheckpointError(f"{ckpt.folder}: a {ckpt.format} checkpoint, and only a ZeRO-3 one is written back as "
                                  "its own ZeRO-3 run. Use `shardkit convert --to zero3`")
        self.ckpt, self.layout = ckpt, layout
        self.saved_world = ckpt.world_size or 0
        self.optim_file0: dict[str, Any] = native["optim_file"]
        self.model_state: dict[str, Any] = native["model_states"]
        self.model_files: list[Path] = native["model_files"]
        self.prefix: str = native["prefix"]
        self.frozen = [n for n in ckpt.weights if n in ckpt.frozen]

    @functools.lru_cache(maxsize=64)
    def _model(self, rank: int) -> dict[str, Any]:
        return self.model_state if rank == 0 else dict(read_structure(self.model_files[rank]))

    def files(self) -> list[OutputFile]:
        """Every output file: the optimizer files first (the large ones), then the model files."""
        ranks = range(self.layout.world_size)
        flat = sum(self.layout.sub_group_numel(j) for j in range(len(self.layout.sub_groups)))
        states = next(iter(self.ckpt.optimizer.values()), {})
        per_element = 4 + sum(ITEMSIZE[t.dtype] for t in states.values())
        optim = [OutputFile(OPTIM_FILE.format(prefix=self.prefix, rank=r), flat * per_element,
                            functools.partial(self._build_optim, r)) for r in ranks]
        model = [OutputFile(MODEL_FILE.format(rank=r), 0, functools.partial(self._build_model, r)) for r in ranks]
        return optim + model

    def _build_optim(self, rank: int) -> Built:
        layout, optim0 = self.layout, self.optim_file0
        src_state = optim0["optimizer_state_dict"]["optimizer_state_dict"].get("state") or {}

        def carry(j: int, _first: int, k: str, v: Any) -> Any:
            params = layout.sub_groups[j]
            per_element = self.ckpt.optimizer.get(params[0].source.name, {}) if params else {}
            if k not in per_element or not isinstance(v, TensorRef):
                return v
            # the ZeRO-3 reader's tensors are all pieces in the saved dtypes: byte ranges and zero runs, no torch
            return new_flat(layout, j, rank, functools.partial(self.ckpt.tensor, key=k), v.dtype, True)

        state = new_optimizer_state(src_state, layout, carry)
        fp32 = [new_flat(layout, j, rank, functools.partial(self.ckpt.tensor, key=FP32), "float32", True)
                for j in range(len(layout.sub_groups))]
        return pickle_structure(optim_dict(optim0, layout, state, fp32))

    def _build_model(self, rank: int) -> Built:
        layout = self.layout
        # the same partitioning: this rank's own file, so its own client_state entries survive
        sd = self._model(rank) if layout.world_size == self.saved_world else self.model_state
        return pickle_structure(new_model_dict(sd, layout, TorchSize, self.frozen, lambda n: new_fragment(
            self.ckpt.weights[n], rank, layout.world_size, self.ckpt.weights[n].dtype, True)))
