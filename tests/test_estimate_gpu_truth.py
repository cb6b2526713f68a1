"""`shardkit estimate` against the GPU ground truth: for every recording in tests/data/gpu_truth/ (an H100,
DeepSpeed 0.19.8, torch 2.11; every tensor's device, dtype and numel after one step), shardkit's per-rank
estimate of what is held between steps, from the recording's own model and config, equals the bytes of the
recorded tensors on each device.

The recordings list views beside the buffers they view (each ZeRO-3 ``ds_tensor`` is a slice of one flat
buffer, each ZeRO-1/2 parameter a slice of ``bit16_groups_flat`` ...), so each engine's owning buffers are
summed and the views skipped, as DeepSpeed's code allocates them (``OWNERS`` below, with the line that makes
each a view). Tolerance: the engines' scalar flags, which the estimate does not model (``_global_grad_norm``,
8 bytes; ``inf_or_nan_tracker``, 1 byte; ``_dummy_overflow_buf``, 4 bytes): at most 16 bytes per device.
Everything else is exact.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shardkit.estimate.compute import estimate_memory
from shardkit.estimate.meta_model import shape_from_config_dict
from shardkit.estimate.report import RunShape
from shardkit.estimate.settings import FSDPSettings, settings_from_config

DATA = Path(__file__).parent / "data" / "gpu_truth"
RECORDINGS = sorted(p.stem for p in DATA.glob("*.json") if p.stem != "specs")
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int32": 4, "int64": 8, "bool": 1}
SCALAR_SLACK = 16
# capture.py's model (the recordings' "small" Llama), as the config.json save_pretrained would write
SMALL = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 1024,
         "vocab_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 128}

# Owning buffers per engine: a recorded name matching one is counted, every other name is a view of one.
OWNERS = {
    # stage3.py: ds_tensor / fp16_partitioned_groups(_flat) are slices of lp_param_buffer (no offload_param,
    # _set_fp16_partitioned_groups_flat) or of param_groups_fp16_flat_cpu_memory (offload_param,
    # _create_fp16_partitions_with_defragmentation); __param_id_to_grad_partition slices grad_partitions_flat_buffer;
    # fp16_groups / param_dict / persistent_parameters are the parameters themselves. `param` is each parameter's
    # whole data: empty unless gathered, so what it holds after a step is the persistent parameters.
    "zero3": r"^(param |opt\.lp_param_buffer$|opt\.param_groups_fp16_flat_cpu_memory\[|opt\.grad_partitions_flat_buffer$"
             r"|opt\.fp32_partitioned_groups_flat\[|state\[|opt\._global_grad_norm$|opt\.inf_or_nan_tracker$)",
    # stage_1_and_2.py: parameters, bit16_groups, params_in_partition, round_robin_*, parallel_partitioned_* are
    # views of bit16_groups_flat; offload_gradient_dict entries are views of each fp32 partition's .grad (which
    # capture.py does not walk), and cover it exactly.
    "zero12": r"^(opt\.bit16_groups_flat\[|opt\.single_partition_of_fp32_groups\[|state\[|opt\.offload_gradient_dict\["
              r"|opt\.param_buffer_of_bit16_for_cpu_offload_groups\[|opt\.temp_grad_buffer_for_(cpu|gpu)_offload$"
              r"|opt\._global_grad_norm$)",
    # fused_optimizer.py (ZeRO-0, 16-bit): the parameters are views of fp16_groups_flat.
    "zero0_16": r"^(opt\.fp16_groups_flat\[|opt\.fp32_groups_flat\[|state\[|opt\.flatten_grad_norm_mask_list\[)",
    # ZeRO-0 fp32: plain torch optimizer over the parameters.
    "zero0_32": r"^(param |state\[|opt\._dummy_overflow_buf$)",
    # FSDP2: each parameter is a DTensor whose local shard is recorded as `local`; gradients and state are local.
    "fsdp2": r"^(param |grad |state\[)",
}

# Held items a recording cannot show, and why; and step items it does show, and why.
NOT_RECORDED = {
    "z3.reduce_bucket": "the IPG buckets sit in opt.ipg_buckets as IPGBucketZ3 objects, which capture.py does not walk",
    "z3.fp32_grads": "the fp32 gradient buffers are the .grad of fp32_partitioned_groups_flat, not walked",
}
RECORDED_STEP_ITEMS = {
    "fsdp.grads": "capture.py never calls zero_grad, so FSDP2's sharded gradients are still there after the step",
}


def _owners(rec: dict) -> str:
    spec = rec["spec"]
    if spec["engine"] == "fsdp2":
        return "fsdp2"
    stage = spec["config"]["zero_optimization"]["stage"]
    if stage == 3:
        return "zero3"
    if stage in (1, 2):
        return "zero12"
    return "zero0_16" if spec["config"].get("bf16", {}).get("enabled") else "zero0_32"


def _device(name: str) -> str | None:
    return "gpu" if name.startswith("cuda") else "host" if name == "cpu" else None  # "meta" holds nothing


def recorded_bytes(rec: dict, phase: str = "after_step") -> dict[str, int]:
    """Bytes of the owning tensors per device ("gpu"/"host") in one recording."""
    owners = re.compile(OWNERS[_owners(rec)])
    totals = {"gpu": 0, "host": 0}
    entries = rec[phase]
    lp_owner = {(_device(e["device"]), e["dtype"]) for e in entries
                if re.match(r"^opt\.(lp_param_buffer$|param_groups_fp16_flat_cpu_memory\[)", e["name"])}
    for e in entries:
        if not owners.match(e["name"]):
            continue
        device = _device(e.get("local", e["device"]))
        # stage3.py _create_fp32_partitions: a 16-bit partition that already is fp32 on the optimizer's device
        # is reused as the fp32 master, not copied (the fp32 runs)
        if e["name"].startswith("opt.fp32_partitioned_groups_flat[") and (device, e["dtype"]) in lp_owner:
            continue
        if device is not None:
            totals[device] += e["numel"] * ITEMSIZE[e["dtype"]]
    return totals


def _settings(spec: dict):
    if spec["engine"] == "fsdp2":
        offload = spec.get("offload")
        return FSDPSettings(cpu_offload=offload is not None, pin_memory=bool(offload),
                            mixed_precision="bf16" if spec.get("bf16") else "none",
                            reshard_after_forward=spec.get("reshard", True))
    return settings_from_config(spec["config"])


@pytest.fixture(scope="module")
def small_model():
    return shape_from_config_dict(SMALL, "capture.py's small Llama")


def estimated_bytes(rec: dict, model) -> dict[str, int]:
    """shardkit's per-rank bytes per device that the recording can show (held items, minus NOT_RECORDED, plus
    RECORDED_STEP_ITEMS)."""
    spec = rec["spec"]
    micro = spec.get("config", {}).get("train_micro_batch_size_per_gpu", 2)
    est = estimate_memory(model, _settings(spec), RunShape(world_size=1, micro_batch=micro, seq_len=16))
    totals = {"gpu": 0, "host": 0}
    for item in est.items:
        shown = (item.lifetime == "held" and item.id not in NOT_RECORDED) or item.id in RECORDED_STEP_ITEMS
        if shown and item.category != "activations":
            totals[item.device] += item.bytes
    return totals


def test_fourteen_recordings_and_the_model_they_used(small_model):
    assert len(RECORDINGS) == 14
    assert small_model.total_params == 2_622_720  # the numel of every recording's parameters
    for name in RECORDINGS:
        rec = json.loads((DATA / f"{name}.json").read_text())
        assert rec["spec"].get("size", "small") == "small"
        assert sum(e["numel"] for e in rec["after_step"] if e["name"].startswith("param ") and "ds_numel" not in e
                   and rec["spec"]["engine"] == "fsdp2") in (0, 2_622_720)


@pytest.mark.parametrize("name", RECORDINGS)
def test_model_state_bytes_per_device_match_the_recording(name, small_model):
    rec = json.loads((DATA / f"{name}.json").read_text())
    recorded = recorded_bytes(rec)
    estimated = estimated_bytes(rec, small_model)
    for device in ("gpu", "host"):
        diff = recorded[device] - estimated[device]
        assert 0 <= diff <= SCALAR_SLACK, (
            f"{name} {device}: recorded {recorded[device]:,} B, shardkit estimates {estimated[device]:,} B "
            f"(difference {diff:,} B)"
        )


def test_the_recordings_hold_what_deepspeeds_own_estimator_leaves_out(small_model):
    """The offload-both run keeps the persistent parameters whole on the GPU (1 MiB here) and 13 MiB of pinned
    host memory for partitions and gradients: estimate_zero3_model_states_mem_needs has neither term."""
    rec = json.loads((DATA / "z3_offboth_pin.json").read_text())
    est = estimate_memory(small_model, settings_from_config(rec["spec"]["config"]), RunShape(micro_batch=2, seq_len=16))
    by_id = {i.id: i for i in est.items}
    assert by_id["z3.persistent"].device == "gpu" and by_id["z3.persistent"].bytes == 525_568 * 2
    assert recorded_bytes(rec)["gpu"] == 525_568 * 2
    assert by_id["z3.lp_partitions"].pinned and by_id["z3.grad_partitions"].pinned
