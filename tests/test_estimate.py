"""`shardkit estimate` and `shardkit config ... --fit`: the arithmetic at world sizes above one (padding,
persistence, sub-groups, ratio), the inputs and every user-facing error, the command's exit codes and JSON,
the fit ladder, and the DeepSpeed issue 4527 accounting that docs/estimate.md quotes. The per-device bytes
against the GPU recordings are in tests/test_estimate_gpu_truth.py."""

from __future__ import annotations

import json
import re

import pytest

from shardkit.cli import main
from shardkit.core.errors import ConfigError, UsageError
from shardkit.estimate.compute import estimate_memory
from shardkit.estimate.fsdp import sharded_elements
from shardkit.estimate.meta_model import model_shape, shape_from_config_dict
from shardkit.estimate.model import ModelShape, ParamShape, from_count
from shardkit.estimate.report import RunShape
from shardkit.estimate.settings import FSDPSettings, ZeroSettings, settings_from_config
from shardkit.estimate.units import parse_count, parse_size
from shardkit.estimate.zero import _sub_groups

MIB = 2**20
LLAMA_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096}
SMALL = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 1024,
         "vocab_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 128}


def _items(est) -> dict:
    return {i.id: i for i in est.items}


def _toy() -> ModelShape:
    """Five parameters of known shapes: 7x3, 5, 100, 4x4, 9."""
    shapes = [("a", 21, 7, "l0"), ("b", 5, 5, "l0"), ("c", 100, 10, "l1"), ("d", 16, 4, "l1"), ("e", 9, 9, "")]
    params = tuple(ParamShape(n, k, d0, u) for n, k, d0, u in shapes)
    return ModelShape("toy", total_params=151, params=params, largest_layer_params=100)


# --- sizes and counts ---------------------------------------------------------------------------------

def test_sizes_decimal_and_binary_are_kept_apart():
    assert parse_size("80GB", "--gpu-memory") == 80 * 10**9
    assert parse_size("80GiB", "--gpu-memory") == 80 * 2**30
    assert parse_size("1.5 TiB", "--host-memory") == int(1.5 * 2**40)
    assert parse_count("6805M", "--params") == 6_805_000_000
    assert parse_count("6.8e9", "--params") == 6_800_000_000


@pytest.mark.parametrize("text, why", [("bad", "not a number followed by a unit"), ("80", "bare number is ambiguous"),
                                       ("80G", "could be decimal or binary"), ("80 parsecs", "not a number")])
def test_unreadable_sizes_name_the_flag_the_value_and_the_fix(text, why):
    with pytest.raises(UsageError, match=rf"--gpu-memory '{text}': cannot read a memory size \(.*{why}.*80GiB"):
        parse_size(text, "--gpu-memory")
    with pytest.raises(UsageError, match="at least 1 byte"):
        parse_size("0GiB", "--gpu-memory")
    with pytest.raises(UsageError, match=r"--params '7 billion': not a parameter count.*6\.8e9"):
        parse_count("7 billion", "--params")


# --- ZeRO arithmetic at a world size above one -------------------------------------------------------------

def test_zero3_partitions_round_up_per_parameter_and_persistence_follows_deepspeed():
    s = ZeroSettings(stage=3, param_persistence_threshold=16, contiguous_gradients=False)
    est = estimate_memory(_toy(), s, RunShape(world_size=4, seq_len=1))
    items = _items(est)
    # ceil(21/4)+ceil(5/4)+ceil(100/4)+ceil(16/4)+ceil(9/4) = 6+2+25+4+3
    assert items["z3.lp_partitions"].bytes == 40 * 2
    assert items["z3.grad_partitions"].bytes == 40 * 2
    assert items["z3.fp32_masters"].bytes == 40 * 4 and items["z3.optimizer_state"].bytes == 40 * 8
    assert items["z3.persistent"].bytes == (5 + 16 + 9) * 2  # numel <= 16, whole, on every GPU
    # model_persistence_threshold caps the running total in named_parameters order (b fits, d would not)
    capped = estimate_memory(_toy(), ZeroSettings(stage=3, param_persistence_threshold=16,
                                                  model_persistence_threshold=20), RunShape(world_size=4, seq_len=1))
    assert _items(capped)["z3.persistent"].bytes == (5 + 9) * 2


def test_zero3_sub_groups_and_partial_offload_ratio():
    assert _sub_groups([6, 2, 25, 4, 3], 8).sizes() == [8, 25, 7]  # a group closes once it reaches sub_group_size
    s = ZeroSettings(stage=3, offload_optimizer="cpu", ratio=0.5, sub_group_size=8)
    items = _items(estimate_memory(_toy(), s, RunShape(world_size=4, seq_len=1)))
    # 3 sub-groups, the last int((1-0.5)*3)=1.. on the CPU: groups 1 and 2 (25+7) on the host, group 0 (8) on the GPU
    assert items["z3.fp32_masters"].device == "host" and items["z3.fp32_masters"].bytes == 32 * 4
    assert items["z3.fp32_masters_gpu"].bytes == 8 * 4
    assert items["z3.optimizer_state_gpu"].bytes == 8 * 8 and items["z3.fp32_grads_gpu"].bytes == 8 * 4


def test_zero3_fp32_reuses_partitions_as_masters_and_nvme_uses_swap_buffers():
    fp32 = estimate_memory(_toy(), ZeroSettings(stage=3, precision="fp32"), RunShape(world_size=2, seq_len=1))
    assert "z3.fp32_masters" not in _items(fp32)
    assert any("reuses them" in n for n in fp32.notes)
    nvme = estimate_memory(_toy(), ZeroSettings(stage=3, offload_optimizer="nvme", offload_param="nvme"),
                           RunShape(world_size=2, seq_len=1))
    items = _items(nvme)
    assert "z3.fp32_masters" not in items and items["z3.nvme_swap"].pinned
    assert items["z3.lp_partitions"].bytes == 5 * 100_000_000 * 2  # offload_param buffer_count x buffer_size


def test_zero12_pads_the_flat_group_to_twice_the_world_size():
    est = estimate_memory(from_count(11), ZeroSettings(stage=2, contiguous_gradients=False), RunShape(world_size=4))
    items = _items(est)
    assert items["z12.params"].bytes == 16 * 2  # 11 padded to a multiple of 2 x 4
    assert items["z12.fp32_masters"].bytes == 4 * 4 and items["z12.optimizer_state"].bytes == 4 * 8
    assert items["z12.grads"].lifetime == "step" and items["z12.grads"].bytes == 4 * 2
    stage1 = _items(estimate_memory(from_count(11), ZeroSettings(stage=1), RunShape(world_size=4)))
    assert stage1["z12.grads"].bytes == 16 * 2 and "z12.reduce_bucket" not in stage1


def test_fsdp2_shards_dim0_rows_and_offload_moves_states_to_the_host():
    assert sharded_elements(_toy(), 2) == 4 * 3 + 3 * 1 + 5 * 10 + 2 * 4 + 5 * 1
    on = estimate_memory(_toy(), FSDPSettings(cpu_offload=True, pin_memory=True), RunShape(world_size=2, seq_len=1))
    items = _items(on)
    assert items["fsdp.params"].device == "host" and items["fsdp.params"].pinned
    assert items["fsdp.optimizer_state"].device == "host" and items["fsdp.step"].bytes == 5 * 4
    assert on.model_states("gpu") == 0


def test_whole_model_init_is_an_init_item_not_a_held_one():
    s = ZeroSettings(stage=3, offload_optimizer="cpu", offload_param="cpu")
    est = estimate_memory(from_count(1_000_000), s, RunShape(world_size=2, whole_model_init=True))
    items = _items(est)
    assert items["z3.init_gpu"].lifetime == "init" and items["z3.init_gpu"].bytes == 2_000_000
    assert est.per_gpu_peak() >= est.per_gpu_held() + 2_000_000


# --- settings from configs --------------------------------------------------------------------------------

def test_defaults_and_hf_auto_values_are_filled_and_reported():
    cfg = {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
           "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}}
    s = settings_from_config(cfg, hidden_size=4096)
    assert isinstance(s, ZeroSettings)
    assert (s.reduce_bucket_size, s.prefetch_bucket_size, s.param_persistence_threshold) == (4096**2, int(0.9 * 4096**2),
                                                                                            40960)
    assert s.precision == "bf16" and "reduce_bucket_size" in s.filled_auto and "sub_group_size" in s.defaults_used
    assert settings_from_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}) \
        .offload_optimizer == "cpu"  # DeepSpeed treats nvme as cpu below stage 3


@pytest.mark.parametrize("cfg, match", [
    ({"zero_optimization": {"stage": 7}}, r"zero_optimization\.stage=7: not a ZeRO stage.*Use 0, 1, 2 or 3"),
    ({"zero_optimization": {"stage": 3, "reduce_bucket_size": "big"}},
     r"zero_optimization\.reduce_bucket_size='big': not a whole number; accepted 0 to .*5e\+08"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}},
     r"offload_optimizer\.ratio=1\.5: must be between 0 and 1"),
    ({"distributed_type": "FSDP", "fsdp_config": {}}, r"an Accelerate config.*`shardkit config`"),
    ({"fsdp": {"sharding_strategy": "FULL_SHARD"}}, r"fsdp\.sharding_strategy='FULL_SHARD': FSDP1 option"),
    ({"model_type": "llama", "hidden_size": 64}, r"CONFIG is a model's config\.json \(model_type 'llama'\).*--model"),
])
def test_unusable_engine_configs_name_the_key_the_value_and_the_fix(cfg, match):
    with pytest.raises(ConfigError, match=match):
        settings_from_config(cfg)


# --- models -----------------------------------------------------------------------------------------------

def test_model_from_config_json_on_the_meta_device(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    m = model_shape(str(tmp_path))  # a folder holding config.json
    assert m.total_params == 2_622_720 and m.largest_layer_params == 262_144
    assert m.largest_unit_params() == 1_049_088 and m.root_params() == 524_544
    assert {p.unit for p in m.params} == {"", "model.layers.0", "model.layers.1"}


@pytest.mark.parametrize("content, match", [
    (None, r"no such file or folder.*--params N"),
    ("{not json", r"config\.json"),
    (json.dumps({"hidden_size": 8, "zero_optimization": {}}),
     r"has no \"model_type\" key.*looks like an engine config \(it has zero_optimization\): pass that as CONFIG"),
    (json.dumps({"model_type": "not-a-model"}), r"model_type 'not-a-model' is unknown to transformers.*--params N"),
])
def test_unusable_model_configs_say_what_and_how_to_fix(tmp_path, content, match):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        model_shape(str(path))


def test_a_folder_without_config_json_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"a folder without config\.json.*save_pretrained"):
        model_shape(str(tmp_path))


# --- the command --------------------------------------------------------------------------------------------

def test_estimate_command_exit_codes_and_json(capsys):
    argv = ["estimate", "ds_configs/zero3_offload_cpu.json", "--params", "6.8e9", "--largest-layer", "131M",
            "--world-size", "4"]
    assert main(argv + ["--gpu-memory", "80GiB", "--host-memory", "512GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is True and data["totals"]["gpu_model_states_bytes"] == 0
    assert {i["id"] for i in data["items"]} >= {"z3.lp_partitions", "z3.reduce_bucket", "z3.prefetch"}
    assert main(argv + ["--gpu-memory", "500MiB"]) == 1
    assert "does NOT fit in 500.00 MiB" in capsys.readouterr().out


def test_the_python_api_gives_the_command_s_estimate(tmp_path, capsys):
    """docs/estimate.md's Python example: ``shardkit.estimate_memory`` on the same inputs prints the same
    totals as ``shardkit estimate --json``."""
    import shardkit

    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    est = shardkit.estimate_memory(shardkit.model_shape(str(tmp_path / "config.json")),
                                   shardkit.settings_from_config(cfg, hidden_size=SMALL["hidden_size"]),
                                   shardkit.RunShape(world_size=8, gpus_per_node=8, micro_batch=4, seq_len=4096),
                                   gpu_memory=80 * 2**30)
    assert main(["estimate", str(tmp_path / "ds.json"), "--model", str(tmp_path / "config.json"), "--world-size", "8",
                 "--gpus-per-node", "8", "--micro-batch", "4", "--seq-len", "4096", "--gpu-memory", "80GiB",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert est.totals() == data["totals"] and est.fits() is data["fits"] is True
    assert est.totals()["gpu_peak_bytes"] > est.totals()["gpu_held_bytes"] > 0


@pytest.mark.parametrize("argv, match", [
    (["--params", "7B", "--gpu-memory", "80G"], r"--gpu-memory '80G': cannot read a memory size"),
    (["--params", "7B", "--model", "x.json"], r"give one"),
    ([], r"no model: pass --model"),
    (["--model", "x/config.json", "--largest-layer", "5"], r"--largest-layer 5: only with --params"),
    (["ds_configs/zero3.json", "--engine", "fsdp2", "--params", "7B"], r"CONFIG ds_configs/zero3\.json and --engine fsdp2"),
    (["--params", "7B", "--world-size", "2", "--gpus-per-node", "4"], r"--gpus-per-node 4 is more than --world-size 2"),
    (["--engine", "zero2", "--offload-param", "cpu", "--params", "7B"], r"--offload-param needs --engine zero3"),
])
def test_estimate_usage_errors_exit_2_with_one_line(capsys, argv, match):
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert re.search(match, err), err


def test_config_fit_chooses_the_least_offloading_config_that_fits(tmp_path, capsys):
    out = tmp_path / "ds.json"
    base = ["config", "zero3", "--params", "7B", "--largest-layer", "131M", "--world-size", "8", "--no-accelerator",
            "-o", str(out)]
    assert main(base + ["--fit", "80GiB,1TiB"]) == 0
    zero = json.loads(out.read_text())["zero_optimization"]
    assert "offload_optimizer" not in zero and "offload_param" not in zero  # 7B on 8 x 80 GiB needs no offload
    err = capsys.readouterr().err
    assert "no offload: chosen" in err
    assert main(base + ["--fit", "16GiB,1TiB"]) == 0  # 7B x 16 B / 8 = 13 GiB of model states: the optimizer goes
    zero = json.loads(out.read_text())["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and "offload_param" not in zero
    assert "no offload: does not fit" in capsys.readouterr().err


def test_config_fit_refuses_what_nothing_fits_and_explicit_offload(tmp_path, capsys):
    out = tmp_path / "ds.json"
    base = ["config", "zero3", "--params", "70B", "--world-size", "2", "--no-accelerator", "-o", str(out)]
    assert main(base + ["--fit", "8GiB,64GiB"]) == 1
    err = capsys.readouterr().err
    assert "no zero3 config fits 2 rank(s)" in err and "--world-size" in err and not out.exists()
    assert main(base + ["--fit", "80GiB", "--offload-param", "cpu"]) == 2
    assert "--fit chooses the offload itself: drop --offload-param" in capsys.readouterr().err


def test_config_fit_fsdp_keeps_gathered_parameters_when_they_fit(tmp_path):
    out = tmp_path / "fsdp.json"
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    assert main(["config", "fsdp", "--model", str(tmp_path), "--world-size", "2", "--fit", "1GiB", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["fsdp"]["reshard_after_forward"] is False


# --- DeepSpeed issue 4527 (docs/estimate.md) ----------------------------------------------------------------

def test_issue_4527_accounting():
    """6.8B, 4 GPUs, offload_optimizer and offload_param cpu, DeepSpeed defaults: DeepSpeed's estimator says
    0.49 GB per GPU (4 x largest layer); 14,678 MiB were in use after initialize."""
    s = settings_from_config({"fp16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}})
    run = RunShape(world_size=4, gpus_per_node=4, micro_batch=1, seq_len=2048, whole_model_init=True)
    est = estimate_memory(from_count(6_805_000_000, 131_000_000), s, run)
    items = _items(est)
    assert 4 * 131_000_000 / 2**30 == pytest.approx(0.488, abs=1e-3)  # DeepSpeed's "0.49GB"
    assert items["z3.init_gpu"].bytes / MIB == pytest.approx(12_980, abs=1)  # whole 16-bit model, engine.py .to()
    assert items["z3.reduce_bucket"].bytes / MIB == pytest.approx(953.7, abs=0.1)  # reduce_bucket_size 5e8 x 2 B
    assert est.model_states("gpu") == 0
    assert est.per_gpu_peak() / MIB == pytest.approx(13_934, abs=1)  # the estimate's per-GPU peak
    assert items["z3.reduce_scatter_copy"].bytes / 2**30 == pytest.approx(1.16, abs=0.01)
    assert est.per_host_pinned() / 2**30 == pytest.approx(50.7, abs=0.1)
    derived = items["z3.init_gpu"].bytes + items["z3.reduce_bucket"].bytes
    assert (14_678 * MIB - derived) / MIB == pytest.approx(744, abs=2)  # left for the CUDA context and workspaces
    # with the Llama-7B shapes: the persistent parameters (the 65 norms) are 0.5 MiB, the gathered layer 250 MiB
    llama = shape_from_config_dict(LLAMA_7B, "llama-7b")
    items7 = _items(estimate_memory(llama, s, run))
    assert items7["z3.persistent"].bytes == 65 * 4096 * 2
    assert items7["z3.gathered"].bytes / MIB == pytest.approx(250, abs=0.1)
    assert items7["act.layers"].bytes / 2**30 == pytest.approx(11.9, abs=0.1)  # 2048 tokens, no checkpointing


@pytest.mark.slow
def test_a_hub_id_that_cannot_be_fetched_says_how_to_go_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads HF_HUB_OFFLINE once, at import: another test of this worker imported it
    # already, and the environment variable alone then left 23 s of retries (1+2+4+8+8 s) to a test of one message
    hub_constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match=r"--model org/not-here: not a local path.*Download its config\.json"):
        model_shape("org/not-here")
