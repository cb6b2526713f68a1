"""The in-process resume of ZeRO-1/2 checkpoints at another world size (``load_checkpoint_resharded`` on a ZeRO-1
or ZeRO-2 engine, ``checkpoint/ops/resume_zero12``), on real DeepSpeed engines (CPU, gloo, spawned ranks).

Sources are saved at 2 ranks after SAVE_STEPS steps (with a WarmupLR scheduler and client state), then each
goes on for RESUME_STEPS steps: its own continuation. At 1 and 3 ranks a fresh engine loads the source in-process;
then its fp32 masters and both Adam moments, gathered by parameter name, must be bit-equal to the source's at
its save, and its next losses must equal, bit for bit, those of the reference: the same source resharded by
``shardkit reshard`` to that world size and loaded by DeepSpeed's plain ``engine.load_checkpoint`` (with the
CPU Adam kernel replay), i.e. a run at the new world size continuing from equal state. Against the 2-rank
run's own continuation only the gradient all-reduce's summation order differs (1e-5 relative in fp32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.slow
GLOBAL_BATCH = 6  # divisible by 1, 2 and 3 ranks
SEQ_LEN = 8
SAVE_STEPS, RESUME_STEPS = 2, 2
TAG = f"global_step{SAVE_STEPS}"
CLIENT = {"epoch": 3, "note": "resume me"}

#: label -> (ZeRO stage, precision): the sources, saved at 2 ranks in one spawn (ZeRO-1 with bf16 is DeepSpeed's
#: BF16_Optimizer, refused by name, so ZeRO-1 runs in fp32).
SOURCES = {"zero2_bf16": (2, "bf16"), "zero2_fp32": (2, "fp32"), "zero1_fp32": (1, "fp32")}
#: new world size -> the sources resumed there.
LOADS = {1: ["zero2_bf16", "zero2_fp32", "zero1_fp32"], 3: ["zero2_bf16"]}


def _config(stage: int, dtype: str, world: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "steps_per_print": 10_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                     "warmup_num_steps": 10}},
        "zero_optimization": {"stage": stage},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _engine(stage: int, dtype: str, layers: int = 0) -> Any:
    """The tiny Llama on a DeepSpeed engine; ``layers`` > 0: with that many layers instead (another model)."""
    from shardkit.engines.deepspeed import initialize
    from shardkit.engines.model_factory import tiny_llama

    model = tiny_llama("tiny", seed=0)
    if layers:
        from transformers import LlamaForCausalLM

        model.config.num_hidden_layers = layers
        model = LlamaForCausalLM(model.config)
    return initialize(model, _config(stage, dtype, dist.get_world_size()))


def _step(engine: Any, step: int) -> float:
    from shardkit.engines.deepspeed import train_step
    from shardkit.engines.model_factory import synthetic_batch

    world, rank = dist.get_world_size(), dist.get_rank()
    rows = synthetic_batch(engine.module.config.vocab_size, GLOBAL_BATCH, SEQ_LEN, step, rank=0)
    per = GLOBAL_BATCH // world
    t = torch.tensor([train_step(engine, rows[rank * per:(rank + 1) * per])], dtype=torch.float32)
    dist.all_reduce(t)
    return float(t.item()) / world


def _states_and_losses(engine: Any) -> dict[str, Any]:
    from tests.test_reshard_zero2 import _full_states

    return {"states": _full_states(engine), "global_steps": engine.global_steps,
            # get_lr(): from the scheduler's step count (WarmupLR's get_last_lr is only set by its step())
            "lr": engine.lr_scheduler.get_lr(), "group_lr": [g["lr"] for g in engine.optimizer.param_groups],
            "losses": [_step(engine, s) for s in range(SAVE_STEPS, SAVE_STEPS + RESUME_STEPS)]}


def save_and_continue(base: str) -> dict[str, Any]:
    """Rank target: per source, SAVE_STEPS steps, save, its states at the save and RESUME_STEPS more losses."""
    out = {}
    for label, spec in SOURCES.items():
        engine = _engine(*spec)
        for s in range(SAVE_STEPS):
            _step(engine, s)
        engine.save_checkpoint(f"{base}/{label}", tag=TAG, client_state=dict(CLIENT))
        out[label] = _states_and_losses(engine)
    return out


def _refusal(call: Any) -> str | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the message is what is asserted
        return f"{type(exc).__name__}: {exc}"
    return None


def load_all(plans: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank target: per plan, the in-process load (or the reference: plain load of the resharded copy), the
    states and the next losses; refusals as messages."""
    from shardkit import load_checkpoint_resharded
    from shardkit.checkpoint.ops.cpu_adam_kernel import restore_cpu_adam_kernel_state

    out: dict[str, Any] = {}
    for plan in plans:
        spec = SOURCES[plan["source"]]
        if plan["kind"] == "refuse_other_model":
            engine = _engine(*spec, layers=3)
            out["other_model"] = _refusal(lambda: load_checkpoint_resharded(engine, plan["ckpt"]))
            out["other_model_steps"] = engine.global_steps  # untouched
            continue
        if plan["kind"] == "refuse_zero3_engine":
            engine = _engine(3, "fp32")
            out["zero3_engine"] = _refusal(lambda: load_checkpoint_resharded(engine, plan["ckpt"]))
            continue
        engine = _engine(*spec)
        if plan["kind"] == "shardkit":
            result = load_checkpoint_resharded(engine, plan["ckpt"])
            got = {"saved_world_size": result.saved_world_size, "client_state": result.client_state,
                   "notes": result.notes, "kernels": [k.kernel for k in result.kernel_replays]}
        else:  # the reference: a resharded copy, DeepSpeed's plain load, the CPU Adam kernel replayed by hand
            path, client = engine.load_checkpoint(plan["ckpt"])
            assert path is not None, plan
            restore_cpu_adam_kernel_state(engine.optimizer.optimizer)
            got = {}
        got.update(_states_and_losses(engine))
        out[f"{plan['kind']}:{plan['source']}"] = got
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    from shardkit.run.spawn.process import run_ranks

    base = tmp_path_factory.mktemp("zero12_sources")
    return base, run_ranks(save_and_continue, 2, args=(str(base),), timeout=420, device="cpu")[0].value


@pytest.fixture(scope="module")
def resumed(sources: tuple[Path, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """world -> what the loads there saw (each source also resharded for the reference)."""
    from shardkit.checkpoint.ops.reshard import reshard_checkpoint
    from shardkit.run.spawn.process import run_ranks

    base, _ = sources
    out = tmp_path_factory.mktemp("zero12_resharded")
    results = {}
    for world, labels in LOADS.items():
        plans: list[dict[str, Any]] = []
        for label in labels:
            resharded = out / f"{label}_ws{world}"
            reshard_checkpoint(base / label, resharded, world, warn=lambda note: None)
            plans.append({"source": label, "kind": "shardkit", "ckpt": str(base / label)})
            plans.append({"source": label, "kind": "reference", "ckpt": str(resharded)})
        if world == 1:
            plans.append({"source": "zero2_bf16", "kind": "refuse_other_model", "ckpt": str(base / "zero2_bf16")})
            plans.append({"source": "zero2_bf16", "kind": "refuse_zero3_engine", "ckpt": str(base / "zero2_bf16")})
        results[world] = run_ranks(load_all, world, args=(plans,), timeout=480, device="cpu")[0].value
    return results


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("world,label", [(w, label) for w, labels in LOADS.items() for label in labels])
def test_zero12_checkpoint_resumes_in_process_at_another_world_size(sources, resumed, world, label):
    _, saved = sources
    got, ref = resumed[world][f"shardkit:{label}"], resumed[world][f"reference:{label}"]
    assert got["saved_world_size"] == 2 and got["global_steps"] == SAVE_STEPS
    assert got["client_state"] == CLIENT
    assert any("client_state" in note for note in got["notes"]), got["notes"]
    for kind in ("fp32", "exp_avg", "exp_avg_sq"):
        want = saved[label]["states"][kind]
        assert got["states"][kind].keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(got["states"][kind][name], tensor), f"{label} at {world} ranks: {kind} of {name} differs"
    # the WarmupLR scheduler and the param groups' lr go on from the saved step
    assert (got["lr"], got["group_lr"]) == (saved[label]["lr"], saved[label]["group_lr"])
    # the loss curve continues as a run at this world size from equal state does: bit for bit
    assert got["losses"] == ref["losses"], (got["losses"], ref["losses"])
    # and as the 2-rank run's own continuation, up to the all-reduce's summation order
    rel = 1e-5 if SOURCES[label][1] == "fp32" else 1e-2
    assert got["losses"] == pytest.approx(saved[label]["losses"], rel=rel)


@pytest.mark.timeout(1500)
def test_other_model_is_refused_naming_the_parameter(resumed):
    message = resumed[1]["other_model"]
    assert message is not None and message.startswith("CheckpointError: ")
    assert "parameter model.layers.2.self_attn.q_proj.weight (param group 0)" in message and "not the same model" in message and "Nothing was loaded" in message
    assert resumed[1]["other_model_steps"] == 0


@pytest.mark.timeout(1500)
def test_zero3_engine_refuses_a_zero2_checkpoint(resumed):
    message = resumed[1]["zero3_engine"]
    assert message is not None and "a ZeRO-1/2 checkpoint" in message and "ZeRO stage 3" in message
    assert "--to zero3" in message
