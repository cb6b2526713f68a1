"""`shardkit config`: generated files are accepted by DeepSpeed itself and by `shardkit check`."""

import itertools
import json

import pytest
import yaml

from shardkit.checks import check_config
from shardkit.config.generate import deepspeed_config, fsdp_config
from shardkit.config.paths import auto_paths
from shardkit.core.errors import UsageError


def deepspeed_parses(cfg):
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig(json.loads(json.dumps(cfg)))  # offline: world size 1


MATRIX = [
    (3, oo, op, prec)
    for oo, op, prec in itertools.product(["none", "cpu", "nvme"], ["none", "cpu", "nvme"], ["bf16", "fp16", "fp32"])
] + [(2, oo, "none", prec) for oo, prec in itertools.product(["none", "cpu"], ["bf16", "fp16", "fp32"])]


@pytest.mark.parametrize("stage, offload_optimizer, offload_param, precision", MATRIX)
def test_every_combination_passes_deepspeed_and_shardkit_check(stage, offload_optimizer, offload_param, precision):
    nvme = "/local_nvme" if "nvme" in (offload_optimizer, offload_param) else None
    cfg = deepspeed_config(
        stage, offload_optimizer=offload_optimizer, offload_param=offload_param, nvme_path=nvme,
        precision=precision, micro_batch=2, grad_accum=3, world_size=1,
    )
    ds = deepspeed_parses(cfg)
    assert ds.zero_optimization_stage == stage and ds.train_batch_size == 6
    assert ds.zero_config.offload_optimizer is None or ds.zero_config.offload_optimizer.device == offload_optimizer
    report = check_config(cfg, world_size=1)
    assert report.ok, report.to_json()
    assert not auto_paths(cfg)


def test_values_are_concrete_and_pin_memory_explicit():
    cfg = deepspeed_config(3, offload_optimizer="cpu", offload_param="cpu", world_size=8, micro_batch=4, grad_accum=2)
    assert cfg["train_batch_size"] == 64
    z = cfg["zero_optimization"]
    assert z["offload_optimizer"]["pin_memory"] is True and z["offload_param"]["pin_memory"] is True
    assert z["stage3_gather_16bit_weights_on_model_save"] is True
    assert check_config(cfg, world_size=8).ok and not check_config(cfg, world_size=4).ok


def test_hf_auto_emits_auto_that_only_passes_when_expected(run_cli, tmp_path):
    out = tmp_path / "hf.json"
    code, _, err = run_cli("config", "zero3", "--hf-auto", "--accelerator", "-o", out)
    # the message names the check mode it passed, and says plain check refuses the "auto" values
    assert code == 0 and f"passes `shardkit check {out} --hf-auto --accelerator`" in err
    assert 'plain `shardkit check` refuses its "auto" values' in err
    cfg = json.loads(out.read_text())
    autos = set(auto_paths(cfg))
    assert {"train_micro_batch_size_per_gpu", "optimizer.params.lr", "zero_optimization.reduce_bucket_size"} <= autos
    # DeepSpeed drops nested "auto"s itself; the top-level batch/clip ones are what the HF Trainer fills
    deepspeed_parses({k: (1 if v == "auto" else v) for k, v in cfg.items()})
    assert run_cli("check", out, "--hf-auto")[0] == 0
    code, stdout, _ = run_cli("check", out, "--json")
    findings = json.loads(stdout)["findings"]
    # plain check: one finding for the one cause (it used to be 12 near-identical rows), and nothing else
    assert code == 1 and len(findings) == 1 and findings[0]["rule"] == "auto-value"
    assert set(findings[0]["value"]) == autos and len(autos) == 12


@pytest.mark.parametrize(
    "argv, message",
    [
        (["zero3", "--offload-optimizer", "nvme"], "needs --nvme-path"),
        (["zero3", "--nvme-path", "/x"], "--nvme-path is only used with"),
        (["zero3", "--micro-batch", "0"], "--micro-batch 0"),
        (["zero3", "--clip", "-1"], "--clip -1"),
        (["zero2", "--offload-param", "cpu"], "unrecognized arguments"),
        (["zero2", "--offload-optimizer", "nvme"], "invalid choice"),
        (["fsdp", "--pin-memory"], "only applies with --cpu-offload"),
        (["zero4"], "invalid choice"),
    ],
)
def test_combinations_deepspeed_would_ignore_are_usage_errors(run_cli, tmp_path, argv, message):
    out = tmp_path / "x.json"
    code, _, err = run_cli("config", *argv, "-o", out)
    assert code == 2 and message in err
    assert not out.exists()


def test_library_refuses_param_offload_at_zero2():
    with pytest.raises(UsageError, match="ZeRO-2 would ignore it silently"):
        deepspeed_config(2, offload_param="cpu")


def test_fsdp_config_round_trips_through_check(run_cli, tmp_path):
    out = tmp_path / "fsdp.json"
    code, _, _ = run_cli("config", "fsdp", "--cpu-offload", "--wrap", "LlamaDecoderLayer", "LlamaMLP",
                         "--no-reshard-after-forward", "--state-dict", "full", "-o", out)
    cfg = json.loads(out.read_text())
    assert code == 0 and cfg["fsdp"] == {
        "reshard_after_forward": False, "cpu_offload": True, "pin_memory": False, "mixed_precision": "bf16",
        "wrap": ["LlamaDecoderLayer", "LlamaMLP"], "state_dict": "full",
    }
    assert run_cli("check", out, "--no-accelerator", "--model", "llama:tiny")[0] == 0


def test_accelerate_format_is_the_equivalent_fsdp2_section(run_cli, tmp_path):
    out = tmp_path / "accelerate.yaml"
    code, _, _ = run_cli("config", "fsdp", "--format", "accelerate", "--cpu-offload", "--world-size", "8", "-o", out)
    cfg = yaml.safe_load(out.read_text())
    assert code == 0 and cfg["distributed_type"] == "FSDP" and cfg["num_processes"] == 8
    assert cfg["mixed_precision"] == "bf16"
    assert cfg["fsdp_config"] == {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "fsdp_reshard_after_forward": True,
        "fsdp_offload_params": True,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_activation_checkpointing": False,
    }
    assert run_cli("check", out)[0] == 0


def test_stdout_output_is_pure_json(run_cli):
    code, out, _ = run_cli("config", "zero2", "--offload-optimizer", "cpu")
    assert code == 0 and json.loads(out)["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_fsdp_generator_defaults():
    cfg = fsdp_config()
    assert cfg["fsdp"]["wrap"] == ["LlamaDecoderLayer"] and cfg["fsdp"]["pin_memory"] is False


# --- config judges the file as the `shardkit check` it names (this machine's environment) --------


@pytest.fixture
def machine(monkeypatch):
    """This machine's probes, forced: set(cuda=..., cpu_fp16=..., env) for the test's case."""
    from shardkit.platform.environment import facts as environment_facts
    from shardkit.platform.environment import fp16 as environment_fp16
    from shardkit.platform.environment.accelerator import CudaProbe

    for name in ("TORCH_CUDA_ARCH_LIST", "DS_PIN_MEMORY_BACKEND", "DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)

    def force(*, cuda=CudaProbe(build=None, available=None), cpu_fp16=False, **env):
        monkeypatch.setattr(environment_facts, "probe_cuda", lambda: cuda)
        monkeypatch.setattr(environment_fp16, "probe_cpu_fp16", lambda: cpu_fp16)
        monkeypatch.setattr(environment_facts, "probe_memlock", lambda: None)
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return force


def test_config_never_claims_a_check_that_fails_on_this_machine(run_cli, machine, tmp_path):
    """fp16 on a CPU without oneDNN fp16: `config ... --no-accelerator` used to write the file and
    claim `passes shardkit check FILE --no-accelerator`, which then reported 1 error."""
    machine(cpu_fp16=False)
    out = tmp_path / "f.json"
    code, _, err = run_cli("config", "zero3", "--precision", "fp16", "--no-accelerator", "-o", out)
    assert code == 1 and not out.exists(), err
    assert f"{out}: not written: `shardkit check {out} --no-accelerator` would report 1 error(s) on this machine: " \
        "fp16.enabled=True: fp16 on a CPU run" in err
    assert "AVX512-FP16" in err and "Fix: use bf16 on CPU runs" in err
    # judged from the machine (no flag): the same, and it says how to state a GPU run
    code, _, err = run_cli("config", "zero3", "--precision", "fp16", "-o", out)
    assert code == 1 and not out.exists() and "pass --accelerator if it runs on a GPU machine" in err
    # what it claims otherwise is what the named command says
    code, _, err = run_cli("config", "zero3", "--precision", "fp16", "--accelerator", "-o", out)
    assert code == 0 and f"passes `shardkit check {out} --accelerator`" in err
    assert run_cli("check", out, "--accelerator")[0] == 0
    machine(cpu_fp16=True)
    code, _, err = run_cli("config", "zero3", "--precision", "fp16", "--no-accelerator", "-o", out)
    assert code == 0 and f"passes `shardkit check {out} --no-accelerator`" in err
    assert run_cli("check", out, "--no-accelerator")[0] == 0


def test_config_pin_memory_follows_deepspeeds_accelerator(run_cli, machine, monkeypatch, tmp_path):
    """The run has an accelerator exactly when DeepSpeed picks one (environment.facts.run_has_accelerator):
    an MPS/XPU torch (torch.accelerator says yes, DeepSpeed runs on its CPU accelerator) or
    DS_ACCELERATOR=cpu on a GPU machine writes pin_memory false, as preflight's CPU ranks want."""
    import torch

    def pin(*argv):
        out = tmp_path / "p.json"
        code, _, err = run_cli("config", "zero3", "--offload-optimizer", "cpu", *argv, "-o", out)
        assert code == 0, err
        return json.loads(out.read_text())["zero_optimization"]["offload_optimizer"]["pin_memory"], err

    from shardkit.platform.environment.accelerator import CudaProbe

    gpu = CudaProbe(build="12.8", available=True, device_count=1)
    machine()
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)  # an MPS or XPU machine
    value, err = pin()
    assert value is False and "pin_memory false because the run has no accelerator (judged from this machine" in err
    machine(cuda=gpu)
    assert pin()[0] is True
    machine(cuda=gpu, DS_ACCELERATOR="cpu")
    assert pin()[0] is False
    assert pin("--accelerator")[0] is True
