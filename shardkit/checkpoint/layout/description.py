"""A checkpoint described without reading its tensors: the plain record ``shardkit inspect`` prints,
``--json`` dumps and ``support`` judges. One reader per format fills it in."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint


@dataclass(frozen=True)
class Refusal:
    """Something in a checkpoint that no shardkit command converts correctly today."""

    marker: str
    """What gave it away, as found: a key (``ds_autoep_layers``), a file name pattern or a folder."""
    where: str
    """The file or folder holding the marker."""
    why: str
    """What converting it anyway would lose."""
    fix: str
    """Where to go instead."""

    def message(self) -> str:
        return f"{self.where}: {self.marker}: {self.why}. {self.fix}"


@dataclass
class CheckpointDescription:
    """What one checkpoint is, from its small files (model states, metadata, pickled structures)."""

    path: str
    """The path the user gave."""
    folder: str
    """The folder whose files were read (a DeepSpeed tag folder, a DCP folder, a Trainer checkpoint-N)."""
    format: str
    """'deepspeed', 'deepspeed-universal', 'dcp', 'fsdp1' or 'hf-model'."""
    layout: str
    """The layout in words: 'DeepSpeed ZeRO-2', 'FSDP1 LOCAL_STATE_DICT (per-rank files)' ..."""
    stage: int | None = None
    """ZeRO stage (DeepSpeed only; from the optimizer files' zero_stage, else the saved config)."""
    stage_source: str | None = None
    """Where the stage was read: 'zero_stage in <optim file>', 'zero_optimization.stage in <model file>'."""
    state_dict_type: str | None = None
    """FSDP's fsdp_state_dict_type for accelerate's FSDP files."""
    world_size: int | None = None
    """Ranks that wrote it (dp_world_size, .distcp files, rank files); None where the files do not tell."""
    precision: str | None = None
    """Training precision ('bf16', 'fp16', 'fp32') where the files record it."""
    dtypes: dict[str, str] = field(default_factory=dict)
    """Role ('weights', 'fp32 masters', 'optimizer state') -> dtype, as stored."""
    parameters: int | None = None
    """Number of named parameter tensors (trainable and frozen)."""
    elements: int | None = None
    """Their total number of elements."""
    optimizer: str | None = None
    """The optimizer as recorded (ds_config optimizer.type, or 'saved' when only its state tells)."""
    optimizer_state_keys: list[str] = field(default_factory=list)
    """Per-parameter state the optimizer keeps (exp_avg, exp_avg_sq, step ...)."""
    step: int | None = None
    """Training step at save time (global_steps, the Trainer's global_step)."""
    offload: str | None = None
    """zero_optimization.offload_optimizer.device at save time (DeepSpeed)."""
    files: int = 0
    """Files in the folder read (recursively)."""
    size_bytes: int = 0
    """Their size on disk."""
    manifest: str = "absent"
    """'absent', 'sizes match' (digests not checked: `shardkit verify` does) or 'fails: <first problem>'."""
    trainer_folder: str | None = None
    """The Hugging Face Trainer checkpoint-N wrapping it, if any."""
    refusals: list[Refusal] = field(default_factory=list)
    """What no command converts correctly (AutoEP, MoE experts, tensor/pipeline parallel, NVMe)."""
    notes: list[str] = field(default_factory=list)
    """What else the user should know (a Trainer output_dir resolved to its newest checkpoint ...)."""
    reader_kind: str | None = None
    """The ``readers.registry`` kind that fills in what the small files do not say (parameters, dtypes,
    optimizer state, step of accelerate's torch.save layouts); None where the files say it all."""

    def fill_from(self, ckpt: TrainingCheckpoint) -> None:
        """Parameters, dtypes, optimizer state and step from the checkpoint model its reader built (from
        pickled structures: shapes, dtypes, offsets; no tensor byte), where the small files left them unsaid."""
        params = {n: t for n, t in ckpt.weights.items() if n not in ckpt.buffers}
        self.parameters, self.elements = len(params), sum(t.numel for t in params.values())
        if params:
            self.dtypes["weights"] = ", ".join(sorted({t.dtype for t in params.values()}))
        states = {k: t for per in ckpt.optimizer.values() for k, t in per.items()}
        steps = ckpt.scalars.get("step")
        if states:
            self.optimizer_state_keys = sorted({*states, *(["step"] if steps else [])})
        moments = {t.dtype for t in states.values() if t.numel > 1}
        if moments:
            self.dtypes["optimizer state"] = ", ".join(sorted(moments))
        # Adam's per-parameter step is the training step when every parameter took the same number of steps
        values = set(steps.values()) if isinstance(steps, dict) else set()
        if self.step is None and len(values) == 1:
            (value,) = values
            if isinstance(value, (int, float)) and float(value).is_integer():
                self.step = int(value)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
