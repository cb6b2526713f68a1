"""The estimate as plain data: one ``MemoryItem`` per allocation, totals per GPU and per host, the
verdict against the memory given; rendered as a rich table or JSON from the same object."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TextIO

from shardkit.core.errors import UsageError
from shardkit.core.render import console
from shardkit.estimate.bounds import GPUS_PER_NODE, MICRO_BATCH, SEQ_LEN, WORLD_SIZE, check_flag
from shardkit.estimate.units import human

Device = Literal["gpu", "host"]
Lifetime = Literal["held", "step", "init"]
CATEGORIES = ("parameters", "gradients", "fp32 masters", "optimizer state", "buffers", "activations")
MODEL_STATES = ("parameters", "gradients", "fp32 masters", "optimizer state")


@dataclass(frozen=True)
class RunShape:
    """The job around the model: how many ranks, how they sit on hosts, and the batch."""

    world_size: int = 1
    """Data-parallel ranks (one per GPU)."""
    gpus_per_node: int = 1
    """Ranks per host: host memory is per host, so it adds up this many ranks."""
    micro_batch: int = 1
    """Sequences per rank per forward (train_micro_batch_size_per_gpu)."""
    seq_len: int = 2048
    """Tokens per sequence."""
    activation_checkpointing: bool = False
    """Whether every decoder layer's activations are recomputed in backward (only its input kept)."""
    whole_model_init: bool = False
    """Every rank builds the whole model before the engine shards it (no ``deepspeed.zero.Init``, no meta-device
    init): the host holds it whole per rank, and DeepSpeed (engine.py ``_configure_distributed_model``) moves it
    whole, in 16 bits, to the GPU before partitioning."""

    def __post_init__(self) -> None:
        bounds = {"world_size": WORLD_SIZE, "gpus_per_node": GPUS_PER_NODE, "micro_batch": MICRO_BATCH, "seq_len": SEQ_LEN}
        for name, bound in bounds.items():
            check_flag(getattr(self, name), f"--{name.replace('_', '-')}", bound)
        if self.gpus_per_node > self.world_size:
            raise UsageError(
                f"--gpus-per-node {self.gpus_per_node} is more than --world-size {self.world_size}: a host cannot "
                f"hold more ranks than the job has. Use --gpus-per-node {self.world_size} or raise --world-size"
            )


@dataclass(frozen=True)
class MemoryItem:
    """One allocation of one rank, with where it lives, how long, and why it has this size."""

    id: str
    """Stable identifier (``z3.lp_partitions``), for tests and JSON readers."""
    name: str
    """What it is, in the engine's words (``16-bit parameter partitions (param.ds_tensor)``)."""
    category: str
    """One of CATEGORIES."""
    device: Device
    """gpu (the rank's accelerator) or host (CPU RAM)."""
    bytes: int
    """Bytes per rank."""
    lifetime: Lifetime = "held"
    """held: from initialize on, between steps too (optimizer state: from the first step); step: only
    during forward/backward/step; init: only while the engine is built (the caching allocator may keep it
    reserved afterwards)."""
    pinned: bool = False
    """Page-locked host memory (cannot be swapped; counted against ``ulimit -l``)."""
    how: str = ""
    """The formula with the numbers put in, and the config key that sets it."""
    estimate: bool = False
    """True for figures that are rules of thumb (activations), not read from the engine's code."""


@dataclass
class Estimate:
    """Memory of one rank and of one host for one model, engine config and run."""

    subject: str
    """Model, engine and run in one line."""
    engine: str
    """zero0 .. zero3 or fsdp2."""
    run: RunShape
    items: list[MemoryItem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Assumptions and defaults used, one sentence each."""
    gpu_memory: int | None = None
    """Usable bytes per GPU given with --gpu-memory (None: not judged)."""
    host_memory: int | None = None
    """Usable bytes per host given with --host-memory (None: not judged)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The settings the arithmetic used (engine knobs, defaults filled)."""

    def add(self, item: MemoryItem) -> None:
        if item.bytes:
            self.items.append(item)

    def _sum(self, device: Device, lifetimes: tuple[str, ...], categories: tuple[str, ...] = CATEGORIES) -> int:
        return sum(i.bytes for i in self.items
                   if i.device == device and i.lifetime in lifetimes and i.category in categories)

    def model_states(self, device: Device) -> int:
        """Parameters, gradients, fp32 masters and optimizer state of one rank held on ``device`` between
        steps (what the GPU recordings measure)."""
        return self._sum(device, ("held",), MODEL_STATES)

    def per_gpu_held(self) -> int:
        return self._sum("gpu", ("held",))

    def phase_peak(self, devices: tuple[str, ...], exclude: tuple[str, ...] = ()) -> int:
        """The larger of the two peaks on ``devices``: during a step (everything held plus what the step
        adds) and during initialize (what is held then, without the optimizer state, which torch's and
        DeepSpeed's optimizers create at the first step, plus what initialize adds). Items whose id is in
        ``exclude`` are left out."""
        def total(lifetime: str, categories: tuple[str, ...] = CATEGORIES) -> int:
            return sum(i.bytes for i in self.items if i.device in devices and i.lifetime == lifetime
                       and i.category in categories and i.id not in exclude)

        held = total("held")
        return max(held + total("step"), held - total("held", ("optimizer state",)) + total("init"))

    def per_gpu_peak(self) -> int:
        return self.phase_peak(("gpu",))

    def per_rank_host_peak(self) -> int:
        return self.phase_peak(("host",))

    def per_host_peak(self) -> int:
        """Host bytes of every rank on one host."""
        return self.run.gpus_per_node * self.per_rank_host_peak()

    def per_host_pinned(self) -> int:
        return self.run.gpus_per_node * sum(i.bytes for i in self.items if i.device == "host" and i.pinned)

    def fits_gpu(self) -> bool | None:
        return None if self.gpu_memory is None else self.per_gpu_peak() <= self.gpu_memory

    def fits_host(self) -> bool | None:
        return None if self.host_memory is None else self.per_host_peak() <= self.host_memory

    def fits(self) -> bool:
        return self.fits_gpu() is not False and self.fits_host() is not False

    def totals(self) -> dict[str, int]:
        return {
            "gpu_model_states_bytes": self.model_states("gpu"),
            "gpu_held_bytes": self.per_gpu_held(),
            "gpu_peak_bytes": self.per_gpu_peak(),
            "host_model_states_per_rank_bytes": self.model_states("host"),
            "host_peak_per_rank_bytes": self.per_rank_host_peak(),
            "host_peak_per_host_bytes": self.per_host_peak(),
            "host_pinned_per_host_bytes": self.per_host_pinned(),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "subject": self.subject,
            "engine": self.engine,
            "run": asdict(self.run),
            "settings": self.settings,
            "items": [asdict(i) for i in self.items],
            "totals": self.totals(),
            "gpu_memory_bytes": self.gpu_memory,
            "host_memory_bytes": self.host_memory,
            "fits_gpu": self.fits_gpu(),
            "fits_host": self.fits_host(),
            "fits": self.fits(),
            "notes": self.notes,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def verdict(self) -> str:
        """One line: the totals against the memory given."""
        parts = [f"per GPU {human(self.per_gpu_peak())} peak ({human(self.per_gpu_held())} held between steps)",
                 f"per host {human(self.per_host_peak())} ({self.run.gpus_per_node} rank(s), "
                 f"{human(self.per_host_pinned())} pinned)"]
        for label, fits, limit, used in (("GPU", self.fits_gpu(), self.gpu_memory, self.per_gpu_peak()),
                                         ("host", self.fits_host(), self.host_memory, self.per_host_peak())):
            if fits is not None and limit is not None:
                parts.append(f"{label}: {'fits' if fits else 'does NOT fit'} in {human(limit)} "
                             f"({100 * used / limit:.0f}%)")
        return "; ".join(parts)


_LIFETIME = {"held": "held", "step": "during step", "init": "at initialize"}


def print_estimate(est: Estimate, file: TextIO | None = None) -> None:
    """The items as a table (GiB per rank), then the totals, the verdict and the notes."""
    from rich.table import Table

    con = console(file)
    table = Table(title=est.subject, show_lines=False, expand=False)
    for col, justify in (("what", "left"), ("category", "left"), ("per GPU", "right"), ("host, per rank", "right"),
                         ("when", "left"), ("how", "left")):
        table.add_column(col, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for i in sorted(est.items, key=lambda i: (CATEGORIES.index(i.category), i.device, -i.bytes)):
        gpu, host = (human(i.bytes), "") if i.device == "gpu" else ("", human(i.bytes) + (" pinned" if i.pinned else ""))
        name = i.name + (" [estimate]" if i.estimate else "")
        table.add_row(name, i.category, gpu, host, _LIFETIME[i.lifetime], i.how)
    table.add_section()
    table.add_row("model states held (per rank)", "", human(est.model_states("gpu")), human(est.model_states("host")),
                  "held", "parameters + gradients + fp32 masters + optimizer state")
    table.add_row("peak per GPU / per rank on the host", "", human(est.per_gpu_peak()), human(est.per_rank_host_peak()),
                  "peak", "the larger of: held + the step's items; held without optimizer state + initialize's")
    table.add_row(f"per host ({est.run.gpus_per_node} rank(s))", "", "", human(est.per_host_peak()), "peak",
                  f"{human(est.per_host_pinned())} of it pinned")
    con.print(table)
    ok = est.fits()
    colour = "green" if ok else "red"
    con.print(f"[{colour}]{est.verdict()}[/{colour}]")
    for note in est.notes:
        con.print(f"note: {note}")
