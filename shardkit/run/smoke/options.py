"""What `shardkit smoke` runs: its options (:class:`SmokeOptions`) and each engine's config.

The config is a preset shipped in the package, the user's ``--config`` (checked to fit the engine)
or a generated one; :func:`fit_config` makes any of them runnable at the smoke's world size and
batch without changing what it tests.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Literal

from shardkit.config.loading import config_kind, load_config
from shardkit.config.paths import get, strip_auto
from shardkit.config.view import deepspeed_view
from shardkit.core.errors import UsageError

Engine = Literal["zero3", "fsdp2"]
ENGINES: tuple[Engine, ...] = ("zero3", "fsdp2")

# Presets shipped in the package (shardkit/ds_configs/ links to the checkout's ds_configs/ and is
# package data, so an installed wheel has them too); the first one present wins, generated configs
# otherwise.
PRESET_CANDIDATES: dict[str, tuple[str, ...]] = {
    "zero3": ("zero3.json",),
    "fsdp2": ("fsdp2_full_shard.json",),
}


@dataclass
class SmokeOptions:
    """What `shardkit smoke` runs."""

    engines: tuple[Engine, ...] = ENGINES
    """Engines to exercise, in order."""
    nproc: int | None = None
    """Ranks per run (same world size for A, B and C, so CPU runs must match bit for bit); None =
    one per visible GPU, else 2 CPU ranks."""
    device: str = "auto"
    """auto: one nccl rank per visible GPU, CPU ranks without GPUs; cpu: gloo ranks that never touch
    a GPU; gpu: GPUs or a refusal. More ranks than visible GPUs is refused unless cpu (spawn.plan.plan_ranks)."""
    steps: int = 4
    """Optimizer steps of the uninterrupted run; the checkpoint is taken after steps // 2."""
    config: str | None = None
    """A DeepSpeed or shardkit FSDP2 config to use instead of the preset/generated one."""
    model: str = "tiny"
    """Llama size from shardkit.engines.model_factory.LLAMA_SIZES; tiny keeps a CPU smoke well under a minute."""
    batch: int = 2
    """Sequences per rank per step."""
    seq_len: int = 32
    """Tokens per sequence."""
    seed: int = 0
    """Model init seed (identical on every rank and every run)."""
    timeout: float = 300.0
    """Hard limit per run (A, B or C) in seconds; ranks still alive then are killed."""
    workdir: str | None = None
    """Where checkpoints go (a temporary directory, removed afterwards, when None)."""
    keep_checkpoint: str | None = None
    """Keep run B's checkpoint (verified, resumable) here when the smoke passes: ``DIR`` for one
    engine, ``DIR/<engine>`` for several; ``shardkit verify``/``reshard``/``consolidate`` read it."""
    after_save: Callable[[Path], None] | None = field(default=None, repr=False)
    """Called with the checkpoint root between run B and run C (tests use it to corrupt a file)."""


def default_config(engine: Engine, nproc: int, batch: int) -> tuple[dict[str, Any], str]:
    """The config for ``engine``: a preset shipped in shardkit/ds_configs/, else generated."""
    for name in PRESET_CANDIDATES[engine]:
        preset = resources.files("shardkit").joinpath("ds_configs", name)
        if preset.is_file():
            with resources.as_file(preset) as path:
                return fit_config(engine, load_config(path), nproc, batch), f"preset {name}"
    if engine == "zero3":
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": batch,
            "gradient_accumulation_steps": 1,
            # torch's AdamW: no JIT-built op needed, identical on every DeepSpeed release tested.
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3},
            "steps_per_print": 1_000_000,
        }
    else:
        cfg = {
            "fsdp": {"mixed_precision": "none", "wrap": ["LlamaDecoderLayer"]},
            "train": {"micro_batch": batch, "lr": 1e-3, "weight_decay": 0.01, "clip": 1.0},
        }
    return cfg, "generated"


def fit_config(engine: Engine, cfg: dict[str, Any], nproc: int, batch: int) -> dict[str, Any]:
    """Make a user's/preset config runnable at this world size without changing what it tests.

    DeepSpeed refuses ``train_batch_size != micro * grad_accum * world_size`` and silently drops
    ``"auto"`` values (HF Trainer fills them); the smoke sets the batch keys itself.
    """
    cfg = copy.deepcopy(cfg)
    if engine == "zero3":
        cfg.pop("train_batch_size", None)
        cfg["train_micro_batch_size_per_gpu"] = batch
        ga = cfg.get("gradient_accumulation_steps")
        cfg["gradient_accumulation_steps"] = ga if isinstance(ga, int) and ga > 0 else 1
        cfg.setdefault("steps_per_print", 1_000_000)
        if not isinstance(cfg.get("optimizer"), dict):
            cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
        # "auto" is only meaningful to the HF Trainer; DeepSpeed would drop these silently.
        cfg = strip_auto(cfg)
    else:
        train = cfg.setdefault("train", {})
        if isinstance(train, dict):
            train["micro_batch"] = batch
    return cfg


def config_for(engine: Engine, opts: SmokeOptions) -> tuple[dict[str, Any], str]:
    if opts.config is None:
        return default_config(engine, opts.nproc, opts.batch)
    cfg = load_config(opts.config)
    kind = config_kind(cfg)
    wanted = "deepspeed" if engine == "zero3" else "fsdp"
    if kind != wanted:
        raise UsageError(
            f"--config {opts.config} is a {kind} config but --engine {engine} needs a {wanted} config; "
            f"pass --engine {'zero3' if kind == 'deepspeed' else 'fsdp2'}"
        )
    if engine == "zero3":
        if deepspeed_view(cfg).stage != 3:
            stage = get(cfg, "zero_optimization.stage", 0)
            raise UsageError(
                f"--config {opts.config}: zero_optimization.stage is {stage!r}, the zero3 smoke needs 3. "
                "Set it to 3 or generate one with `shardkit config zero3 -o ds_config.json`."
            )
    return fit_config(engine, cfg, opts.nproc, opts.batch), f"file {opts.config}"
