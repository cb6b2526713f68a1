"""The ZeRO-1/2 writer: any ``TrainingCheckpoint`` with its optimizer state as the files a DeepSpeed
ZeRO-1 or ZeRO-2 run at N data-parallel ranks would have saved (0.19), for its plain
``engine.load_checkpoint``:

- ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt``: ``engine._save_zero_checkpoint``'s dict around
  ``DeepSpeedZeroOptimizer.state_dict`` (``runtime/zero/stage_1_and_2.py``): per param group the rank's
  slice of the flat fp32 buffer without its padding (``single_partition_of_fp32_groups``), torch's
  ``base_optimizer_state`` of the one flat partition per group (moments *with* their padding, zeroed),
  ``group_paddings``, ``param_alignment_paddings``, ``partition_count``, ``param_slice_mappings``, the
  stage and a static loss scaler;
- ``mp_rank_00_model_states.pt``: ``engine._save_checkpoint``'s dict: the whole module in the training
  dtype, ``param_shapes`` per group, frozen parameters (ZeRO-2 records them), tied names, counters,
  ``ds_config``, ``ds_version``, client state.

The flat layout is DeepSpeed's (``DeepSpeedZeroOptimizer.__init__``): a group's parameters in order, each
but the last followed by its alignment padding (``zero_optimization.parameter_alignment``, off by default),
the whole padded to a multiple of ``2 * N`` and cut into N equal partitions (``GroupLayout``). The optimizer
files are written without torch where every fp32 master and moment is byte ranges of the source in the
dtype written (``NewTensor``: source ranges plus zero runs); else each partition is read and cast through
torch when written (``LazyTensor``). The model-states file is built with torch: its module tensors are
shaped, and in bf16 they are the masters cast as DeepSpeed casts them.

A ``SameRun`` target is the source run itself at another world size (``shardkit reshard``): the files are the
source's own rank-0 optimizer dict and model-states dict, key for key (loss scaler with fp16's dynamic
state, clip_grad, param groups verbatim, ``step`` and any other per-group value as saved, every per-element
state in its own dtype, client state, ``ds_config``, ``ds_version``), with only what the world size decides
replaced: the flat partitions, ``group_paddings``, ``partition_count``, ``param_slice_mappings`` and
``dp_world_size``. Both files are written without torch then (module tensors copied as stored).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from shardkit.checkpoint.model.checkpoint import FP32, TRAINING_DTYPES, TrainingCheckpoint
from shardkit.checkpoint.model.tensors import SourceTensor, read_slice
from shardkit.checkpoint.writers.zero3 import ADAM_STATE_KEYS, LOSS_SCALER, ZERO_STAGE, DeepSpeedTarget, tensor_segments
from shardkit.checkpoint.zero3.files import OPTIM_FILE
from shardkit.checkpoint.zero3.layout import append_segment
from shardkit.checkpoint.zero12.files import MODEL_FILE, OPTIMIZER_KEY, tensor_from_ref
from shardkit.core import progress
from shardkit.core.errors import UsageError
from shardkit.platform.versions import package_version
from shardkit.storage.manifest import FileEntry
from shardkit.storage.pipeline import default_workers
from shardkit.storage.stream import LazyTensor, Segment, WrittenFile, stream_save, write_parallel
from shardkit.storage.torch_load import ITEMSIZE, TensorRef, TorchSize, deepspeed_stub
from shardkit.storage.torch_pickle import NewTensor, pickle_structure
from shardkit.storage.torch_zip import RecordData, write_torch_zip

if TYPE_CHECKING:
    import torch

#: DeepSpeed's ``nccl_start_alignment_factor``: a group's flat buffer is padded to a multiple of this x world size.
ALIGNMENT_FACTOR = 2
FRAGMENT_ADDRESS = "deepspeed.utils.tensor_fragment.fragment_address"


@dataclass(frozen=True)
class GroupLayout:
    """One param group's flat buffer: its length without tail padding, and where each parameter sits in it."""

    numel: int
    """Elements of the buffer before the tail padding (parameters and their alignment paddings)."""
    params: list[tuple[str, int, int]]
    """(name, offset in the buffer, numel), in buffer order."""

    def new_partition(self, world_size: int) -> int:
        align = ALIGNMENT_FACTOR * world_size
        return math.ceil(self.numel / align) * align // world_size

    def new_range(self, world_size: int, rank: int) -> tuple[int, int]:
        """[start, end) of the buffer that new ``rank`` holds (end - start may be 0 on a last rank)."""
        size = self.new_partition(world_size)
        start = min(rank * size, self.numel)
        return start, min(start + size, self.numel)


@dataclass(frozen=True)
class SameRun:
    """The source run's own dicts, for a target that is that run at another world size (module doc)."""

    optim_file: dict[str, Any]
    """Rank 0's optimizer file as ``read_structure`` parsed it (tensors as ``TensorRef``s)."""
    model_states: dict[str, Any]
    """The model-states file as parsed: written back with ``dp_world_size`` replaced, its records copied."""
    prefix: str
    """The optimizer files' ``bf16_`` prefix as the source named them."""
    param_paddings: list[list[int]]
    """The source's ``param_alignment_paddings`` (independent of the world size), kept as they are."""
    flat_keys: list[list[str]] = field(default_factory=list)
    """Per group, the per-element optimizer states (``exp_avg``... any a custom optimizer keeps): each becomes
    the new partition in its own dtype; the group's other values (``step``...) are rank 0's."""


@dataclass
class Zero12Target(DeepSpeedTarget):
    """The ZeRO-1/2 files to write (``ops.convert.to_zero12``, or a reshard's ``same_run``)."""

    stage: int
    """1 (optimizer states partitioned) or 2 (and gradients: frozen parameters are recorded)."""
    world_size: int
    group_params: list[list[str]]
    """Each group's trainable parameters (source names), in the flat buffer's order."""
    steps: list[int]
    """Each group's Adam step (DeepSpeed keeps one per flat partition)."""
    parameter_alignment: bool
    """``zero_optimization.parameter_alignment``: each parameter padded to 16 bytes in the flat buffer."""
    clip_grad: float = 0.0
    same_run: SameRun | None = None
    """The source run's own dicts, written back key for key (the reshard); None for another run's files."""


def group_layout(target: Zero12Target, ckpt: TrainingCheckpoint, g: int) -> tuple[GroupLayout, list[int]]:
    """Group ``g``'s flat buffer (DeepSpeed's ``round_robin_bit16_padding``/``offsets``) and its per-parameter paddings."""
    itemsize = 4 if target.precision == "fp32" else 2
    align = 16 // math.gcd(16, itemsize) if target.parameter_alignment else 1
    params, paddings, offset = [], [], 0
    names = target.group_params[g]
    for i, name in enumerate(names):
        numel = ckpt.weights[name].numel
        params.append((name, offset, numel))
        offset += numel
        pad = 0 if i == len(names) - 1 else (-offset) % align
        if target.same_run is not None:
            pad = int(target.same_run.param_paddings[g][i])  # the source's own, last one included
        paddings.append(pad)
        offset += pad
    return GroupLayout(offset, params), paddings


class Zero12Files:
    """Each output file's dict, in the key order DeepSpeed 0.19 writes it (module doc)."""

    def __init__(self, ckpt: TrainingCheckpoint, target: Zero12Target):
        same = target.same_run
        # a same run keeps the release that wrote it; another run records the one installed here
        ds_version = same.optim_file.get("ds_version") if same is not None else package_version("deepspeed")
        if same is None and ds_version is None:
            raise UsageError("DeepSpeed is not installed in this environment, and the ZeRO-1/2 files record the "
                             "DeepSpeed release that loads them (ds_version); install the release the resuming run "
                             "uses (pip install 'deepspeed==X') and convert again")
        self.ckpt, self.target, self.ds_version = ckpt, target, ds_version
        self.world = target.world_size
        laid = [group_layout(target, ckpt, g) for g in range(len(target.group_params))]
        self.layouts = [layout for layout, _ in laid]
        self.param_paddings = [pads for _, pads in laid]
        self.name: Callable[[str], str] = lambda n: target.names.get(n, n)
        self.flat_keys = same.flat_keys if same is not None else [list(ADAM_STATE_KEYS)] * len(self.layouts)
        self.not_byte_ranges = self._first_not_byte_ranges()
        """The first master or moment that is not float32 byte ranges of the source, and why (empty when all are)."""
        self.plain = not self.not_byte_ranges and (same is not None or not target.opt.step_as_tensor)
        """The optim files are written without torch (module doc)."""
        self.prefix = same.prefix if same is not None else ("bf16_" if target.precision == "bf16" else "")

    def _dtype(self, g: int, key: str) -> str:
        """The element type group ``g``'s flat ``key`` is written in: float32, or a same run's own."""
        names = self.target.group_params[g]
        if self.target.same_run is None or key == FP32 or not names:
            return "float32"
        return self.ckpt.tensor(names[0], key).dtype

    def _first_not_byte_ranges(self) -> str:
        for g, names in enumerate(self.target.group_params):
            for name in names:
                for key in (FP32, *self.flat_keys[g]):
                    t, dtype = self.ckpt.tensor(name, key), self._dtype(g, key)
                    if t.load is not None:
                        return f"{t.name} is read through a loader (its stored chunks are not byte ranges)"
                    if t.dtype != dtype:
                        return f"{t.name} is {t.dtype}, the ZeRO-1/2 files hold it as {dtype} (a cast)"
        return ""

    @property
    def torch_route_reason(self) -> str | None:
        if self.plain:
            return None
        return self.not_byte_ranges or "the resuming optimizer keeps step as a tensor (torch's Adam)"

    def optim_bytes(self) -> int:
        """About how many bytes one rank's optimizer file holds: its partitions of masters and states."""
        return sum(layout.new_partition(self.world) * sum(ITEMSIZE[self._dtype(g, k)] for k in (FP32, *self.flat_keys[g]))
                   for g, layout in enumerate(self.layouts))

    def model_bytes(self) -> int:
        """About how many bytes the model-states file holds (a same run's: the source's file)."""
        if self.target.same_run is not None:
            return (self.ckpt.folder / MODEL_FILE).stat().st_size
        return sum(t.numel for t in self.ckpt.weights.values()) * (4 if self.target.precision == "fp32" else 2)

    def tensor_bytes(self) -> int:
        """About how many bytes the files will hold: every rank's partitions of masters and moments, the module."""
        return self.optim_bytes() * self.world + self.model_bytes()

    # --- one rank's optimizer file ------------------------------------------------------------------

    def _flat(self, g: int, rank: int, key: str, total: int) -> Any:
        """Elements [start, end) of group ``g``'s flat buffer of ``key`` on ``rank``, then zeros to ``total``
        (in ``_dtype``: float32, or a same run's own)."""
        layout = self.layouts[g]
        start, end = layout.new_range(self.world, rank)
        parts: list[tuple[SourceTensor, int, int] | int] = []  # (tensor, lo, hi) or a run of zero elements
        pos = start
        for name, offset, numel in layout.params:
            lo, hi = max(start, offset), min(end, offset + numel)
            if lo >= hi:
                continue
            if lo > pos:
                parts.append(lo - pos)
            parts.append((self.ckpt.tensor(name, key), lo - offset, hi - offset))
            pos = hi
        if total > pos - start:
            parts.append(total - (pos - start))
        dtype = self._dtype(g, key)
        if self.plain:
            segs: list[Segment] = []
            for part in parts:
                got = [Segment(None, 0, part * ITEMSIZE[dtype])] if isinstance(part, int) else tensor_segments(*part)
                assert got is not None  # plain: every tensor is byte ranges (_first_not_byte_ranges)
                for seg in got:
                    # neighbours in the buffer are neighbours in a source rank's file: one read, not one per parameter
                    append_segment(segs, seg.path, seg.offset, seg.nbytes)
            return NewTensor(dtype, total, segs)
        import torch  # lazy: the torch route only

        to = getattr(torch, dtype)

        def produce() -> "torch.Tensor":
            out = [torch.zeros(p, dtype=to) if isinstance(p, int) else read_slice(*p).to(to) for p in parts]
            return torch.cat(out) if out else torch.zeros(0, dtype=to)
        return LazyTensor(total, to, produce)

    def _step(self, g: int) -> Any:
        count = self.target.steps[g]
        if not self.target.opt.step_as_tensor:
            return count
        import torch  # lazy: torch's Adam keeps step as a float32 tensor

        return torch.tensor(float(count), dtype=torch.float32)

    def _partitions(self, rank: int) -> dict[str, Any]:
        """What the world size decides in ``rank``'s optimizer dict: per group, the flat states (padded partitions)
        and the unpadded fp32 slice, its padding, the parameters' slice mappings; the partition count."""
        flats: list[dict[str, Any]] = []
        fp32, paddings, mappings = [], [], []
        for g, layout in enumerate(self.layouts):
            size = layout.new_partition(self.world)
            start, end = layout.new_range(self.world, rank)
            flats.append({k: self._flat(g, rank, k, size) for k in self.flat_keys[g]})
            fp32.append(self._flat(g, rank, FP32, end - start))
            paddings.append(size - (end - start))
            mapping: OrderedDict[str, Any] = OrderedDict()
            for name, offset, numel in layout.params:
                lo, hi = max(start, offset), min(end, offset + numel)
                if lo < hi:
                    mapping[self.name(name)] = deepspeed_stub(FRAGMENT_ADDRESS, numel=hi - lo, start=lo - start)
            mappings.append(mapping)
        return {"flats": flats, "single_partition_of_fp32_groups": fp32, "group_paddings": paddings,
                "partition_count": [self.world] * len(self.layouts), "param_slice_mappings": mappings}

    def _same_run_optim_states(self, same: SameRun, rank: int) -> dict[str, Any]:
        """Rank 0's optimizer file, key for key, with ``rank``'s partitions in place (module doc)."""
        new = self._partitions(rank)
        osd = dict(same.optim_file[OPTIMIZER_KEY])  # the source's keys, in its order
        base = osd["base_optimizer_state"]
        state = {}
        for g, flats in enumerate(new.pop("flats")):
            param_id = base["param_groups"][g]["params"][0]
            state[param_id] = {k: flats.get(k, v) for k, v in base["state"].get(param_id, {}).items()}
        osd["base_optimizer_state"] = {"state": state, "param_groups": base["param_groups"]}
        osd.update(new)
        out = dict(same.optim_file)
        out[OPTIMIZER_KEY] = osd
        return out if self.plain else _with_torch_tensors(out)

    def optim_states(self, rank: int) -> dict[str, Any]:
        """``_save_zero_checkpoint``'s dict around ``DeepSpeedZeroOptimizer.state_dict()`` for ``rank``."""
        if self.target.same_run is not None:
            return self._same_run_optim_states(self.target.same_run, rank)
        new = self._partitions(rank)
        state = {g: {"step": self._step(g), **flats} for g, flats in enumerate(new["flats"])}
        fp32, paddings, mappings = new["single_partition_of_fp32_groups"], new["group_paddings"], new["param_slice_mappings"]
        groups = [{**group, "params": [g]} for g, group in enumerate(self.target.groups)]
        osd: dict[str, Any] = {
            # DeepSpeed's LossScaler(1.0) and ZeroStageEnum, written as they pickle (no import): bf16/fp32 keep a
            # static scale of 1 (fp16 targets are refused when planning)
            "loss_scaler": deepspeed_stub(LOSS_SCALER, cur_scale=1.0, dynamic=False),
            "dynamic_loss_scale": False,
            "overflow": False,
            "clip_grad": self.target.clip_grad,
            "base_optimizer_state": {"state": state, "param_groups": groups},
            "single_partition_of_fp32_groups": fp32,
            "zero_stage": deepspeed_stub(ZERO_STAGE, self.target.stage),
            "group_paddings": paddings,
            "param_alignment_paddings": [list(p) for p in self.param_paddings],
            "partition_count": [self.world] * len(self.layouts),
            "ds_version": self.ds_version,
            "param_slice_mappings": mappings,
        }
        return {"optimizer_state_dict": osd, "ds_config": self.target.cfg, "ds_version": self.ds_version}

    # --- the model-states file ----------------------------------------------------------------------

    def _module_tensor(self, name: str, dtype: str) -> "torch.Tensor":
        import torch  # lazy: the model-states file is built with torch (module doc)

        t = self.ckpt.weights[name]
        value = read_slice(t, 0, t.numel).reshape(t.shape)
        # DeepSpeed's bit16 parameters are copy_() of the fp32 masters: the same round-to-nearest cast
        return value.to(getattr(torch, dtype)).clone() if str(value.dtype).removeprefix("torch.") != dtype else value.clone()

    def model_states(self) -> dict[str, Any]:
        """``DeepSpeedEngine._save_checkpoint``'s dict (client state last, as ``state.update``)."""
        if self.target.same_run is not None:
            model = dict(self.target.same_run.model_states)  # the source's keys, in its order
            model["dp_world_size"] = self.world  # engine._load_zero_checkpoint compares it with the world size
            return model
        ckpt, t = self.ckpt, self.target
        dtype = TRAINING_DTYPES[t.precision]
        module: OrderedDict[str, Any] = OrderedDict()
        for n, src in ckpt.weights.items():
            # trainable and frozen parameters in the training dtype; buffers as saved
            module[self.name(n)] = self._module_tensor(n, dtype if n not in ckpt.buffers else src.dtype)
        for alias, holder in ckpt.aliases.items():
            module[self.name(alias)] = module[self.name(holder)]  # tied: one storage, as state_dict() has it
        frozen = [n for n in ckpt.weights if n in ckpt.frozen]
        sd: dict[str, Any] = dict(
            module=module, buffer_names=[self.name(b) for b in ckpt.weights if b in ckpt.buffers], optimizer=None,
            param_shapes=[OrderedDict((self.name(n), TorchSize(ckpt.weights[n].shape)) for n in names)
                          for names in t.group_params],
            # DeepSpeed records frozen parameters when gradients are partitioned (stage 2), not under ZeRO-1
            frozen_param_shapes=(OrderedDict((self.name(f), TorchSize(ckpt.weights[f].shape)) for f in frozen)
                                 if t.stage == 2 else None),
            shared_params={self.name(a): self.name(o) for a, o in ckpt.aliases.items()},
            frozen_param_fragments=(OrderedDict((self.name(f), module[self.name(f)]) for f in frozen)
                                    if t.stage == 2 else None),
            lr_scheduler=t.counters.get("lr_scheduler"), data_sampler=None, random_ltd=None,
            skipped_steps=t.counters.get("skipped_steps", 0),
            global_steps=t.global_steps, global_samples=t.counters.get("global_samples", 0),
            dp_world_size=self.world, mp_world_size=1,
            checkpoint_parallel_dimensions={"pp_degree": 1, "tp_degree": 1}, ds_config=t.cfg, ds_version=self.ds_version, **t.client)
        return sd


def _with_torch_tensors(obj: Any) -> Any:
    """``obj`` with each ``TensorRef`` read as a torch tensor (the torch route of a same run: ``stream_save``
    pickles torch tensors and ``LazyTensor``s, not the parsed records)."""
    if isinstance(obj, TensorRef):
        return tensor_from_ref(obj).clone()
    if isinstance(obj, dict):
        return type(obj)((k, _with_torch_tensors(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_with_torch_tensors(v) for v in obj)
    return obj


@dataclass(frozen=True)
class FileJob:
    """One output file: its name, about how many bytes it holds (what shares are balanced on), its writer."""

    name: str
    nbytes: int
    write: Callable[[Path], WrittenFile]
    contents: Callable[[], tuple[bytes, list[tuple[str, RecordData]]]] | None = None
    """The file as ``data.pkl`` + records (source byte ranges) where it is written without torch, for a caller that
    writes several files at once (``stream.write_interleaved``); None where torch builds it."""


def file_jobs(files: Zero12Files) -> list[FileJob]:
    """Every rank's optimizer file (the large ones, first), then the model-states file; each job writes its file
    (hashed as written, fsynced by ``torch_zip``) without torch where ``files.plain`` (and, for a same run, the
    model states always), else through ``stream_save``."""
    def optim_contents(rank: int) -> Callable[[], tuple[bytes, list[tuple[str, RecordData]]]] | None:
        # no torch: the pickle torch.save would write, tensors as source byte ranges
        return (lambda: pickle_structure(files.optim_states(rank))) if files.plain else None

    def model_contents() -> tuple[bytes, list[tuple[str, RecordData]]]:
        return pickle_structure(files.model_states())  # a same run's: the source's records copied as stored

    def job(name: str, nbytes: int, plain: Callable[[], tuple[bytes, list[tuple[str, RecordData]]]] | None,
            built: Callable[[], dict[str, Any]]) -> FileJob:
        def write(out: Path) -> WrittenFile:
            return write_torch_zip(out, *plain()) if plain is not None else stream_save(built(), out)
        return FileJob(name, nbytes, write, plain)

    jobs = [job(OPTIM_FILE.format(prefix=files.prefix, rank=r), files.optim_bytes(), optim_contents(r),
                partial(files.optim_states, r)) for r in range(files.world)]
    jobs.append(job(MODEL_FILE, files.model_bytes(), model_contents if files.target.same_run is not None else None,
                    files.model_states))
    return jobs


def write_files(folder: Path, files: Zero12Files, outcome: str, workers: int | None = None) -> list[FileEntry]:
    """Every rank's optimizer file and the model-states file, written into the staging folder ``folder``
    (hashed as written, fsynced; the first failure cancels the rest); the entries for the manifest."""
    jobs = file_jobs(files)
    if workers is None:
        # byte-range copies release the GIL: one thread per file; tensors built by torch one at a time
        workers = default_workers(len(jobs)) if files.plain else 1
    progress.expect(files.tensor_bytes())
    digests = write_parallel([(folder / j.name, j.write) for j in jobs], workers, outcome=outcome,
                             thread_name="shardkit-convert")
    return [FileEntry.of(j.name, d.size, d.algorithm, d.digest) for j, d in zip(jobs, digests)]
