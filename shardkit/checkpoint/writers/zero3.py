"""The ZeRO-3 writer: any ``TrainingCheckpoint`` with its optimizer state as the per-rank files a
DeepSpeed ZeRO-3 run at N ranks would have saved (0.19.8), for its plain ``engine.load_checkpoint``.

``RankStates`` builds each rank's two dicts in the key order DeepSpeed writes them and
``write_rank_files`` writes every file into a staging folder, one thread per rank file, hashed as
written:

- ``zero_pp_rank_{r}_mp_rank_00_model_states.pt``: ``module`` (an empty placeholder per parameter, as
  a partitioned ZeRO-3 module's ``state_dict`` holds them, and the buffers' values),
  ``buffer_names``, ``param_shapes`` (one ordered dict per sub-group), ``frozen_param_shapes``/
  ``frozen_param_fragments``, ``shared_params``, counters, ``ds_config``, ``ds_version``, client state;
- ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt``: ``DeepSpeedZeroOptimizer_Stage3.
  _rigid_state_dict``: the inner optimizer's ``state``/``param_groups`` (one entry per sub-group) and
  ``fp32_flat_groups``.

What goes where is decided before (``Zero3Target``, planned by ``ops.convert.to_zero3_plan``): the
sub-group layout at N ranks (``zero3.repartition.layout_of``: ``ceil(numel / N)`` elements per rank,
zero padding), the param groups in the resuming optimizer's format, one step per sub-group.
``_rigid_load_state_dict`` copies flat tensors without looking at names, so the layout order (the
param groups' order of parameters) is what makes the load right.

Two routes, decided once for the whole checkpoint (``RankStates.plain``):

- bytes (no torch import): every flat partition and frozen fragment is byte ranges of the source's
  pieces and zero runs (``NewTensor``), buffers and torch-format steps their one-piece source records
  (``TensorRef``); ``torch_pickle.pickle_structure`` writes the pickle torch.save would and
  ``write_torch_zip`` copies the ranges through one 1 MiB buffer;
- torch (casts: bf16 parameters for an fp32 run; tensors only a loader reads): the same dicts with
  ``LazyTensor``s, each slice read from its pieces (or its tensor's loader) when ``stream_save``
  reaches it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

from shardkit.checkpoint.model.checkpoint import FP32, TRAINING_DTYPES, TrainingCheckpoint
from shardkit.checkpoint.model.tensors import SourceTensor, contiguous_strides, read_slice
from shardkit.checkpoint.writers.dcp_format import is_plain
from shardkit.checkpoint.zero3.files import MODEL_FILE, OPTIM_FILE
from shardkit.checkpoint.zero3.layout import append_segment, partition_numel, rank_range
from shardkit.checkpoint.zero3.repartition import TargetLayout, read_fragment, read_partition
from shardkit.core import progress
from shardkit.core.errors import UsageError
from shardkit.platform.versions import package_version
from shardkit.storage.manifest import FileEntry
from shardkit.storage.pipeline import default_workers
from shardkit.storage.stream import LazyTensor, Segment, WrittenFile, stream_save, write_parallel
from shardkit.storage.torch_load import ITEMSIZE, TensorRef, TorchSize, deepspeed_stub
from shardkit.storage.torch_pickle import NewTensor, pickle_structure
from shardkit.storage.torch_zip import write_torch_zip

ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")

ZERO_STAGE = "deepspeed.runtime.zero.config.ZeroStageEnum"
LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler.LossScaler"


@dataclass
class TargetOptimizer:
    """The optimizer the resuming DeepSpeed engine builds, as far as its checkpoint format goes."""

    name: str
    """'FusedAdam', 'DeepSpeedCPUAdam' or 'torch' (a client torch optimizer or ``torch_adam``)."""
    adam_w_mode: bool
    """Decoupled weight decay (AdamW) or L2 (Adam)."""
    step_as_tensor: bool
    """torch keeps ``step`` as a float32 tensor; DeepSpeed's Adams as a Python int."""


@dataclass
class DeepSpeedTarget:
    """What the files of a DeepSpeed run (ZeRO-3 here, ZeRO-1/2 in ``writers.zero12``) record of the run that
    resumes them, decided before the first one is written."""

    opt: TargetOptimizer
    groups: list[dict[str, Any]]
    """The inner optimizer's param groups in ``opt``'s format (``params`` filled by the writer)."""
    global_steps: int
    counters: dict[str, Any]
    """DeepSpeed's counters (and scheduler state) for the model-states files."""
    client: dict[str, Any]
    """The source's client state, written into the model-states files."""
    cfg: dict[str, Any]
    """What is recorded as ``ds_config``: the given config, or a minimal one."""
    precision: str
    """'bf16' or 'fp32' ('fp16' for a ZeRO-1/2 ``same_run``): the optim files' names and the module's dtype
    (ZeRO-3: the frozen fragments')."""
    names: dict[str, str]
    """Source name -> the name the resuming engine's module has, where it changes (``module.``)."""


@dataclass
class Zero3Target(DeepSpeedTarget):
    """The ZeRO-3 files to write (``ops.convert.to_zero3_plan``)."""

    layout: TargetLayout
    sub_steps: list[tuple[int, SourceTensor | None]]
    """Each sub-group's Adam step: the count, and the source's 0-dim record of it where there is one."""


def rank_file_workers(ranks: Sequence[int], byte_ranges: bool) -> int:
    """Threads writing ``ranks``' files at once by default: byte-range copies release the GIL
    (preadv, crc32, blake3/sha256, write), so one per rank file (reshard's rule); tensors that need
    torch are produced one at a time (``byte_ranges`` False: one thread)."""
    return default_workers(max(1, len(ranks))) if byte_ranges else 1


def write_rank_file(obj: dict[str, Any], path: Path, plain: bool) -> WrittenFile:
    """One rank file: the bytes route's stand-ins through ``pickle_structure`` (no torch), else ``stream_save``."""
    if plain:
        return write_torch_zip(path, *pickle_structure(obj))
    return stream_save(obj, path)


def write_rank_files(folder: Path, out: RankStates, outcome: str, workers: int | None = None,
                     ranks: Sequence[int] | None = None) -> list[FileEntry]:
    """The optim and model-states file of every rank of ``out`` (or of ``ranks``: this process's
    share) written into the staging folder ``folder`` by ``workers`` threads (default
    ``rank_file_workers``); the files written, for the manifest."""
    prefix = "bf16_" if out.target.precision == "bf16" else ""
    if ranks is None:
        ranks = range(out.layout.world_size)
    # optim files first (the large ones), so the small model files fill the gaps at the end
    files: list[tuple[str, Callable[[], dict[str, Any]]]] = (
        [(OPTIM_FILE.format(prefix=prefix, rank=r), partial(out.optim_states, r)) for r in ranks]
        + [(MODEL_FILE.format(rank=r), partial(out.model_states, r)) for r in ranks])
    if workers is None:
        workers = rank_file_workers(ranks, out.byte_ranges)
    progress.expect(out.tensor_bytes(ranks))  # the progress line's total, known before the first byte

    # hashed as written (the manifest needs no second read), fsynced by the thread that wrote
    # it; the first failure cancels the files not yet started (stream.write_parallel)
    def job(produce: Callable[[], dict[str, Any]]) -> Callable[[Path], Any]:
        return lambda path: write_rank_file(produce(), path, out.plain)

    digests = write_parallel([(folder / name, job(produce)) for name, produce in files],
                             workers, outcome=outcome, thread_name="shardkit-convert")
    return [FileEntry.of(name, d.size, d.algorithm, d.digest) for (name, _), d in zip(files, digests)]


def tensor_segments(t: SourceTensor, lo: int, hi: int) -> list[Segment] | None:
    """Elements ``[lo, hi)`` of ``t`` as byte ranges of its pieces (only those holding them: a ZeRO-3 source's
    are computed, not scanned); None when a loader holds it."""
    if t.load is not None:
        return None
    size = ITEMSIZE[t.dtype]
    return [Segment(str(p.file), p.offset, p.numel * size) for p in t.pieces_in(lo, hi)]


def flat_segments(layout: TargetLayout, j: int, rank: int, tensor: Callable[[str], SourceTensor],
                  dtype: str | None = None) -> list[Segment] | None:
    """Rank ``rank``'s flat tensor of sub-group ``j`` (both ZeRO-3 writers): each parameter's elements of
    ``tensor(name)`` as byte ranges of its pieces, then the parameter's zero padding, adjacent ranges merged;
    None where a tensor is held by a loader or is not of ``dtype`` (when given)."""
    segments: list[Segment] = []
    for tp in layout.sub_groups[j]:
        t = tensor(tp.source.name)
        lo, hi = tp.rank_range(rank)
        got = tensor_segments(t, lo, hi) if dtype is None or t.dtype == dtype else None
        if got is None:
            return None
        for seg in got:
            append_segment(segments, seg.path, seg.offset, seg.nbytes)
        if tp.partition_numel > hi - lo:
            append_segment(segments, None, 0, (tp.partition_numel - (hi - lo)) * ITEMSIZE[t.dtype])
    return segments


def fragment_segments(t: SourceTensor, rank: int, world_size: int) -> list[Segment] | None:
    """Rank ``rank``'s ZeRO-3 fragment of the frozen parameter ``t`` (``ceil(numel / world_size)`` elements,
    the last rank's tail zero) as byte ranges of its pieces; None when a loader holds it."""
    pn = partition_numel(t.numel, world_size)
    lo, hi = rank_range(rank, pn, t.numel)
    segments = tensor_segments(t, lo, hi)
    if segments is not None and pn > hi - lo:
        segments.append(Segment(None, 0, (pn - (hi - lo)) * ITEMSIZE[t.dtype]))
    return segments


def new_flat(layout: TargetLayout, j: int, rank: int, tensor: Callable[[str], SourceTensor], dtype: str,
             plain: bool) -> NewTensor | LazyTensor:
    """Rank ``rank``'s flat tensor of sub-group ``j`` in ``dtype`` (both ZeRO-3 writers), produced when it is
    written: byte ranges of the source and zero runs where ``plain`` and every slice is ``dtype`` there (copied
    through one 1 MiB buffer, never built), else read and cast (``repartition.read_partition``)."""
    segments = flat_segments(layout, j, rank, tensor, dtype)
    numel = layout.sub_group_numel(j)
    if plain and segments is not None:
        return NewTensor(dtype, numel, segments)
    import torch  # lazy: the torch route only

    to = getattr(torch, dtype)
    return LazyTensor(numel, to, partial(read_partition, layout, rank, j, tensor, to),
                      segments=(lambda: segments) if segments is not None else None)


def new_fragment(t: SourceTensor, rank: int, world_size: int, dtype: str, plain: bool) -> NewTensor | LazyTensor:
    """Rank ``rank``'s ZeRO-3 fragment of the frozen parameter ``t`` in ``dtype`` (``ceil(numel / N)`` elements, the
    last rank's tail zero), produced when it is written: byte ranges where ``plain`` and the source holds it in
    ``dtype`` (a LoRA model whose weights are mostly frozen converts at the peak memory of a fully trained one),
    else its slice read and cast (``repartition.read_fragment``)."""
    pn = partition_numel(t.numel, world_size)
    segments = fragment_segments(t, rank, world_size) if t.dtype == dtype else None
    if plain and segments is not None:
        return NewTensor(dtype, pn, segments)
    import torch  # lazy: the torch route only

    to = getattr(torch, dtype)
    return LazyTensor(pn, to, partial(read_fragment, t, world_size, rank, to),
                      segments=(lambda: segments) if segments is not None else None)


def _whole_ref(t: SourceTensor, key: str) -> TensorRef | None:
    """``t`` stored whole as one piece (a buffer, an Adam step) as a record ``torch_pickle`` copies."""
    if t.load is not None or len(t.pieces) != 1 or t.dtype not in ITEMSIZE:
        return None
    p = t.pieces[0]
    ref = TensorRef(key, t.dtype, 0, t.shape, contiguous_strides(t.shape))
    ref.path, ref.file_offset, ref.record_offset, ref.record_nbytes = str(p.file), p.offset, p.offset, p.numel * ITEMSIZE[t.dtype]
    return ref


class RankStates:
    """Each output rank's two dicts, in the key order DeepSpeed 0.19.8 writes them (see module doc
    for the two routes; ``plain`` says which, decided here from the checkpoint's pieces)."""

    def __init__(self, ckpt: TrainingCheckpoint, target: Zero3Target):
        self.ckpt, self.target, self.layout, self.opt = ckpt, target, target.layout, target.opt
        # the release the files say wrote them, read without importing DeepSpeed (1.2 s here)
        ds_version = package_version("deepspeed")
        if ds_version is None:
            raise UsageError("DeepSpeed is not installed in this environment, and the ZeRO-3 files record the DeepSpeed "
                             "release that loads them (ds_version); install the release the resuming run uses "
                             "(pip install 'deepspeed==X') and convert again")
        self.ds_version = ds_version
        self.module_dtype = TRAINING_DTYPES[target.precision]
        names = target.names
        self.name: Callable[[str], str] = lambda n: names.get(n, n)
        self.frozen = [n for n in ckpt.weights if n in ckpt.frozen]
        self.buffers = [n for n in ckpt.weights if n in ckpt.buffers]
        owners: dict[int, list[int]] = {}
        for j, g in enumerate(self.layout.sub_group_param_group):
            owners.setdefault(g, []).append(j)
        self.groups = [{**group, "params": owners.get(g, [])} for g, group in enumerate(target.groups)]
        self.buffer_refs = {n: _whole_ref(ckpt.weights[n], n) for n in self.buffers}
        self.not_byte_ranges = self._first_not_byte_ranges()
        """The first source tensor that is not byte ranges in the files' dtype, and why (empty when all are)."""
        self.byte_ranges = not self.not_byte_ranges
        self.plain = self.byte_ranges and self._rest_plain()
        """The bytes route: nothing in the files needs torch (module doc)."""
        # a partitioned ZeRO-3 module's state_dict holds an empty tensor per parameter, buffers whole
        buffers = self._buffers()
        self.module: OrderedDict[str, Any] = OrderedDict(
            (self.name(n), buffers[n] if n in ckpt.buffers else self._empty()) for n in [*ckpt.weights, *ckpt.aliases])
        self.param_shapes = [OrderedDict((self.name(tp.source.name), TorchSize(tp.source.shape)) for tp in sub)
                             for sub in self.layout.sub_groups]

    @property
    def torch_route_reason(self) -> str | None:
        """Why the torch route was taken (for the result's notes), None on the bytes route."""
        if self.plain:
            return None
        if not self.byte_ranges:
            return f"not every fp32 partition or frozen fragment is byte ranges of the source: {self.not_byte_ranges}"
        return "buffers, Adam steps or param-group values are not stored as plain records"

    def _first_not_byte_ranges(self) -> str:
        wanted = [(self.ckpt.tensor(tp.source.name, key), "float32")
                  for sub in self.layout.sub_groups for tp in sub for key in (FP32, *ADAM_STATE_KEYS)]
        wanted += [(self.ckpt.weights[n], self.module_dtype) for n in self.frozen]
        for t, dtype in wanted:
            if t.load is not None:
                return f"{t.name} is read through a loader (its stored chunks are not byte ranges)"
            if t.dtype != dtype:
                return f"{t.name} is {t.dtype}, the ZeRO-3 files hold it as {dtype} (a cast)"
        return ""

    def _rest_plain(self) -> bool:
        steps_ok = not self.opt.step_as_tensor or all(
            s is not None and _whole_ref(s, "step") is not None for _, s in self.target.sub_steps)
        groups_ok = all(is_plain(v) for g in self.groups for v in g.values())
        return steps_ok and groups_ok and all(ref is not None for ref in self.buffer_refs.values())

    def _buffers(self) -> dict[str, Any]:
        if self.plain:
            return dict(self.buffer_refs)
        return {n: read_slice(self.ckpt.weights[n], 0, self.ckpt.weights[n].numel).reshape(self.ckpt.weights[n].shape)
                for n in self.buffers}

    def _empty(self) -> Any:
        if self.plain:
            return NewTensor(self.module_dtype, 0, ())
        import torch  # lazy: the torch route only

        return torch.empty(0, dtype=getattr(torch, self.module_dtype))

    def tensor_bytes(self, ranks: Sequence[int]) -> int:
        """About how many bytes ``ranks``' files will hold: their flat fp32 masters and Adam moments and
        their frozen fragments (the pickles, zip headers and buffers are small beside them)."""
        n = self.layout.world_size
        flat = sum(self.layout.sub_group_numel(j) for j in range(len(self.layout.sub_groups)))
        frozen = sum(partition_numel(self.ckpt.weights[f].numel, n) for f in self.frozen)
        return len(ranks) * (flat * 4 * (1 + len(ADAM_STATE_KEYS)) + frozen * ITEMSIZE[self.module_dtype])

    def model_states(self, rank: int) -> dict[str, Any]:
        """``DeepSpeedEngine._common_checkpoint_state`` (+ client state, last, as ``state.update``)."""
        t, n = self.target, self.layout.world_size
        sd: dict[str, Any] = dict(
            module=self.module, buffer_names=[self.name(b) for b in self.buffers], optimizer=None,
            param_shapes=self.param_shapes,
            frozen_param_shapes=OrderedDict((self.name(f), TorchSize(self.ckpt.weights[f].shape)) for f in self.frozen),
            shared_params={self.name(a): self.name(o) for a, o in self.ckpt.aliases.items()},
            frozen_param_fragments=OrderedDict((self.name(f), new_fragment(self.ckpt.weights[f], rank, n, self.module_dtype,
                                                                           self.plain)) for f in self.frozen),
            lr_scheduler=t.counters.get("lr_scheduler"), data_sampler=None, random_ltd=None,
            skipped_steps=t.counters.get("skipped_steps", 0), global_steps=t.global_steps)
        if "global_samples" in t.counters:
            sd["global_samples"] = t.counters["global_samples"]
        sd.update(dp_world_size=n, mp_world_size=1, checkpoint_parallel_dimensions={"pp_degree": 1, "tp_degree": 1},
                  ds_config=t.cfg, ds_version=self.ds_version, **t.client)
        return sd

    def optim_states(self, rank: int) -> dict[str, Any]:
        """``_save_zero_checkpoint``'s dict around ``DeepSpeedZeroOptimizer_Stage3._rigid_state_dict``,
        with the flat tensors produced only when they are written."""
        layout = self.layout
        state: dict[int, dict[str, Any]] = {}
        for j in range(len(layout.sub_groups)):
            count, raw = self.target.sub_steps[j]
            st: dict[str, Any] = {"step": self._step_tensor(count, raw, j) if self.opt.step_as_tensor else count}
            for key in ADAM_STATE_KEYS:
                st[key] = new_flat(layout, j, rank, partial(self.ckpt.tensor, key=key), "float32", self.plain)
            state[j] = st
        osd = {
            # DeepSpeed's ZeroStageEnum.weights and LossScaler(1.0), written as they pickle (no import)
            "zero_stage": deepspeed_stub(ZERO_STAGE, 3),
            "loss_scaler": deepspeed_stub(LOSS_SCALER, cur_scale=1.0, dynamic=False),  # bf16/fp32: a static 1 (fp16 is refused)
            "dynamic_loss_scale": False,
            "overflow": False,
            "partition_count": layout.world_size,
            "optimizer_state_dict": {"state": state, "param_groups": self.groups},
            "fp32_flat_groups": [new_flat(layout, j, rank, partial(self.ckpt.tensor, key=FP32), "float32", self.plain)
                                 for j in range(len(layout.sub_groups))],
        }
        return {"optimizer_state_dict": osd, "ds_config": self.target.cfg, "ds_version": self.ds_version}

    def _step_tensor(self, count: int, raw: SourceTensor | None, j: int) -> Any:
        """Sub-group ``j``'s torch-format ``step``: the source's 0-dim record, its own storage per sub-group."""
        ref = _whole_ref(raw, f"{raw.name}@sub_group{j}") if raw is not None and self.plain else None
        if ref is not None:
            return ref
        import torch  # lazy: the torch route only

        return torch.tensor(float(count), dtype=getattr(torch, raw.dtype if raw is not None else "float32"))
