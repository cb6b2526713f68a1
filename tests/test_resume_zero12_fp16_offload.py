"""The in-process ZeRO-1/2 resume (``checkpoint/ops/resume_zero12``) of fp16 runs with their dynamic loss
scaler and of CPU-offloaded optimizer state (DeepSpeedCPUAdam), and checkpoints of the other ZeRO family
given to an engine (a ZeRO-3 save to a ZeRO-2 engine): real DeepSpeed engines, CPU, gloo, spawned ranks.

Built as ``test_resume_zero12`` builds its runs (same model, batches, scheduler, steps; its helpers): sources
saved at 2 ranks after SAVE_STEPS steps, each resumed in-process at 1 and 3 ranks; masters and both Adam
moments gathered by name must be bit-equal to the source's at its save, the next losses bit-equal to those of
the same source resharded by ``shardkit reshard`` and loaded by DeepSpeed's plain ``load_checkpoint``, and
the fp16 loss scaler's state (scale, iteration, last overflow, hysteresis) the saved one. fp16 needs a CPU
whose oneDNN runs fp16 (DeepSpeed's CPU accelerator refuses fp16 otherwise): skipped there, with the reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.test_resume_zero12 import CLIENT, SAVE_STEPS, TAG, _refusal, _states_and_losses, _step

pytestmark = pytest.mark.slow


def _fp16_supported() -> bool:
    # what DeepSpeed's CPU accelerator asks (accelerator/cpu_accelerator.py is_fp16_supported)
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # noqa: BLE001 - a torch build without the op: no fp16 on this CPU
        return False


FP16 = _fp16_supported()
FP16_SKIP = "this CPU's oneDNN has no fp16 (torch.ops.mkldnn._is_mkldnn_fp16_supported() is False): DeepSpeed's CPU " \
            "accelerator refuses fp16 training here"
#: fp16's dynamic scaler starts at 2**8 and doubles after every clean step but the first (loss_scale_window 1): at
#: the save it is 2**9 at iteration 2, so a resume that kept the fresh engine's scaler would be seen
FP16_CONFIG = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1, "hysteresis": 2, "min_loss_scale": 1}

#: label -> (ZeRO stage, precision, offload_optimizer to cpu). ZeRO-1 + bf16 with offload is DeepSpeed's ZeRO-1/2
#: optimizer (without offload it is the refused BF16_Optimizer); the ZeRO-3 save is only given to a ZeRO-2 engine.
SOURCES = {"zero2_fp16": (2, "fp16", False), "zero2_bf16_offload": (2, "bf16", True),
           "zero1_bf16_offload": (1, "bf16", True), "zero3_fp32": (3, "fp32", False)}
if not FP16:
    del SOURCES["zero2_fp16"]
LOADS = {1: ["zero2_fp16", "zero2_bf16_offload", "zero1_bf16_offload"], 3: ["zero2_fp16", "zero2_bf16_offload"]}


def _engine(stage: int, dtype: str, offload: bool) -> Any:
    from shardkit.engines.deepspeed import initialize
    from shardkit.engines.model_factory import tiny_llama
    from tests.test_resume_zero12 import _config

    cfg = _config(stage, dtype, dist.get_world_size())
    if dtype == "fp16":
        cfg["fp16"] = dict(FP16_CONFIG)
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return initialize(tiny_llama("tiny", seed=0), cfg)


def _scaler(engine: Any) -> dict[str, Any]:
    """The loss scaler's plain state (cur_scale, cur_iter, last_overflow_iter, cur_hysteresis ...)."""
    scaler = engine.optimizer.loss_scaler
    return {"type": type(scaler).__name__, **{k: v for k, v in vars(scaler).items()
                                               if isinstance(v, (bool, int, float))}}


def _record(engine: Any) -> dict[str, Any]:
    return {"scaler": _scaler(engine), "skipped_steps": engine.skipped_steps,
            "optimizer": type(engine.optimizer.optimizer).__name__, **_states_and_losses(engine)}


def save_and_continue(base: str) -> dict[str, Any]:
    """Rank target: per source, SAVE_STEPS steps, save, its state at the save and the next losses."""
    out = {}
    for label, spec in SOURCES.items():
        engine = _engine(*spec)
        for s in range(SAVE_STEPS):
            _step(engine, s)
        engine.save_checkpoint(f"{base}/{label}", tag=TAG, client_state=dict(CLIENT))
        out[label] = _record(engine) if spec[0] != 3 else {}
    return out


def load_all(plans: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank target: per plan, the in-process load (or the reference: DeepSpeed's plain load of the resharded
    copy, the CPU Adam kernel replayed), what the engine holds after it and the next losses; refusals as
    messages, with the engine's step count after them."""
    from shardkit import load_checkpoint_resharded
    from shardkit.checkpoint.ops.cpu_adam_kernel import restore_cpu_adam_kernel_state

    out: dict[str, Any] = {}
    for plan in plans:
        engine = _engine(*plan["engine"])
        if plan["kind"] == "refuse":
            out[f"refuse:{plan['source']}"] = {"message": _refusal(lambda: load_checkpoint_resharded(engine, plan["ckpt"])),
                                               "global_steps": engine.global_steps}
            continue
        if plan["kind"] == "shardkit":
            result = load_checkpoint_resharded(engine, plan["ckpt"])
            got = {"saved_world_size": result.saved_world_size, "client_state": result.client_state,
                   "kernels": [k.kernel for k in result.kernel_replays], "fp32_devices": result.fp32_devices,
                   "state_devices": result.state_devices}
        else:
            path, _ = engine.load_checkpoint(plan["ckpt"])
            assert path is not None, plan
            restore_cpu_adam_kernel_state(engine.optimizer.optimizer)
            got = {}
        got.update(_record(engine))
        out[f"{plan['kind']}:{plan['source']}"] = got
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    from shardkit.run.spawn.process import run_ranks

    base = tmp_path_factory.mktemp("zero12_fp16_offload")
    return base, run_ranks(save_and_continue, 2, args=(str(base),), timeout=480, device="cpu")[0].value


@pytest.fixture(scope="module")
def resumed(sources: tuple[Path, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """world -> what the loads there saw."""
    from shardkit.checkpoint.ops.reshard import reshard_checkpoint
    from shardkit.run.spawn.process import run_ranks

    base, _ = sources
    out = tmp_path_factory.mktemp("zero12_fp16_offload_resharded")
    results = {}
    for world, labels in LOADS.items():
        plans: list[dict[str, Any]] = []
        for label in (x for x in labels if x in SOURCES):
            resharded = out / f"{label}_ws{world}"
            reshard_checkpoint(base / label, resharded, world, warn=lambda note: None)
            plans.append({"source": label, "kind": "shardkit", "ckpt": str(base / label), "engine": SOURCES[label]})
            plans.append({"source": label, "kind": "reference", "ckpt": str(resharded), "engine": SOURCES[label]})
        if world == 1:
            plans.append({"source": "zero3_fp32", "kind": "refuse", "ckpt": str(base / "zero3_fp32"),
                          "engine": (2, "fp32", False)})
        results[world] = run_ranks(load_all, world, args=(plans,), timeout=540, device="cpu")[0].value
    return results


def _cases() -> list[Any]:
    marks = {"zero2_fp16": [pytest.mark.skipif(not FP16, reason=FP16_SKIP)]}
    return [pytest.param(world, label, marks=marks.get(label, []), id=f"{label}-ws{world}")
            for world, labels in LOADS.items() for label in labels]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("world,label", _cases())
def test_fp16_and_offloaded_zero12_checkpoints_resume_in_process(sources, resumed, world, label):
    _, saved = sources
    got, ref, want = resumed[world][f"shardkit:{label}"], resumed[world][f"reference:{label}"], saved[label]
    assert (got["saved_world_size"], got["global_steps"], got["client_state"]) == (2, SAVE_STEPS, CLIENT)
    for kind in ("fp32", "exp_avg", "exp_avg_sq"):
        assert got["states"][kind].keys() == want["states"][kind].keys()
        for name, tensor in want["states"][kind].items():
            assert torch.equal(got["states"][kind][name], tensor), f"{label} at {world} ranks: {kind} of {name} differs"
    assert (got["lr"], got["group_lr"], got["skipped_steps"]) == (want["lr"], want["group_lr"], want["skipped_steps"])
    # the loss scaler goes on where it stopped: fp16's dynamic one (scale, iteration, overflow history), the
    # static 1.0 of bf16
    assert got["scaler"] == want["scaler"], (got["scaler"], want["scaler"])
    assert got["losses"] == ref["losses"], (got["losses"], ref["losses"])
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-2)
    if SOURCES[label][2]:  # offloaded: DeepSpeed's CPU Adam, its beta powers replayed, masters and moments on cpu
        assert got["optimizer"] == want["optimizer"] == "DeepSpeedCPUAdam"
        assert got["kernels"] and set(got["fp32_devices"]) == set(got["state_devices"]) == {"cpu"}


@pytest.mark.timeout(1800)
@pytest.mark.skipif(not FP16, reason=FP16_SKIP)
def test_fp16_scaler_state_is_the_saved_one_not_a_fresh_engines(sources):
    # the premise of the scaler assertion above: the saved scaler differs from the one a fresh engine starts with
    scaler = sources[1]["zero2_fp16"]["scaler"]
    assert (scaler["type"], scaler["cur_scale"], scaler["cur_iter"]) == ("DynamicLossScaler", 2 ** 9, SAVE_STEPS), scaler


@pytest.mark.timeout(1800)
def test_zero3_checkpoint_is_refused_by_a_zero2_engine_naming_both_stages(resumed):
    got = resumed[1]["refuse:zero3_fp32"]
    message = got["message"]
    assert message is not None and message.startswith("CheckpointError: "), message
    assert "ZeRO-3 checkpoint" in message and "ZeRO stage 2" in message and "Nothing was loaded" in message
    assert "shardkit convert" in message and "--to zero2" in message
    assert got["global_steps"] == 0
