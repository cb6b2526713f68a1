"""``estimate_memory``: the one function every caller uses (the command, ``config --fit``, the tests)."""

from __future__ import annotations

from shardkit.estimate.activations import activation_items
from shardkit.estimate.fsdp import fsdp2_items, fsdp_compute_bytes
from shardkit.estimate.model import ModelShape
from shardkit.estimate.report import Estimate, RunShape
from shardkit.estimate.settings import FSDPSettings, Settings, ZeroSettings
from shardkit.estimate.zero import zero_items


def _describe(settings: Settings) -> str:
    if isinstance(settings, FSDPSettings):
        off = "cpu_offload" if settings.cpu_offload else "no offload"
        return f"FSDP2 ({off}, mixed_precision {settings.mixed_precision})"
    parts = [f"ZeRO-{settings.stage}", settings.precision]
    if settings.offload_optimizer != "none":
        parts.append(f"offload_optimizer {settings.offload_optimizer}")
    if settings.offload_param != "none":
        parts.append(f"offload_param {settings.offload_param}")
    return " ".join(parts)


def _settings_dict(settings: Settings) -> dict[str, object]:
    from dataclasses import asdict

    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(settings).items()}


def estimate_memory(model: ModelShape, settings: Settings, run: RunShape, gpu_memory: int | None = None,
                    host_memory: int | None = None) -> Estimate:
    """Memory per GPU and per host of ``model`` trained with ``settings`` on ``run``."""
    est = Estimate(
        subject=f"{model.source}: {_describe(settings)}, {run.world_size} rank(s), {run.gpus_per_node} per host, "
                f"micro batch {run.micro_batch} x {run.seq_len} tokens"
                + (", activation checkpointing" if run.activation_checkpointing else ""),
        engine=settings.engine,
        run=run,
        gpu_memory=gpu_memory,
        host_memory=host_memory,
        settings=_settings_dict(settings),
    )
    if isinstance(settings, ZeroSettings):
        items, notes = zero_items(model, settings, run)
        compute = settings.lp_bytes
        if settings.defaults_used:
            notes.append("DeepSpeed 0.19.8 defaults used for " + ", ".join(settings.defaults_used))
        if settings.filled_auto:
            notes.append('"auto" filled as the HF Trainer fills it for ' + ", ".join(settings.filled_auto))
    else:
        items, notes = fsdp2_items(model, settings, run)
        compute = fsdp_compute_bytes(model, settings)
    act, act_notes = activation_items(model, run, compute)
    for item in items + act:
        est.add(item)
    est.notes += list(model.notes) + notes + act_notes
    est.notes.append("not counted: the CUDA context and the allocator's fragmentation (typically 0.5-1 GiB per "
                     "GPU), the Python process itself, data loaders")
    return est
