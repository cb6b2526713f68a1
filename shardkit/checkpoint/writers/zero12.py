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
the whole padded to a multiple of ``2 * N`` and cut into N equal partitions; ``zero12.repartition.GroupLayout``
(the reshard's) computes the partitions. The optimizer files are written without torch where every fp32
master and moment is float32 byte ranges of the source (``NewTensor``: source ranges plus zero runs); else
each partition is read and cast through torch when written (``LazyTensor``). The model-states file is
built with torch: its module tensors are shaped, and in bf16 they are the masters cast as DeepSpeed casts them.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.model.tensors import SourceTensor
from shardkit.checkpoint.writers.zero3 import (
    ADAM_STATE_KEYS,
    LOSS_SCALER,
    ZERO_STAGE,
    TargetOptimizer,
    read_slice,
    tensor_segments,
)
from shardkit.checkpoint.zero12.reader import MODEL_FILE
from shardkit.checkpoint.zero12.repartition import FRAGMENT_ADDRESS, GroupLayout
from shardkit.core import progress
from shardkit.core.errors import UsageError
from shardkit.platform.versions import package_version
from shardkit.storage.manifest import FileEntry
from shardkit.storage.pipeline import default_workers
from shardkit.storage.stream import LazyTensor, Segment, WrittenFile, stream_save, write_parallel
from shardkit.storage.torch_load import TorchSize, deepspeed_stub
from shardkit.storage.torch_pickle import NewTensor, pickle_structure
from shardkit.storage.torch_zip import write_torch_zip

if TYPE_CHECKING:
    import torch

OPTIM_FILE = "{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
_MODULE_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass
class Zero12Target:
    """The ZeRO-1/2 files to write, decided before the first one is (``ops.convert.to_zero12``)."""

    stage: int
    """1 (optimizer states partitioned) or 2 (and gradients: frozen parameters are recorded)."""
    world_size: int
    precision: str
    """'fp32' or 'bf16': the module's dtype and the optim files' names."""
    opt: TargetOptimizer
    groups: list[dict[str, Any]]
    """The inner optimizer's param groups in ``opt``'s format (``params`` filled by the writer)."""
    group_params: list[list[str]]
    """Each group's trainable parameters (source names), in the flat buffer's order."""
    steps: list[int]
    """Each group's Adam step (DeepSpeed keeps one per flat partition)."""
    parameter_alignment: bool
    """``zero_optimization.parameter_alignment``: each parameter padded to 16 bytes in the flat buffer."""
    global_steps: int
    counters: dict[str, Any]
    client: dict[str, Any]
    cfg: dict[str, Any]
    """What is recorded as ``ds_config``."""
    names: dict[str, str]
    """Source name -> the resuming engine's module name, where it changes."""
    clip_grad: float = 0.0


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
        paddings.append(pad)
        offset += pad
    return GroupLayout(offset, params, [], 0), paddings


class Zero12Files:
    """Each output file's dict, in the key order DeepSpeed 0.19 writes it (module doc)."""

    def __init__(self, ckpt: TrainingCheckpoint, target: Zero12Target):
        ds_version = package_version("deepspeed")
        if ds_version is None:
            raise UsageError("DeepSpeed is not installed in this environment, and the ZeRO-1/2 files record the "
                             "DeepSpeed release that loads them (ds_version); install the release the resuming run "
                             "uses (pip install 'deepspeed==X') and convert again")
        self.ckpt, self.target, self.ds_version = ckpt, target, ds_version
        self.world = target.world_size
        laid = [group_layout(target, ckpt, g) for g in range(len(target.group_params))]
        self.layouts = [layout for layout, _ in laid]
        self.param_paddings = [pads for _, pads in laid]
        self.name: Callable[[str], str] = lambda n: target.names.get(n, n)
        self.not_byte_ranges = self._first_not_byte_ranges()
        """The first master or moment that is not float32 byte ranges of the source, and why (empty when all are)."""
        self.plain = not self.not_byte_ranges and not target.opt.step_as_tensor
        """The optim files are written without torch (module doc)."""
        self.prefix = "bf16_" if target.precision == "bf16" else ""

    def _tensor(self, name: str, key: str) -> SourceTensor:
        return self.ckpt.weights[name] if key == "fp32" else self.ckpt.optimizer[name][key]

    def _first_not_byte_ranges(self) -> str:
        for names in self.target.group_params:
            for name in names:
                for key in ("fp32", *ADAM_STATE_KEYS):
                    t = self._tensor(name, key)
                    if t.load is not None:
                        return f"{t.name} is read through a loader (its stored chunks are not byte ranges)"
                    if t.dtype != "float32":
                        return f"{t.name} is {t.dtype}, the ZeRO-1/2 files hold it as float32 (a cast)"
        return ""

    @property
    def torch_route_reason(self) -> str | None:
        if self.plain:
            return None
        return self.not_byte_ranges or "the resuming optimizer keeps step as a tensor (torch's Adam)"

    def file_names(self) -> list[str]:
        return [OPTIM_FILE.format(prefix=self.prefix, rank=r) for r in range(self.world)] + [MODEL_FILE]

    def tensor_bytes(self) -> int:
        """About how many bytes the files will hold: every rank's partitions of masters and moments, the module."""
        flat = sum(layout.new_partition(self.world) for layout in self.layouts) * self.world
        module = sum(t.numel for t in self.ckpt.weights.values()) * (4 if self.target.precision == "fp32" else 2)
        return flat * 4 * (1 + len(ADAM_STATE_KEYS)) + module

    # --- one rank's optimizer file ------------------------------------------------------------------

    def _flat(self, g: int, rank: int, key: str, total: int) -> Any:
        """Elements [start, end) of group ``g``'s flat buffer of ``key`` on ``rank``, then zeros to ``total``."""
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
            parts.append((self._tensor(name, key), lo - offset, hi - offset))
            pos = hi
        if total > pos - start:
            parts.append(total - (pos - start))
        if self.plain:
            segs: list[Segment] = []
            for part in parts:
                if isinstance(part, int):
                    segs.append(Segment(None, 0, part * 4))
                else:
                    got = tensor_segments(*part)
                    assert got is not None  # plain: every tensor is byte ranges (_first_not_byte_ranges)
                    segs.extend(got)
            return NewTensor("float32", total, segs)
        import torch  # lazy: the torch route only

        def produce() -> "torch.Tensor":
            out = [torch.zeros(p, dtype=torch.float32) if isinstance(p, int) else read_slice(*p).float()
                   for p in parts]
            return torch.cat(out) if out else torch.zeros(0, dtype=torch.float32)
        return LazyTensor(total, torch.float32, produce)

    def _step(self, g: int) -> Any:
        count = self.target.steps[g]
        if not self.target.opt.step_as_tensor:
            return count
        import torch  # lazy: torch's Adam keeps step as a float32 tensor

        return torch.tensor(float(count), dtype=torch.float32)

    def optim_states(self, rank: int) -> dict[str, Any]:
        """``_save_zero_checkpoint``'s dict around ``DeepSpeedZeroOptimizer.state_dict()`` for ``rank``."""
        state: dict[int, dict[str, Any]] = {}
        fp32, paddings, mappings = [], [], []
        for g, layout in enumerate(self.layouts):
            size = layout.new_partition(self.world)
            start, end = layout.new_range(self.world, rank)
            state[g] = {"step": self._step(g), **{k: self._flat(g, rank, k, size) for k in ADAM_STATE_KEYS}}
            fp32.append(self._flat(g, rank, "fp32", end - start))
            paddings.append(size - (end - start))
            mapping: OrderedDict[str, Any] = OrderedDict()
            for name, offset, numel in layout.params:
                lo, hi = max(start, offset), min(end, offset + numel)
                if lo < hi:
                    mapping[self.name(name)] = deepspeed_stub(FRAGMENT_ADDRESS, numel=hi - lo, start=lo - start)
            mappings.append(mapping)
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
        ckpt, t = self.ckpt, self.target
        dtype = _MODULE_DTYPE[t.precision]
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


def write_files(folder: Path, files: Zero12Files, outcome: str, workers: int | None = None) -> list[FileEntry]:
    """Every rank's optimizer file and the model-states file, written into the staging folder ``folder``
    (hashed as written, fsynced; the first failure cancels the rest); the entries for the manifest."""
    def optim_job(rank: int) -> Callable[[Path], WrittenFile]:
        def write(out: Path) -> WrittenFile:
            if files.plain:  # no torch: the pickle torch.save would write, tensors as source byte ranges
                return write_torch_zip(out, *pickle_structure(files.optim_states(rank)))
            return stream_save(files.optim_states(rank), out)
        return write

    def model_job(out: Path) -> WrittenFile:
        return stream_save(files.model_states(), out)

    jobs: list[tuple[str, Callable[[Path], WrittenFile]]] = [
        (OPTIM_FILE.format(prefix=files.prefix, rank=r), optim_job(r)) for r in range(files.world)]
    jobs.append((MODEL_FILE, model_job))
    if workers is None:
        # byte-range copies release the GIL: one thread per file; tensors built by torch one at a time
        workers = default_workers(len(jobs)) if files.plain else 1
    progress.expect(files.tensor_bytes())
    digests = write_parallel([(folder / name, job) for name, job in jobs], workers, outcome=outcome,
                             thread_name="shardkit-convert")
    return [FileEntry.of(name, d.size, d.algorithm, d.digest) for (name, _), d in zip(jobs, digests)]
