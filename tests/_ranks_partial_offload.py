"""Rank targets for tests/test_partial_offload.py: a real DeepSpeed ZeRO-3 engine of the model the H100
recordings used, with partial optimizer offload, on CPU (gloo). On DeepSpeed's CPU accelerator every
sub-group is on 'cpu', so these runs check the *layout* the synthetic GPU snapshots are built with
(sub-groups, names, numels, dtypes, state numbering) and what ratio < 1 does where the accelerator
is the CPU, not the GPU devices themselves."""

from __future__ import annotations

import copy
from typing import Any

import torch


def _model() -> torch.nn.Module:
    # The model of tests/data/gpu_truth/capture.py ("small").
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=256, num_hidden_layers=2, intermediate_size=1024, vocab_size=1024,
                                        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128))


def _shape(entries: list[dict[str, Any]]) -> list[list[Any]]:
    """Everything an entry records except devices (all 'cpu' here)."""
    keep = ("name", "dtype", "numel", "ds_numel", "ds_persist", "ds_status")
    return [[e.get(k) for k in keep] for e in entries]


def record_layout(config: dict[str, Any]) -> dict[str, Any]:
    """Initialize ZeRO-3 with ``config``, record both phases as capture.py does, and report the layout."""
    import deepspeed

    from shardkit.placement import collect_records
    from shardkit.placement.snapshot import snapshot_entries

    cfg = copy.deepcopy(config)
    cfg["zero_optimization"]["offload_optimizer"]["pin_memory"] = False  # no pinning without an accelerator
    model = _model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    zopt = engine.optimizer
    out: dict[str, Any] = {"after_init": _shape(snapshot_entries(engine.module, zopt))}
    x = torch.randint(0, 1000, (2, 16))
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    out["after_step"] = _shape(snapshot_entries(engine.module, zopt))
    report = collect_records(engine)  # the live preflight's records of the same engine
    out["live_misplaced"] = [r.name for r in report.records if not r.ok]
    out["live_fp32"] = sorted(r.name for r in report.records if r.name.startswith("zero.fp32_partition[") and "grad" not in r.name)
    ids = {id(t): i for i, t in enumerate(zopt.fp32_partitioned_groups_flat)}
    backup = getattr(zopt, "backup_optimizer", None)
    out.update(
        subgroup_to_device=[str(d) for d in getattr(zopt, "subgroup_to_device", {}).values()],
        inner=type(zopt.optimizer).__name__,
        inner_state_subgroups=[ids.get(id(p)) for p in zopt.optimizer.state],
        backup=type(backup).__name__ if backup is not None else None,
        backup_state_subgroups=[ids.get(id(p)) for p in backup.state] if backup is not None else [],
        saved_state_entries=len(zopt.state_dict()["optimizer_state_dict"]["state"]),
    )
    return out
