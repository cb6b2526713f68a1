"""Writing the ZeRO-3 rank files of ``convert_dcp_to_zero3`` into the staging folder:
``RankStates`` builds each rank's two dicts in the key order DeepSpeed 0.19.8 writes them and
``write_rank_files`` writes every file, one thread per rank file, hashed as written.

Two routes, decided once for the whole source (``RankStates.plain``):

- bytes (the usual one; no torch import): every flat partition and frozen fragment is byte ranges
  of the ``.distcp`` files and zero runs (``NewTensor``), buffers and Adam steps are the source's
  own records (``TensorRef``), shapes ``TorchSize``; ``torch_pickle.pickle_structure`` writes the
  pickle torch.save would and ``write_torch_zip`` copies the ranges through one 1 MiB buffer;
- torch (casts: bf16 DCP parameters for an fp32 run; chunk layouts ``DcpSlices`` does not take):
  the same dicts with ``LazyTensor``s, the tensors that are not byte ranges cut from ``dcp.load``ed
  tensors (``_partition``) when ``stream_save`` reaches them.

Both write the same bytes for the same source (tests/test_convert_names_precision.py).
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from shardkit.checkpoint.dcp.plain_metadata import TensorMeta
from shardkit.checkpoint.ops.convert.dcp_to_zero3_plan import TargetOptimizer
from shardkit.checkpoint.ops.convert.dcp_to_zero3_source import DcpSource, SourcePlan, StepValue
from shardkit.checkpoint.ops.convert.names import ADAM_STATE_KEYS, MODEL_KEY, OPTIM_KEY
from shardkit.checkpoint.writers.dcp_format import is_plain
from shardkit.checkpoint.zero3.files import MODEL_FILE, OPTIM_FILE
from shardkit.checkpoint.zero3.layout import partition_numel, rank_range
from shardkit.checkpoint.zero3.repartition import TargetLayout
from shardkit.core import progress
from shardkit.core.errors import UsageError
from shardkit.platform.versions import package_version
from shardkit.storage.manifest import FileEntry
from shardkit.storage.pipeline import default_workers
from shardkit.storage.stream import LazyTensor, Segment, WrittenFile, stream_save, write_parallel
from shardkit.storage.torch_load import TensorRef, TorchSize, deepspeed_stub
from shardkit.storage.torch_pickle import NewTensor, pickle_structure
from shardkit.storage.torch_zip import write_torch_zip

if TYPE_CHECKING:
    import torch

FP32 = "fp32"
"""Pseudo state key: the fp32 masters (the FSDP2 parameters themselves)."""

ZERO_STAGE = "deepspeed.runtime.zero.config.ZeroStageEnum"
LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler.LossScaler"

BATCH_BYTES = 64 * 2**20
"""Full source tensors read per ``dcp.load`` call while a partition is produced (bounds memory)."""


def rank_file_workers(ranks: Sequence[int], byte_ranges: bool) -> int:
    """Threads writing ``ranks``' files at once by default: byte-range copies release the GIL
    (preadv, crc32, blake3/sha256, write), so one per rank file (reshard's rule); tensors that need
    dcp.load are produced one at a time (``byte_ranges`` False: one thread)."""
    return default_workers(max(1, len(ranks))) if byte_ranges else 1


def write_rank_file(obj: dict[str, Any], path: Path, plain: bool) -> WrittenFile:
    """One rank file: the bytes route's stand-ins through ``pickle_structure`` (no torch), else ``stream_save``."""
    if plain:
        return write_torch_zip(path, *pickle_structure(obj))
    return stream_save(obj, path)


def write_rank_files(folder: Path, out: RankStates, precision: str, outcome: str,
                     workers: int | None = None, ranks: Sequence[int] | None = None) -> list[FileEntry]:
    """The optim and model-states file of every rank of ``out`` (or of ``ranks``: this process's
    share) written into the staging folder ``folder`` (``bf16_`` optim file names for a bf16 run)
    by ``workers`` threads (default ``rank_file_workers``); the files written, for the manifest."""
    prefix = "bf16_" if precision == "bf16" else ""
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


class RankStates:
    """Each output rank's two dicts, in the key order DeepSpeed 0.19.8 writes them (see module doc
    for the two routes; ``plain`` says which, decided here from the source's layout and items)."""

    def __init__(self, *, src: DcpSource, plan: SourcePlan, layout: TargetLayout, opt: TargetOptimizer,
                 groups: list[dict[str, Any]], sub_steps: list[tuple[int, StepValue]], precision: str,
                 global_steps: int, counters: dict[str, Any], client: dict[str, Any], cfg: dict[str, Any],
                 names: dict[str, str] | None = None):
        self.src, self.plan, self.layout, self.opt, self.sub_steps = src, plan, layout, opt, sub_steps
        self.global_steps, self.counters, self.client, self.cfg = global_steps, counters, client, cfg
        # the release the files say wrote them, read without importing DeepSpeed (1.2 s here)
        ds_version = package_version("deepspeed")
        if ds_version is None:
            raise UsageError("DeepSpeed is not installed in this environment, and the ZeRO-3 files record the DeepSpeed "
                             "release that loads them (ds_version); install the release the resuming run uses "
                             "(pip install 'deepspeed==X') and convert again")
        self.ds_version = ds_version
        self.module_dtype = "bfloat16" if precision == "bf16" else "float32"
        # source FQN -> the name the resuming engine's module has (``module.`` added or removed:
        # ``dcp_to_zero3_plan.target_names``); the DCP keys are always read under the source's
        names = names or {}
        self.name: Callable[[str], str] = lambda fqn: names.get(fqn, fqn)
        owners: dict[int, list[int]] = {}
        for j, g in enumerate(layout.sub_group_param_group):
            owners.setdefault(g, []).append(j)
        self.groups = [{**group, "params": owners.get(g, [])} for g, group in enumerate(groups)]
        self.buffer_refs = {n: src.slices.tensor_ref(f"{MODEL_KEY}.{n}") for n in plan.buffers}
        self.not_byte_ranges = self._first_not_byte_ranges()
        """The first source tensor that is not byte ranges, and why (empty when all are)."""
        self.byte_ranges = not self.not_byte_ranges
        """Every flat partition and frozen fragment is byte ranges (several threads may write)."""
        self.plain = self.byte_ranges and self._rest_plain()
        """The bytes route: nothing in the files needs torch (module doc)."""
        params = {p.fqn for p in plan.trainable} | {p.fqn for p in plan.frozen} | set(plan.aliases)
        buffers = self._buffers()
        # a partitioned ZeRO-3 module's state_dict holds an empty tensor per parameter, buffers whole
        self.module: OrderedDict[str, Any] = OrderedDict(
            (self.name(n), self._empty() if n in params else buffers[n]) for n in plan.model_keys)
        self.param_shapes = [OrderedDict((self.name(tp.source.name), TorchSize(tp.source.shape)) for tp in sub)
                             for sub in layout.sub_groups]

    @property
    def torch_route_reason(self) -> str | None:
        """Why the torch route was taken (for the result's notes), None on the bytes route."""
        if self.plain:
            return None
        if not self.byte_ranges:
            return f"not every fp32 partition or frozen fragment is byte ranges of the .distcp files: {self.not_byte_ranges}"
        return "buffers, Adam steps or param-group values are not stored as plain records"

    def _first_not_byte_ranges(self) -> str:
        """The first source tensor whose partitions or fragments are not byte ranges, and why; empty
        when all are. Decided per source tensor (float32 and readable by ``DcpSlices``, frozen ones in
        the module's dtype), not by walking ranks x tensors."""
        wanted = [(_source_key(tp.source.name, key), "float32")
                  for tp in (tp for sub in self.layout.sub_groups for tp in sub) for key in (FP32, *ADAM_STATE_KEYS)]
        wanted += [(f"{MODEL_KEY}.{p.fqn}", self.module_dtype) for p in self.plan.frozen]
        for key, dtype in wanted:
            meta: TensorMeta | None = self.src.tensor_meta(key)
            if meta is None:
                return f"{key} is not a tensor in the .metadata"
            if meta.dtype != dtype:
                return f"{key} is {meta.dtype}, the ZeRO-3 files hold it as {dtype} (a cast)"
            if self.src.slices.chunks(key) is None:
                return (f"{key}'s stored chunks are not dim-0 slabs in plain zip records (a layout the direct reader "
                        "does not take)")
        return ""

    def _rest_plain(self) -> bool:
        """Buffers and steps are records to copy, param-group values plain data: the files need no torch."""
        steps_ok = not self.opt.step_as_tensor or all(raw.ref is not None for _, raw in self.sub_steps)
        groups_ok = all(is_plain(v) for g in self.groups for k, v in g.items())
        return steps_ok and groups_ok and all(ref is not None for ref in self.buffer_refs.values())

    def _buffers(self) -> dict[str, Any]:
        if self.plain:
            return dict(self.buffer_refs)
        loaded = self.src.load([f"{MODEL_KEY}.{n}" for n in self.plan.buffers]) if self.plan.buffers else {}
        return {n: loaded[f"{MODEL_KEY}.{n}"] for n in self.plan.buffers}

    def _empty(self) -> Any:
        if self.plain:
            return NewTensor(self.module_dtype, 0, ())
        import torch

        return torch.empty(0, dtype=getattr(torch, self.module_dtype))

    def tensor_bytes(self, ranks: Sequence[int]) -> int:
        """About how many bytes ``ranks``' files will hold: their flat fp32 masters and Adam moments and
        their frozen fragments (the pickles, zip headers and buffers are small beside them)."""
        n = self.layout.world_size
        flat = sum(self.layout.sub_group_numel(j) for j in range(len(self.layout.sub_groups)))
        frozen = sum(partition_numel(p.numel, n) for p in self.plan.frozen)
        return len(ranks) * (flat * 4 * (1 + len(ADAM_STATE_KEYS)) + frozen * (2 if self.module_dtype == "bfloat16" else 4))

    def model_states(self, rank: int) -> dict[str, Any]:
        """``DeepSpeedEngine._common_checkpoint_state`` (+ client state, last, as ``state.update``)."""
        plan, n = self.plan, self.layout.world_size
        sd: dict[str, Any] = dict(
            module=self.module, buffer_names=[self.name(b) for b in plan.buffers], optimizer=None,
            param_shapes=self.param_shapes,
            frozen_param_shapes=OrderedDict((self.name(p.fqn), TorchSize(p.shape)) for p in plan.frozen),
            shared_params={self.name(a): self.name(o) for a, o in plan.aliases.items()},
            frozen_param_fragments=OrderedDict(
                (self.name(fqn), fragment) for fqn, fragment in self.frozen_fragments(rank).items()),
            lr_scheduler=self.counters.get("lr_scheduler"), data_sampler=None, random_ltd=None,
            skipped_steps=self.counters["skipped_steps"], global_steps=self.global_steps)
        if "global_samples" in self.counters:
            sd["global_samples"] = self.counters["global_samples"]
        sd.update(dp_world_size=n, mp_world_size=1, checkpoint_parallel_dimensions={"pp_degree": 1, "tp_degree": 1},
                  ds_config=self.cfg, ds_version=self.ds_version, **self.client)
        return sd

    def optim_states(self, rank: int) -> dict[str, Any]:
        """``_save_zero_checkpoint``'s dict around ``DeepSpeedZeroOptimizer_Stage3._rigid_state_dict``,
        with the flat tensors produced only when they are written."""
        layout = self.layout
        state: dict[int, dict[str, Any]] = {}
        for j in range(len(layout.sub_groups)):
            count, raw = self.sub_steps[j]
            st: dict[str, Any] = {"step": self._step_tensor(raw, j) if self.opt.step_as_tensor else count}
            for key in ADAM_STATE_KEYS:
                st[key] = self._flat(j, rank, key)
            state[j] = st
        osd = {
            # DeepSpeed's ZeroStageEnum.weights and LossScaler(1.0), written as they pickle (no import)
            "zero_stage": deepspeed_stub(ZERO_STAGE, 3),
            "loss_scaler": deepspeed_stub(LOSS_SCALER, cur_scale=1.0, dynamic=False),  # bf16/fp32: a static 1 (fp16 is refused)
            "dynamic_loss_scale": False,
            "overflow": False,
            "partition_count": layout.world_size,
            "optimizer_state_dict": {"state": state, "param_groups": self.groups},
            "fp32_flat_groups": [self._flat(j, rank, FP32) for j in range(len(layout.sub_groups))],
        }
        return {"optimizer_state_dict": osd, "ds_config": self.cfg, "ds_version": self.ds_version}

    def _step_tensor(self, raw: StepValue, j: int) -> Any:
        """Sub-group ``j``'s torch-format ``step``: the source's 0-dim tensor, its own storage per sub-group."""
        if self.plain and raw.ref is not None:
            src = raw.ref
            ref = TensorRef(f"{src.key}@sub_group{j}", src.dtype, src.storage_offset, (), ())
            ref.path, ref.file_offset = src.path, src.file_offset
            ref.record_offset, ref.record_nbytes = src.record_offset, src.record_nbytes
            return ref
        import torch

        return torch.tensor(raw.count, dtype=getattr(torch, raw.dtype or "float32"))

    def frozen_fragments(self, rank: int) -> OrderedDict[str, Any]:
        """Rank ``rank``'s fragment of each frozen parameter, built when asked (a process keeps no
        ranks x frozen-parameters table: under srun/torchrun it writes only its share of the ranks).

        Frozen parameters are never loaded whole: each rank's fragment is byte ranges of the
        .distcp file where the dtype already is the module's (so a LoRA model whose weights are
        mostly frozen converts at the peak memory of a fully trained one), else its slice read and
        cast when the file is written."""
        return OrderedDict((p.fqn, self._frozen_fragment(p.fqn, p.numel, rank)) for p in self.plan.frozen)

    def _frozen_fragment(self, fqn: str, numel: int, rank: int) -> Any:
        """Rank ``rank``'s ZeRO-3 fragment of the frozen parameter ``fqn`` (``ceil(numel/N)``
        elements in the module's dtype, the last rank's tail zero), produced only when written."""
        key = f"{MODEL_KEY}.{fqn}"
        pn = partition_numel(numel, self.layout.world_size)
        lo, hi = rank_range(rank, pn, numel)
        meta = self.src.tensor_meta(key)
        chunks = self.src.slices.chunks(key) if hi > lo else []
        segments: list[Segment] | None = None
        if meta is not None and chunks is not None and meta.dtype == self.module_dtype:
            size = 2 if self.module_dtype == "bfloat16" else 4
            segments = []
            for ch in chunks:
                a, b = max(lo, ch.start), min(hi, ch.start + ch.numel)
                if b > a:
                    segments.append(Segment(str(ch.file), ch.data_offset + (a - ch.start) * size, (b - a) * size))
            if pn > hi - lo:
                segments.append(Segment(None, 0, (pn - (hi - lo)) * size))
        if self.plain and segments is not None:
            return NewTensor(self.module_dtype, pn, segments)
        import torch

        src, dtype = self.src, getattr(torch, self.module_dtype)

        def produce() -> "torch.Tensor":
            out = torch.zeros(pn, dtype=getattr(torch, meta.dtype) if meta is not None else torch.float32)
            if hi > lo and not src.slices.read_into(key, lo, out.narrow(0, 0, hi - lo)):
                # a layout the slice reader does not take: this one tensor whole, then its slice
                out.narrow(0, 0, hi - lo).copy_(src.load([key])[key].reshape(-1)[lo:hi])
            return out.to(dtype)

        return LazyTensor(pn, dtype, produce, segments=(lambda: segments) if segments is not None else None)

    def _flat(self, j: int, rank: int, key: str) -> Any:
        """Rank ``rank``'s flat ``key`` tensor of sub-group ``j``, written later: byte ranges of the
        ``.distcp`` files and zero runs when every slice is float32 there (copied through one 1 MiB
        buffer, never built), else produced by ``_partition``."""
        segments: list[Segment] = []
        readable = True
        for tp in self.layout.sub_groups[j]:
            lo, hi = tp.rank_range(rank)
            source = _source_key(tp.source.name, key)
            chunks = self.src.slices.chunks(source) if hi > lo else []
            meta = self.src.tensor_meta(source)
            if chunks is None or meta is None or meta.dtype != "float32":
                readable = False
                break
            for ch in chunks:
                a, b = max(lo, ch.start), min(hi, ch.start + ch.numel)
                if b > a:
                    segments.append(Segment(str(ch.file), ch.data_offset + (a - ch.start) * 4, (b - a) * 4))
            if tp.partition_numel > hi - lo:
                segments.append(Segment(None, 0, (tp.partition_numel - (hi - lo)) * 4))
        numel = self.layout.sub_group_numel(j)
        if self.plain and readable:
            return NewTensor("float32", numel, segments)
        import torch

        return LazyTensor(numel, torch.float32, _producer(self.src, self.layout, j, rank, key),
                          segments=(lambda: segments) if readable else None)


def _producer(src: DcpSource, layout: TargetLayout, j: int, rank: int, key: str) -> Callable[[], "torch.Tensor"]:
    return lambda: _partition(src, layout, j, rank, key)


def _partition(src: DcpSource, layout: TargetLayout, j: int, rank: int, key: str) -> "torch.Tensor":
    """Rank ``rank``'s flat ``key`` tensor (fp32) of sub-group ``j``: each parameter's
    ``ceil(numel / N)`` slice in layout order, the last rank's tail zero-padded. Slices are read
    straight from the files (``DcpSlices``); tensors it cannot read so are loaded whole through
    ``load_dcp_state`` in batches."""
    import torch

    params = layout.sub_groups[j]
    out = torch.empty(layout.sub_group_numel(j), dtype=torch.float32)
    batch: list[Any] = []
    size = 0

    def flush() -> None:
        keys = [_source_key(tp.source.name, key) for tp in batch]
        loaded = src.load(keys)
        for tp, k in zip(batch, keys):
            lo, hi = tp.rank_range(rank)
            out.narrow(0, tp.offset, hi - lo).copy_(loaded[k].reshape(-1)[lo:hi])
        batch.clear()

    for tp in params:
        lo, hi = tp.rank_range(rank)
        out.narrow(0, tp.offset + (hi - lo), tp.partition_numel - (hi - lo)).zero_()
        if hi > lo and not src.slices.read_into(_source_key(tp.source.name, key), lo, out.narrow(0, tp.offset, hi - lo)):
            batch.append(tp)
            size += tp.source.numel * 4
            if size >= BATCH_BYTES:
                flush()
                size = 0
    if batch:
        flush()
    return out


def _source_key(fqn: str, key: str) -> str:
    return f"{MODEL_KEY}.{fqn}" if key == FP32 else f"{OPTIM_KEY}.state.{fqn}.{key}"
