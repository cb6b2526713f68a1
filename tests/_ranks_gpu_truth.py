"""Rank targets for tests/test_gpu_truth.py: a live 1-rank engine on CPU, recorded and judged with
the same rules the H100 recordings are judged with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ZERO3_OFFLOAD_PARAM = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False}},
}


def zero3_record_and_judge(out_dir: str) -> dict[str, Any]:
    """Record a live ZeRO-3 engine (param offload, persistent parameters present), judge it, and
    check the live preflight's rule for persistent partitions against an accelerator compute device."""
    import shardkit
    from shardkit.engines.deepspeed import initialize, train_step
    from shardkit.engines.model_factory import resolve_model_factory, synthetic_batch
    from shardkit.placement import collect_records
    from shardkit.placement.observed import judge_snapshot
    from shardkit.placement.snapshot import record_snapshot

    torch.manual_seed(0)
    model = resolve_model_factory("llama:tiny")()
    engine = initialize(model, ZERO3_OFFLOAD_PARAM)
    path = Path(out_dir) / "live.json"
    record_snapshot(path, engine, phase="after_init")
    train_step(engine, synthetic_batch(model.config.vocab_size, 1, 16, 0, 0))
    snap = record_snapshot(path, engine, phase="after_step")
    out: dict[str, Any] = {"judged": judge_snapshot(snap).to_dict()}
    out["live_ok"] = shardkit.preflight(engine, timeout=30).ok
    persist = [n for n, p in engine.module.named_parameters() if getattr(p, "ds_persist", False)]
    out["persistent"] = persist
    # The H100 false alarm, replayed: judge this engine as if it computed on cuda:0. Partitions of
    # persistent parameters follow offload_param to the CPU; they must not be expected on cuda:0.
    rep = collect_records(engine, device="cuda:0")
    out["shard_records"] = [(r.name, r.actual, r.expected) for r in rep.records if r.kind == "zero.param_shard"]
    # A real fault stays caught: the fp32 partition moved to another device.
    zopt = engine.optimizer
    saved = zopt.fp32_partitioned_groups_flat[0]
    zopt.fp32_partitioned_groups_flat[0] = torch.empty_like(saved, device="meta")
    moved = record_snapshot(Path(out_dir) / "moved.json", engine, phase="after_step")
    out["moved_judged"] = judge_snapshot(moved).to_dict()
    try:
        shardkit.preflight(engine, timeout=30)
        out["moved_live"] = ""
    except shardkit.PreflightError as exc:
        out["moved_live"] = str(exc)
    zopt.fp32_partitioned_groups_flat[0] = saved
    return out


def fsdp2_offload_expectation() -> dict[str, Any]:
    """FSDP2 with CPUOffloadPolicy and no config: the module's own FSDP state says it is offloaded."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from shardkit.engines.model_factory import resolve_model_factory
    from shardkit.placement.fsdp import fsdp_expected_for, fsdp_mesh_device, module_offloads

    torch.manual_seed(0)
    model = resolve_model_factory("llama:tiny")()
    for layer in model.model.layers:
        fully_shard(layer, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    exp = fsdp_expected_for(model, None, "cuda:0")
    plain = resolve_model_factory("llama:tiny")()
    fully_shard(plain)
    exp_plain = fsdp_expected_for(plain, None, "cuda:0")
    disagree = fsdp_expected_for(model, {"fsdp": {"cpu_offload": False}}, "cuda:0")
    return {
        "offloads": module_offloads(model), "param_shard": exp.param_shard, "optimizer": exp.optimizer, "why": exp.param_shard_why,
        "plain_offloads": module_offloads(plain), "plain_param_shard": exp_plain.param_shard,
        "mesh_device": fsdp_mesh_device(model), "disagree_shard": disagree.param_shard, "disagree_why": disagree.param_shard_why,
    }


def record_spec_on_gpu(out_dir: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """On a GPU rank: the recordings' run for ``spec`` (capture.py's recipe), live preflight after a
    step, and the snapshot recorded and judged. Marked ``gpu``: skipped on CPU-only machines."""
    import shardkit
    from shardkit.engines.model_factory import resolve_model_factory
    from shardkit.placement.observed import judge_snapshot
    from shardkit.placement.snapshot import record_snapshot

    torch.manual_seed(0)
    model = resolve_model_factory("llama:tiny")()
    path = Path(out_dir) / f"{name}.json"
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    if spec["engine"] == "deepspeed":
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=spec["config"])
        ids = ids.to(engine.device)
        record_snapshot(path, engine, phase="after_init")
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        snap = record_snapshot(path, engine, phase="after_step")
        check = lambda: shardkit.preflight(engine, timeout=60)  # noqa: E731
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        from shardkit.platform.device_rules import accelerator_device

        dev = accelerator_device()
        kw: dict[str, Any] = {}
        if spec.get("offload") is not None:
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=bool(spec["offload"]))
        else:
            model = model.to(dev)
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        record_snapshot(path, model=model, optimizer=opt, phase="after_init")
        ids = ids.to(dev)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        snap = record_snapshot(path, model=model, optimizer=opt, phase="after_step")
        check = lambda: shardkit.preflight(model=model, optimizer=opt, timeout=60)  # noqa: E731
    out: dict[str, Any] = {"judged": judge_snapshot(snap).to_dict()}
    try:
        out["live_text"] = check().render()
        out["live_ok"] = True
    except shardkit.PreflightError as exc:
        out["live_ok"], out["live_text"] = False, str(exc)
    return out
