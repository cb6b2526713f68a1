"""``convert --to universal`` (``ops.convert.to_universal``) on real engines (CPU, gloo).

- A real 2-rank DeepSpeed ZeRO-2 save (tied embeddings, a frozen norm, two param groups: tests/_ranks_dcp_writer.py)
  converted through the CLI, then resumed by DeepSpeed's ``load_checkpoint`` with ``checkpoint.load_universal:
  true`` at 1 rank: masters and both Adam moments bit-equal to the saving engine's own, and the next losses those
  of the run that never stopped (up to the all-reduce's summation order: the same global batch split 1 or 2 ways).
- A 2-rank FSDP2 save (DCP, tests/_ranks_ckpt.py) converted the same way, resumed by ZeRO-2 at 1 rank likewise.
- Refused, exit 2 or 1, with the reason named and nothing written: a universal source, a weights-only source,
  flags that choose per-rank files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardkit.run.spawn.process import run_ranks
from tests import _ranks_ckpt as K
from tests import _ranks_convert as C
from tests import _ranks_dcp_writer as W

# the module fixture spawns three DeepSpeed/FSDP2 runs; a loaded 2-core machine (or a DeepSpeed op being
# rebuilt by another process, which every rank waits for) takes minutes per spawn
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
SPAWN_TIMEOUT_S = 900

TAG = "global_step2"
LOSS_RTOL = 1e-4
"""The resumed run splits each global batch another way than the saving run: its losses differ in float
summation order only (the fsdp2 -> zero3 tests allow the same)."""


def resume_universal(plans: dict[str, str]) -> dict[str, Any] | None:
    """Rank target: per source -> universal folder, a fresh ZeRO-2 engine (the model as built, before any step)
    loads the folder with load_universal, reports every trainable parameter's master and moments as it maps them,
    and trains the steps the saving run took next; rank 0 returns it all."""
    import deepspeed

    deepspeed.init_distributed(dist_backend=None, auto_mpi_discovery=False)
    out = {source: _resume_one(root, source) for source, root in plans.items()}
    return out if dist.get_rank() == 0 else None


def _resume_one(root: str, source: str) -> dict[str, Any]:
    import deepspeed

    from shardkit.engines.deepspeed import train_step
    from shardkit.engines.model_factory import tiny_llama
    from tests._ranks_convert_back import _global_step
    from tests._ranks_convert_back import ds_config as fsdp_like_config
    from tests._ranks_zero12_sources import _engine_view

    world = dist.get_world_size()
    if source == "zero2":
        model = C.model()
        params: Any = C.param_groups(model)
        cfg = W.zero2_config(world, False)
    else:  # the FSDP2 run: tiny Llama, one group, AdamW lr 1e-3 / weight decay 0.01, no clipping
        model = tiny_llama("tiny", seed=1)
        params = model.parameters()
        cfg = {**fsdp_like_config(world, False), "zero_optimization": {"stage": 2}}
    cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
    path, client = engine.load_checkpoint(root)
    if path is None:
        raise RuntimeError(f"engine.load_checkpoint({root!r}) loaded nothing")
    view = _engine_view(engine)
    groups = [{k: g[k] for k in ("lr", "weight_decay")} for g in engine.optimizer.optimizer.param_groups]
    steps = sorted({float(engine.optimizer.optimizer.state[f]["step"])
                    for f in engine.optimizer.single_partition_of_fp32_groups})
    global_steps = engine.global_steps
    if source == "zero2":
        losses = [C._mean(train_step(engine, C._rows(s))) for s in range(C.SAVE_STEPS, C.SAVE_STEPS + C.RESUME_STEPS)]
    else:
        losses = [_global_step(engine, s) for s in (2, 3)]
    return {"view": view, "groups": groups, "steps": steps, "global_steps": global_steps, "losses": losses,
            "client": {k: client.get(k) for k in C.CLIENT_STATE}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    """The two sources and their uninterrupted runs, each converted through the CLI's function, then resumed."""
    from shardkit.cli import main

    base = tmp_path_factory.mktemp("to_universal")
    out: dict[str, Any] = {"base": base}
    out["zero2_ref"] = run_ranks(W.zero2_train_save_continue, 2, args=(str(base / "zero2"), False),
                                 timeout=SPAWN_TIMEOUT_S, device="cpu")[0].value
    out["fsdp2_ref"] = run_ranks(K.fsdp_train_save_continue, 2, args=(str(base / "fsdp2"), str(base / "m.safetensors")),
                                 timeout=SPAWN_TIMEOUT_S, device="cpu")[0].value
    plans = {source: str(base / f"{source}_universal") for source in ("zero2", "fsdp2")}
    for source, universal in plans.items():
        report = base / f"{source}.json"
        code = main(["convert", str(base / source), "--to", "universal", "-o", universal, "--json-file", str(report)])
        assert code == 0
        out[f"{source}_report"] = json.loads(report.read_text())
    resumed = run_ranks(resume_universal, 1, args=(plans,), timeout=SPAWN_TIMEOUT_S, device="cpu")[0].value
    out.update({f"{source}_resumed": value for source, value in resumed.items()})
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous().view(torch.int32)


def test_zero2_save_resumes_from_universal_at_one_rank_bit_equal(runs):
    ref, got = runs["zero2_ref"], runs["zero2_resumed"]
    assert sorted(got["view"]) == sorted(ref["state"]["fp32"]) and C.FROZEN not in got["view"]
    for name, states in got["view"].items():
        for key, value in states.items():
            assert torch.equal(_bits(value), _bits(ref["state"][key][name])), f"{key} of {name}"
    assert got["steps"] == ref["state"]["steps"] == [2.0] and got["global_steps"] == 2
    assert got["groups"] == [dict(g) for g in C.GROUPS]  # two groups, each with its own lr and decay
    assert got["client"] == C.CLIENT_STATE
    assert got["losses"] == pytest.approx(ref["losses_after"], rel=LOSS_RTOL)


def test_fsdp2_save_resumes_from_universal_at_one_rank_bit_equal(runs):
    ref, got = runs["fsdp2_ref"], runs["fsdp2_resumed"]
    model, state = ref["state"]["model"], ref["state"]["optim"]["state"]
    assert sorted(got["view"]) == sorted(state)
    for name, states in got["view"].items():
        for key, value in states.items():
            want = model[name] if key == "fp32" else state[name][key]
            assert torch.equal(_bits(value), _bits(want)), f"{key} of {name}"
    assert got["steps"] == [2.0] and got["groups"] == [{"lr": 1e-3, "weight_decay": 0.01}]
    assert got["losses"] == pytest.approx(ref["losses"], rel=LOSS_RTOL)


def test_cli_reports_what_it_wrote_and_the_output_verifies(runs, run_cli):
    base = runs["base"]
    data = runs["zero2_report"]
    assert data["engines"] == {"from": "deepspeed", "to": "universal"}
    assert {"fp32 masters", "exp_avg", "exp_avg_sq", "step", "frozen parameters", "tied weights (shared_params)",
            "client_state.epoch"} <= set(data["carried"])
    assert runs["fsdp2_report"]["engines"] == {"from": "fsdp2", "to": "universal"}
    out = base / "zero2_universal"
    assert (out / "latest_universal").read_text().strip() == TAG and (out / "latest").read_text().strip() == TAG
    assert (out / TAG / "zero" / "model.embed_tokens.weight" / "exp_avg_sq.pt").is_file()
    code, _, err = run_cli("verify", out)
    assert code == 0, err


def test_a_universal_source_is_refused_as_already_universal(runs, tmp_path, run_cli):
    out = tmp_path / "again"
    code, _, err = run_cli("convert", runs["base"] / "zero2_universal", "--to", "universal", "-o", out)
    assert code == 2 and "is a DeepSpeed universal checkpoint already" in err and "load_universal" in err, err
    assert not out.exists()


def test_weights_only_source_and_per_rank_flags_are_refused_with_nothing_written(runs, tmp_path, run_cli):
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "out"
    src = tmp_path / "model_only"
    dcp.save({"model": {"w": torch.ones(4, 3)}}, checkpoint_id=str(src))
    code, _, err = run_cli("convert", src, "--to", "universal", "-o", out)
    assert code == 1 and "dcp reader describes this checkpoint's weights only" in err, err
    assert not out.exists() or list(out.iterdir()) == []
    zero2 = runs["base"] / "zero2"
    code, _, err = run_cli("convert", zero2, "--to", "universal", "--world-size", "2", "-o", out)
    assert code == 2 and "--world-size 2 with --to universal" in err and "drop --world-size" in err, err
    code, stdout, err = run_cli("convert", zero2, "--to", "universal", "-o", out, "--dry-run")
    assert code == 0 and "nothing was written (--dry-run)" in stdout, err
    assert not out.exists() or list(out.iterdir()) == []


def test_a_missing_moment_is_refused_before_anything_is_written(runs, tmp_path):
    """The writer's own refusal comes before the staging folder: a trainable parameter without exp_avg_sq."""
    from shardkit.checkpoint.ops.convert import single_source, to_universal
    from shardkit.checkpoint.readers.registry import read_checkpoint
    from shardkit.core.errors import CheckpointError

    real = read_checkpoint
    victim = "model.layers.0.mlp.up_proj.weight"

    def damaged(kind: str, folder: Path) -> Any:
        ckpt = real(kind, folder)
        del ckpt.optimizer[victim]["exp_avg_sq"]
        return ckpt

    mp = pytest.MonkeyPatch()
    mp.setattr(single_source, "read_checkpoint", damaged)  # where every one-process target reads its source
    try:
        with pytest.raises(CheckpointError, match=rf"lacks it for {victim}"):
            to_universal.convert_to_universal(runs["base"] / "zero2", tmp_path / "out")
    finally:
        mp.undo()
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
