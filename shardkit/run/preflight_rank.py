"""The rank side of `shardkit preflight CONFIG`: build the model, initialize DeepSpeed or FSDP2 from
the config, run the placement preflight and one training step (``preflight_rank``, sent to the
ranks by name).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.core.errors import PreflightError
from shardkit.engines.deepspeed import initialize as deepspeed_initialize
from shardkit.engines.deepspeed import train_step as deepspeed_step
from shardkit.engines.fsdp import initialize as fsdp_initialize
from shardkit.engines.fsdp import train_step as fsdp_step
from shardkit.engines.model_factory import resolve_model_factory, synthetic_batch
from shardkit.placement.preflight import preflight
from shardkit.placement.snapshot import record_snapshot
from shardkit.run.spawn.process import redirect_output


@dataclass(frozen=True)
class RankSpec:
    """What each spawned rank needs (pickles: a spec string, never a callable)."""

    config: dict[str, Any]
    kind: str
    model: str | None
    timeout: float
    json_path: str | None
    log_dir: str
    record_path: str | None = None
    """Write a placement snapshot (after init and after the step) here; ranks > 0 add ``.rank<N>``."""


def _record(spec: RankSpec, rank: int, phase: str, engine: Any = None, **kw: Any) -> None:
    """``--record``: this rank's snapshot (rank 0 at the path given, rank N beside it as ``.rankN``)."""
    if not spec.record_path:
        return
    path = Path(spec.record_path)
    if rank:
        path = path.with_name(f"{path.stem}.rank{rank}{path.suffix or '.json'}")
    record_snapshot(path, engine, phase=phase, name=path.stem, **kw)


def preflight_rank(spec: RankSpec) -> dict[str, Any]:
    """Rank target: build, initialize, preflight, one step. Findings are returned, not raised."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    redirect_output(Path(spec.log_dir) / f"rank{rank}.log")
    torch.manual_seed(0)
    model = resolve_model_factory(spec.model)()
    step: Any
    if spec.kind == "fsdp":
        model, optimizer = fsdp_initialize(model, spec.config)

        def check() -> Any:
            return preflight(model=model, optimizer=optimizer, config=spec.config, timeout=spec.timeout,
                             json_path=spec.json_path)

        def record(phase: str) -> None:
            _record(spec, rank, phase, model=model, optimizer=optimizer, config=spec.config)

        def step(ids: Any) -> float:
            # no clipping: the preflight's step shows where state lands, as the user's first step does
            return fsdp_step(model, optimizer, ids)
    else:
        engine = deepspeed_initialize(model, spec.config)

        def check() -> Any:
            return preflight(engine, config=spec.config, timeout=spec.timeout, json_path=spec.json_path)

        def record(phase: str) -> None:
            _record(spec, rank, phase, engine, config=spec.config)

        def step(ids: Any) -> float:
            return deepspeed_step(engine, ids)

    result: dict[str, Any] = {"rank": rank}
    record("after_init")
    try:
        report = check()
        result.update(preflight_ok=True, text=report.render())
    except PreflightError as exc:
        result.update(preflight_ok=False, text=str(exc))
        return result
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        result["text"] += "\n(no training step: the model has no config.vocab_size to build a causal-LM batch from)"
        return result
    try:
        result["loss"] = step(synthetic_batch(int(vocab), 1, 16, 0, rank))
        record("after_step")
    except Exception as exc:  # noqa: BLE001 - the user's step failing is the finding
        result["step_error"] = f"{type(exc).__name__}: {exc}"
    return result
