"""`shardkit smoke` on every ds_configs/ preset that trains on CPU: each must resume bit-exact.

The bf16 presets once failed at the first resumed step's update, because DeepSpeed's
CPU Adam kernels keep beta**step outside the checkpoint (shardkit/checkpoint/ops/cpu_adam_kernel.py).
The smoke's default configs (the zero3 and fsdp2_full_shard presets) run in test_smoke.py; this
file runs the others and checks that no preset is left out without a reason.
"""

from __future__ import annotations

import json

import pytest

from shardkit.config.loading import config_kind
from tests.conftest import DS_CONFIGS

PRESETS = sorted(p.stem for p in DS_CONFIGS.glob("*.json"))
# Presets the smoke does not run, and why.
NOT_SMOKED = {
    "zero3_offload_nvme": "needs a real NVMe path (nvme_path) and libaio; not runnable on a CPU-only machine",
    "zero2": "the smoke resumes ZeRO-3 and FSDP2 only; zero2 training on 2 CPU ranks is test_presets.py's",
}
# The smoke's default configs, smoked by test_smoke.py::test_smoke_resumes_bit_exact.
SMOKED_AS_DEFAULT = {"zero3": "zero3", "fsdp2_full_shard": "fsdp2"}
SMOKED_HERE = [p for p in PRESETS if p not in NOT_SMOKED and p not in SMOKED_AS_DEFAULT]


def _load(name: str) -> dict:
    return json.loads((DS_CONFIGS / f"{name}.json").read_text())


def _engine(cfg: dict) -> str:
    return "fsdp2" if config_kind(cfg) == "fsdp" else "zero3"


def _uses_fp16(cfg: dict) -> bool:
    if config_kind(cfg) == "fsdp":
        return (cfg.get("fsdp") or {}).get("mixed_precision") == "fp16"
    return bool((cfg.get("fp16") or {}).get("enabled"))


def test_every_preset_is_smoked_or_excluded_with_a_reason():
    from shardkit.run.smoke.options import PRESET_CANDIDATES

    assert set(SMOKED_AS_DEFAULT) | set(NOT_SMOKED) <= set(PRESETS)
    assert set(SMOKED_HERE) >= {"zero3_bf16", "zero3_offload_cpu"}  # the two that once failed
    # the presets left to test_smoke.py really are what `shardkit smoke` runs without --config
    for preset, engine in SMOKED_AS_DEFAULT.items():
        assert PRESET_CANDIDATES[engine][0] == f"{preset}.json"


def test_default_zero3_config_output_is_a_smoked_preset(run_cli, tmp_path):
    """`shardkit config zero3` with no options (bf16) is the config that once failed."""
    code, _, err = run_cli("config", "zero3", "-o", tmp_path / "ds.json")
    assert code == 0, err
    generated = json.loads((tmp_path / "ds.json").read_text())
    same = [p for p in PRESETS if _load(p) == generated]
    assert same and set(same) <= set(SMOKED_HERE) | set(SMOKED_AS_DEFAULT), same


@pytest.mark.slow
@pytest.mark.parametrize("name", SMOKED_HERE)
def test_smoke_resumes_bit_exact_on_preset(name, run_cli, tmp_path):
    from shardkit.platform.environment.fp16 import fp16_support

    cfg = _load(name)
    if _uses_fp16(cfg):
        support = fp16_support(device="cpu")
        if not support.supported:
            pytest.skip(f"{name} trains in fp16: {support.reason}")
    engine = _engine(cfg)
    out_json = tmp_path / "smoke.json"
    code, out, err = run_cli("smoke", "--engine", engine, "--config", DS_CONFIGS / f"{name}.json", "--nproc", "2",
                             "--device", "cpu", "--steps", "4", "--json", out_json, "--quiet")
    report = json.loads(out_json.read_text())
    (result,) = report["results"]
    assert code == 0 and result["ok"], f"{name}: {result['failure']}\n{out}{err}"
    assert result["exact"] and result["losses_resumed"] == result["losses_uninterrupted"]
    assert len(result["losses_uninterrupted"]) == 2 and len(result["losses_uninterrupted"][0]) == 4
    assert result["preflight"] == "passed"
    assert result["config_source"].endswith(f"{name}.json")
