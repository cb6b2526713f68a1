"""What a reshard writes, file by file, without torch: each new rank's optimizer and model-states
files as a pickle plus storage records that are byte ranges of the source rank files and zero runs.

The source files are parsed by ``read_structure`` (no ``import torch``, no tensor unpickled); a
new rank's flat partition of sub-group ``j`` is, parameter by parameter, the source ranks' pieces
of that parameter that fall in its range, then its zero padding (``_partition_segments``). The
layout arithmetic is ``repartition.plan_layout``'s (DeepSpeed's own sub-group rule); the dicts
written are those ``repartition.optim_state_for_rank`` / ``model_state_for_rank`` build for the
in-process resume, key for key.

A file's pickle and segments are built by the worker that writes it (``OutputFile.build``), from
the source structures it reads lazily: a process writing 8 of 1,024 new ranks reads the few source
files those ranks draw from, and nothing grows with the world size times the tensor count.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from shardkit.checkpoint.zero3.checkpoint import FP32, Zero3Checkpoint, zero3_optimizer_sd
from shardkit.checkpoint.zero3.files import MODEL_FILE, OPTIM_FILE
from shardkit.checkpoint.zero3.layout import append_segment, partition_numel, rank_range
from shardkit.checkpoint.zero3.repartition import TargetLayout, optim_dict
from shardkit.core.errors import CheckpointError
from shardkit.storage.torch_load import ITEMSIZE, TensorRef, TorchSize, read_structure
from shardkit.storage.torch_pickle import NewTensor, pickle_structure
from shardkit.storage.torch_zip import RecordData, Segment

#: What a worker writes for one output file: ``data.pkl`` and the storage records, in order.
Built = tuple[bytes, list[tuple[str, RecordData]]]


@dataclass(frozen=True)
class OutputFile:
    """One file of the resharded tag folder."""

    name: str
    nbytes: int
    """About how many bytes it will hold (the tensor records): what the workers' shares are balanced on."""
    build: Callable[[], Built]


class ReshardPlan:
    """The files of ``ckpt`` at ``layout.world_size`` ranks (``ckpt`` opened with ``torch_free=True``)."""

    def __init__(self, ckpt: Zero3Checkpoint, layout: TargetLayout):
        self.ckpt, self.layout = ckpt, layout
        self.prefix = "bf16_" if ckpt.optim_files[0].name.startswith("bf16_") else ""
        self._optim0 = self._optim(0)

    @functools.lru_cache(maxsize=64)
    def _optim(self, rank: int) -> dict[str, Any]:
        sd = read_structure(self.ckpt.optim_files[rank])
        zero3_optimizer_sd(sd, self.ckpt.optim_files[rank])  # the same refusal as the torch reader's
        return sd

    @functools.lru_cache(maxsize=64)
    def _model(self, rank: int) -> dict[str, Any]:
        return self.ckpt.model_state if rank == 0 else read_structure(self.ckpt.model_files[rank])

    def files(self) -> list[OutputFile]:
        """Every output file: the optimizer files first (the large ones), then the model files."""
        ranks = range(self.layout.world_size)
        flat_bytes = sum(self.layout.sub_group_numel(j) for j in range(len(self.layout.sub_groups)))
        per_element = 4 + sum(ITEMSIZE[d] for d in self._state_dtypes().values())
        optim = [OutputFile(OPTIM_FILE.format(prefix=self.prefix, rank=r), flat_bytes * per_element,
                            functools.partial(self._build_optim, r)) for r in ranks]
        model = [OutputFile(MODEL_FILE.format(rank=r), 0, functools.partial(self._build_model, r)) for r in ranks]
        return optim + model

    # --- the optimizer file of one new rank -------------------------------------------------------

    def _state_dtypes(self) -> dict[str, str]:
        state = self._optim0["optimizer_state_dict"]["optimizer_state_dict"].get("state") or {}
        out: dict[str, str] = {}
        for entry in state.values():
            for k, v in entry.items():
                if k in self.ckpt.state_keys and isinstance(v, TensorRef):
                    out[k] = v.dtype
        return out

    def _flat(self, rank: int, key: str, sub_group: int) -> TensorRef:
        osd = self._optim(rank)["optimizer_state_dict"]
        if key == FP32:
            t = osd["fp32_flat_groups"][sub_group]
        else:
            entry = (osd["optimizer_state_dict"].get("state") or {}).get(sub_group) or {}
            t = entry.get(key)
        want = self.ckpt.sub_group_numel[sub_group]
        path = self.ckpt.optim_files[rank]
        if not isinstance(t, TensorRef):
            raise CheckpointError(f"{path}: optimizer state {key!r} of sub-group {sub_group} is missing (rank 0's file "
                                  "has it): the rank files come from different saves, or the file is damaged")
        if t.numel != want or not t.is_contiguous():
            raise CheckpointError(f"{path}: {key} of sub-group {sub_group} has {t.numel} elements, expected {want} from "
                                  f"param_shapes at world size {self.ckpt.world_size}. The rank files come from different "
                                  "saves or the file is damaged.")
        return t

    def _partition(self, rank: int, sub_group: int, key: str, dtype: str) -> NewTensor:
        """New rank ``rank``'s flat ``key`` tensor of ``sub_group``: source byte ranges and zero runs."""
        size = ITEMSIZE[dtype]
        segs: list[Segment] = []

        for tp in self.layout.sub_groups[sub_group]:
            src = tp.source
            lo, hi = tp.rank_range(rank)
            # only the source ranks whose pieces overlap [lo, hi): a few, not the whole world
            span = range(lo // src.partition_numel, min(self.ckpt.world_size, (hi - 1) // src.partition_numel + 1)) \
                if hi > lo else range(0)
            for s in span:
                s_lo, s_hi = src.rank_range(s)
                a, b = max(lo, s_lo), min(hi, s_hi)
                if b > a:
                    flat = self._flat(s, key, src.sub_group)
                    if flat.dtype != dtype:
                        raise CheckpointError(f"{self.ckpt.optim_files[s]}: {key} of sub-group {src.sub_group} is "
                                              f"{flat.dtype}, rank 0's is {dtype}: the rank files come from different saves")
                    assert flat.file_offset is not None and flat.path is not None
                    append_segment(segs, flat.path, flat.file_offset + (src.offset + a - s_lo) * size, (b - a) * size)
            if tp.partition_numel > hi - lo:
                append_segment(segs, None, 0, (tp.partition_numel - (hi - lo)) * size)
        return NewTensor(dtype, self.layout.sub_group_numel(sub_group), segs)

    def _build_optim(self, rank: int) -> Built:
        layout, optim0 = self.layout, self._optim0
        src = optim0["optimizer_state_dict"]
        src_inner = src["optimizer_state_dict"]
        src_state = src_inner.get("state") or {}
        state: dict[int, dict[str, Any]] = {}
        for j, params in enumerate(layout.sub_groups):
            # a new sub-group's scalar state (step) is that of the source sub-group of its first parameter
            entry = src_state.get(params[0].source.sub_group if params else 0)
            if entry is None:
                continue  # the optimizer never stepped: no state to carry
            state[j] = {k: (self._partition(rank, j, k, v.dtype) if k in self.ckpt.state_keys and isinstance(v, TensorRef)
                            else v) for k, v in entry.items()}
        fp32 = [self._partition(rank, j, FP32, "float32") for j in range(len(layout.sub_groups))]
        return pickle_structure(optim_dict(optim0, layout, state, fp32))

    # --- the model-states file of one new rank ----------------------------------------------------

    def _build_model(self, rank: int) -> Built:
        layout = self.layout
        same = layout.world_size == self.ckpt.world_size
        # the same partitioning: this rank's own file, so its own client_state entries survive
        sd = dict(self._model(rank) if same else self.ckpt.model_state)
        sd["dp_world_size"] = layout.world_size
        sd["param_shapes"] = [OrderedDict((tp.source.name, TorchSize(tp.source.shape)) for tp in params)
                              for params in layout.sub_groups]
        shapes = self.ckpt.frozen_param_shapes
        if shapes:
            sd["frozen_param_fragments"] = OrderedDict((name, self._frozen(name, shape, rank)) for name, shape in shapes.items())
        return pickle_structure(sd)

    def _frozen(self, name: str, shape: tuple[int, ...], rank: int) -> NewTensor:
        """New rank ``rank``'s fragment of frozen parameter ``name``: the concatenation of the source
        ranks' fragments (the last one padded) cut at the new partition size, zero-padded."""
        numel = 1
        for d in shape:
            numel *= d
        pn = partition_numel(numel, self.layout.world_size)
        lo, hi = rank_range(rank, pn, numel)
        segs: list[Segment] = []
        # every source rank's fragment holds ceil(numel / source world) elements (the last padded):
        # source rank s's starts at s * src_pn in the concatenation
        src_pn = partition_numel(numel, self.ckpt.world_size)
        # rank 0's fragment at least (its dtype), then the ranks overlapping [lo, hi)
        span = range(lo // src_pn, min(self.ckpt.world_size, (hi - 1) // src_pn + 1)) if hi > lo else range(1)
        dtype = None
        for s in span:
            frag = (self._model(s).get("frozen_param_fragments") or {}).get(name)
            if not isinstance(frag, TensorRef) or not frag.is_contiguous() or frag.numel != src_pn:
                raise CheckpointError(f"{self.ckpt.model_files[s]}: frozen_param_fragments[{name!r}] is not a "
                                      f"contiguous tensor of {src_pn} elements (ceil({numel} / {self.ckpt.world_size})) "
                                      f"as rank 0's frozen_param_shapes needs: the rank files come from different saves")
            dtype = dtype or frag.dtype
            at = s * src_pn
            a, b = max(lo, at), min(hi, at + frag.numel)
            if b > a:
                assert frag.file_offset is not None and frag.path is not None
                segs.append(Segment(frag.path, frag.file_offset + (a - at) * frag.itemsize, (b - a) * frag.itemsize))
        assert dtype is not None
        if pn > hi - lo:
            segs.append(Segment(None, 0, (pn - (hi - lo)) * ITEMSIZE[dtype]))
        return NewTensor(dtype, pn, segs)
