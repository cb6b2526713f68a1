"""ds_configs/: each preset is exactly what `shardkit config` generates, passes `shardkit check`,
and (where it runs on CPU) trains on 2 gloo ranks with a real engine."""

import json
import shlex

import pytest

from shardkit.checks import check_file
from shardkit.config.generate import PRESETS
from shardkit.config.loading import config_kind
from shardkit.run.spawn.process import run_ranks
from tests import _ranks_presets as targets
from tests.conftest import DS_CONFIGS

REQUIRED = {
    "zero2", "zero3", "zero3_bf16", "zero3_offload_cpu", "zero3_offload_param_only", "zero3_offload_nvme",
    "fsdp2_full_shard", "fsdp2_cpu_offload",
}
# nvme offload needs a real NVMe path and libaio: not runnable on a CPU-only CI machine
CPU_RUNNABLE = sorted(REQUIRED - {"zero3_offload_nvme"})


def load(name):
    return json.loads((DS_CONFIGS / f"{name}.json").read_text())


def test_every_required_preset_exists_and_no_stray_files():
    assert {p.stem for p in DS_CONFIGS.glob("*.json")} == REQUIRED == set(PRESETS)


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_preset_equals_generator_output(run_cli, name, monkeypatch):
    # The preset's bytes, not this machine's memlock limit (a non-root box below the nvme buffers'
    # size refuses to write the nvme preset, rightly, for a run here).
    import shardkit.platform.environment.facts as environment_facts

    monkeypatch.setattr(environment_facts, "probe_memlock", lambda: None)
    code, out, _ = run_cli("config", *PRESETS[name])
    assert code == 0
    assert json.loads(out) == load(name), (
        f"ds_configs/{name}.json is stale: regenerate with `shardkit config {shlex.join(PRESETS[name])} "
        f"-o ds_configs/{name}.json`"
    )


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_preset_passes_check(name):
    # the preset alone: this machine's environment (ulimit -l vs nvme buffers ...) is not the preset's
    report = check_file(DS_CONFIGS / f"{name}.json", world_size=8, accelerator=True, environment=None)
    assert report.ok, report.to_json()
    # only the deliberate param-only offload may warn (fp32 masters stay on the GPU)
    assert [f.rule for f in report.findings] == (
        ["offload-param-without-optimizer"] if name == "zero3_offload_param_only" else []
    )


def test_presets_say_what_their_name_says():
    assert load("zero3_offload_nvme")["zero_optimization"]["offload_param"]["nvme_path"]
    both = load("zero3_offload_cpu")["zero_optimization"]
    assert both["offload_optimizer"]["device"] == both["offload_param"]["device"] == "cpu"
    assert "offload_optimizer" not in load("zero3_offload_param_only")["zero_optimization"]
    assert load("zero3_bf16")["bf16"]["enabled"] is True and load("zero3")["bf16"]["enabled"] is False
    assert load("zero2")["zero_optimization"]["stage"] == 2
    assert load("fsdp2_cpu_offload")["fsdp"]["cpu_offload"] is True and not load("fsdp2_full_shard")["fsdp"]["cpu_offload"]


@pytest.mark.slow
def test_cpu_presets_train_on_two_gloo_ranks():
    configs = {}
    for name in CPU_RUNNABLE:
        cfg = load(name)
        # a larger step than the presets' 1e-4 so one step visibly lowers the loss on the same batch
        if config_kind(cfg) == "fsdp":
            cfg["train"]["lr"] = 1e-2
        else:
            cfg["optimizer"]["params"]["lr"] = 1e-2
        configs[name] = cfg
    results = run_ranks(targets.presets_two_steps, 2, args=(configs,), timeout=420, backend="gloo")
    for r in results:
        assert set(r.value) == set(CPU_RUNNABLE)
        for name, (first, second) in r.value.items():
            assert second < first - 0.1, f"rank {r.rank} {name}: loss {first} -> {second} did not drop"
    losses = results[0].value
    # same model, data and math: the sharding/offload layout must not change the numbers
    assert losses["zero2"] == pytest.approx(losses["zero3"], abs=1e-4)
    assert losses["zero3_offload_cpu"] == pytest.approx(losses["zero3_bf16"], abs=1e-3)
    assert losses["zero3_offload_param_only"] == pytest.approx(losses["zero3_bf16"], abs=1e-3)
    assert losses["fsdp2_cpu_offload"] == pytest.approx(losses["fsdp2_full_shard"], abs=1e-3)
