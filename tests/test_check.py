"""`shardkit check`: every rule names the key, the value, why and the fix; exit codes 0/1/2."""

import json
import subprocess
import sys

import pytest

from shardkit.checks import check_config, check_file
from tests.conftest import DS_CONFIGS

BASE = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


def zero(stage, **kw):
    z = {"stage": stage, **kw}
    if stage == 3:
        z.setdefault("stage3_gather_16bit_weights_on_model_save", True)
    return {**BASE, "zero_optimization": z}


def by_key(report):
    return {f.key: f for f in report.findings}


def write(tmp_path, cfg, name="ds.json"):
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return p


# --- exit codes and output -------------------------------------------------------------------


def test_clean_preset_exits_0(run_cli):
    code, out, _ = run_cli("check", DS_CONFIGS / "zero3.json")
    assert code == 0 and "no findings" in out


def test_error_exits_1_and_the_table_names_key_value_and_fix(run_cli, tmp_path):
    p = write(tmp_path, zero(2, offload_param={"device": "cpu", "pin_memory": False}))
    code, out, _ = run_cli("check", p)
    assert code == 1
    assert "zero_optimization.offload_param.device" in out and "ignores it silently" in out
    assert "1 error(s)" in out


def test_json_output_is_pure_json_with_every_field(run_cli, tmp_path):
    p = write(tmp_path, zero(2, offload_param={"device": "cpu", "pin_memory": False}))
    code, out, _ = run_cli("check", p, "--json")
    data = json.loads(out)
    assert code == 1 and data["errors"] == 1
    f = next(f for f in data["findings"] if f["rule"] == "offload-param-stage")
    assert f == {**f, "severity": "error", "key": "zero_optimization.offload_param.device", "value": "cpu"}
    assert f["message"] and f["fix"]


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, r"no such file"),
        (b"", r"is empty"),
        (b'{"zero_optimization": {"stage": 3,', r"invalid JSON \(expecting .* at line 1, column 35\), and not valid hjson \(DeepSpeed's own loader\)"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", r"is not UTF-8 text"),
        (b"[1, 2]", r"top level is list"),
        (b"key: [unclosed", r"neither valid JSON nor valid YAML"),
    ],
)
def test_unusable_files_give_one_line_and_no_traceback(run_cli, tmp_path, content, expected):
    import re

    p = tmp_path / "cfg.json"
    if content is not None:
        p.write_bytes(content)
    code, out, err = run_cli("check", p)
    assert code == 1
    assert re.search(expected, err) and "Traceback" not in err + out
    assert len(err.strip().splitlines()) == 1


def test_directory_and_unreadable_file(run_cli, tmp_path):
    code, _, err = run_cli("check", tmp_path)
    assert code == 1 and "is a directory" in err
    p = write(tmp_path, BASE)
    p.chmod(0)
    try:
        if p.open("rb").readable():  # running as root: permissions do not apply
            pytest.skip("root can read a mode-000 file")
    except PermissionError:
        code, _, err = run_cli("check", p)
        assert code == 1 and "cannot be read" in err
    finally:
        p.chmod(0o644)


def test_usage_errors_exit_2(run_cli, tmp_path):
    p = write(tmp_path, BASE)
    assert run_cli("check", p, "--world-size", "0")[0] == 2
    code, _, err = run_cli("check", p, "--deepspeed-version", "banana")
    assert code == 2 and "--deepspeed-version 'banana'" in err
    assert run_cli("check")[0] == 2


# --- DeepSpeed schema -------------------------------------------------------------------------


def test_schema_errors_have_full_key_paths_and_readable_messages():
    cfg = zero(3, offload_param={"device": "gpu", "pin_memory": False, "bogus": 1}, stage3_prefetch_bucket_size="x")
    found = by_key(check_config(cfg))
    assert "'none', 'cpu' or 'nvme'" in found["zero_optimization.offload_param.device"].message
    assert found["zero_optimization.offload_param.device"].value == "gpu"
    assert "unknown key" in found["zero_optimization.offload_param.bogus"].message
    assert "valid integer" in found["zero_optimization.stage3_prefetch_bucket_size"].message


def test_every_bad_section_is_reported_not_just_the_first():
    cfg = {**zero(3, bogus_zero=1), "fp16": {"enabled": False, "bogus_fp16": 1}, "comms_logger": {"enabled": 3}}
    keys = set(by_key(check_config(cfg)))
    assert {"zero_optimization.bogus_zero", "fp16.bogus_fp16", "comms_logger.enabled"} <= keys


def test_unknown_key_suggests_the_real_one():
    found = by_key(check_config(zero(3, offload_optimizer={"device": "cpu", "pin_memery": True})))
    f = found["zero_optimization.offload_optimizer.pin_memery"]
    assert "did you mean 'pin_memory'" in f.message and f.fix.endswith("offload_optimizer.pin_memory")


def test_misspelled_top_level_section_is_an_error_because_deepspeed_ignores_it():
    cfg = {**BASE, "zero_optimisation": {"stage": 3}}
    f = by_key(check_config(cfg))["zero_optimisation"]
    assert f.severity.value == "error" and "'zero_optimization'" in f.fix


def test_unread_top_level_key_is_a_warning():
    f = by_key(check_config({**BASE, "my_project_notes": "x"}))["my_project_notes"]
    assert f.severity.value == "warning" and "never reads" in f.message


def test_deprecated_key_surfaces_deepspeeds_own_warning():
    found = by_key(check_config(zero(2, cpu_offload=True)))
    assert "deprecated" in found["zero_optimization.cpu_offload"].message


def test_removed_feature_is_refused_with_deepspeeds_reason():
    f = by_key(check_config({**BASE, "amp": {"enabled": True}}))["amp"]
    assert f.severity.value == "error" and "Apex" in f.message


# --- "auto" -----------------------------------------------------------------------------------


def test_auto_values_are_errors_unless_hf_auto_is_expected():
    cfg = {**zero(3, stage3_prefetch_bucket_size="auto"), "train_micro_batch_size_per_gpu": "auto"}
    report = check_config(cfg)
    # one cause, one finding: it lists every "auto" key and says how to check an HF Trainer file
    (auto,) = [f for f in report.findings if f.rule == "auto-value"]
    assert set(auto.value) == {"zero_optimization.stage3_prefetch_bucket_size", "train_micro_batch_size_per_gpu"}
    assert auto.key == "train_micro_batch_size_per_gpu (+1 more)"
    assert '"auto" in 2 key(s)' in auto.message and "drops each such key silently" in auto.message
    assert "shardkit check --hf-auto" in auto.fix
    assert check_config(cfg, expect_hf_auto=True).ok


def test_auto_detected_before_deepspeed_drops_it(run_cli, tmp_path):
    # DeepSpeed itself accepts this file (it drops the key); shardkit must not.
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = zero(3, offload_optimizer={"device": "auto"})
    DeepSpeedConfig(json.loads(json.dumps(cfg)))
    code, out, _ = run_cli("check", write(tmp_path, cfg), "--json")
    assert code == 1 and json.loads(out)["findings"][0]["key"] == "zero_optimization.offload_optimizer.device"


# --- offload ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_rules_below_stage_3(stage):
    cfg = zero(
        stage,
        offload_optimizer={"device": "nvme", "nvme_path": "/nvme", "pin_memory": True, "ratio": 0.5},
        offload_param={"device": "cpu", "pin_memory": True},
    )
    found = by_key(check_config(cfg))
    assert found["zero_optimization.offload_param.device"].rule == "offload-param-stage"
    assert "treats it as cpu" in found["zero_optimization.offload_optimizer.device"].message
    assert found["zero_optimization.offload_optimizer.ratio"].value == 0.5
    # DeepSpeed's own refusal of the ratio is folded into the specific finding, not repeated
    assert "zero_optimization" not in found


def test_nvme_without_path_names_each_block():
    cfg = zero(3, offload_optimizer={"device": "nvme", "pin_memory": True}, offload_param={"device": "nvme", "pin_memory": True})
    found = by_key(check_config(cfg))
    assert "TypeError" in found["zero_optimization.offload_optimizer.nvme_path"].message
    assert "AssertionError" in found["zero_optimization.offload_param.nvme_path"].message


def test_param_offload_without_optimizer_offload_is_a_deliberate_warning():
    report = check_config(zero(3, offload_param={"device": "cpu", "pin_memory": True}))
    assert report.ok
    f = by_key(report)["zero_optimization.offload_param.device"]
    assert f.severity.value == "warning" and "Deliberate" in f.message


def test_nvme_params_with_cpu_optimizer_warns():
    cfg = zero(
        3,
        offload_optimizer={"device": "cpu", "pin_memory": True},
        offload_param={"device": "nvme", "nvme_path": "/nvme", "pin_memory": True},
    )
    f = by_key(check_config(cfg))["zero_optimization.offload_optimizer.device"]
    assert f.rule == "offload-nvme-param-cpu-optimizer"


def test_pin_memory_mismatch_unset_and_no_accelerator():
    mismatch = zero(3, offload_optimizer={"device": "cpu", "pin_memory": True}, offload_param={"device": "cpu", "pin_memory": False})
    assert by_key(check_config(mismatch))["zero_optimization.offload_param.pin_memory"].rule == "pin-memory-mismatch"

    unset = zero(3, offload_optimizer={"device": "cpu"})
    f = by_key(check_config(unset, deepspeed_version="0.19.4"))["zero_optimization.offload_optimizer.pin_memory"]
    assert f.rule == "pin-memory-unset" and "0.19.5 (PR #8207)" in f.message and "uses false" in f.message
    f = by_key(check_config(unset, deepspeed_version="0.19.8"))["zero_optimization.offload_optimizer.pin_memory"]
    assert "uses true" in f.message

    pinned = zero(3, offload_optimizer={"device": "cpu", "pin_memory": True})
    assert not check_config(pinned, accelerator=True).findings
    f = by_key(check_config(pinned, accelerator=False))["zero_optimization.offload_optimizer.pin_memory"]
    assert f.rule == "pin-memory-no-accelerator"


# --- precision, batch, optimizer, saving -----------------------------------------------------


def test_fp16_and_bf16_together_is_one_error():
    report = check_config({**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert [f.rule for f in report.errors] == ["fp16-and-bf16"]


@pytest.mark.parametrize(
    "batch, world, ok",
    [
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 4, True),
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 3, False),
        ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}, None, False),
        ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4}, 2, False),
        ({"train_batch_size": 12, "gradient_accumulation_steps": 2}, 3, True),
        ({"train_batch_size": 7}, 2, False),
    ],
)
def test_batch_arithmetic(batch, world, ok):
    cfg = {"optimizer": BASE["optimizer"], **batch}
    report = check_config(cfg, world_size=world)
    assert report.ok is ok, report.to_json()
    if not ok:
        assert report.errors[0].key == "train_batch_size" and "cannot hold" in report.errors[0].message


def test_no_batch_size_at_all():
    f = check_config({"optimizer": BASE["optimizer"]}).errors[0]
    assert f.key == "train_micro_batch_size_per_gpu" and "refuses to start" in f.message


def test_offload_without_optimizer_section_warns_about_client_optimizer():
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    f = by_key(check_config(cfg))["optimizer"]
    assert "zero_force_ds_cpu_optimizer" in f.fix and "PR #2971" in f.message
    cfg["zero_force_ds_cpu_optimizer"] = False
    assert "optimizer" not in by_key(check_config(cfg))


def test_offload_with_an_optimizer_without_cpu_version_is_an_error():
    cfg = {**zero(2, offload_optimizer={"device": "cpu", "pin_memory": True}), "optimizer": {"type": "Lamb", "params": {}}}
    assert by_key(check_config(cfg))["optimizer.type"].rule == "offload-optimizer-type"


def test_unknown_optimizer_name():
    cfg = {**BASE, "optimizer": {"type": "AdamWW", "params": {"lr": 0.1}}}
    found = by_key(check_config(cfg))
    assert "nor a torch.optim class" in found["optimizer.type"].message
    assert check_config({**BASE, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}).ok  # torch.optim.SGD


@pytest.mark.parametrize("value", [1.0, 0, 0.0])
def test_max_grad_norm_in_optimizer_params_is_an_error_for_any_value(value):
    # deepspeed/runtime/engine.py _configure_basic_optimizer raises ValueError whenever the key exists.
    cfg = {**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "max_grad_norm": value}}}
    report = check_config(cfg)
    f = by_key(report)["optimizer.params.max_grad_norm"]
    assert f.severity.value == "error" and not report.ok
    assert f.value == value
    assert f.fix == f'remove it and set top-level "gradient_clipping": {value}'


def test_gather_16bit_on_save_at_zero3():
    cfg = {**BASE, "zero_optimization": {"stage": 3}}
    f = by_key(check_config(cfg))["zero_optimization.stage3_gather_16bit_weights_on_model_save"]
    assert f.severity.value == "warning" and "zero_to_fp32" in f.message


def test_gradient_clipping_must_be_a_number():
    f = by_key(check_config({**BASE, "gradient_clipping": "1.0"}))["gradient_clipping"]
    assert f.severity.value == "error" and "got '1.0'" in f.message


def test_negative_gradient_clipping_is_named_as_no_clipping_at_all():
    # DeepSpeed 0.19.8 clips only when clip_grad > 0: a negative value is not an error at any step, it
    # silently disables clipping
    f = by_key(check_config({**BASE, "gradient_clipping": -1.0}))["gradient_clipping"]
    assert f.severity.value == "warning" and f.rule == "clipping-negative"
    assert "is negative (-1.0)" in f.message and "without gradient clipping" in f.message
    assert '"gradient_clipping": 1.0' in f.fix
    assert "gradient_clipping" not in by_key(check_config({**BASE, "gradient_clipping": 0}))


# --- FSDP2 and Accelerate configs --------------------------------------------------------------


def test_fsdp1_options_are_named_with_the_fsdp2_way():
    cfg = {"fsdp": {"wrap": ["LlamaDecoderLayer"], "forward_prefetch": True, "sharding_strategy": "FULL_SHARD", "use_orig_params": True, "sync_module_states": True}}
    found = by_key(check_config(cfg))
    assert "set_modules_to_forward_prefetch" in found["fsdp.forward_prefetch"].message
    assert "reshard_after_forward" in found["fsdp.sharding_strategy"].message
    assert "DTensor" in found["fsdp.use_orig_params"].message
    assert "broadcast_from_rank0" in found["fsdp.sync_module_states"].message


def test_fsdp_pinned_offload_without_accelerator_and_schema(run_cli, tmp_path):
    cfg = {"fsdp": {"wrap": ["LlamaDecoderLayer"], "cpu_offload": True, "pin_memory": True}}
    assert check_config(cfg, accelerator=True).ok
    f = by_key(check_config(cfg, accelerator=False))["fsdp.pin_memory"]
    assert f.rule == "fsdp-pin-no-accelerator"
    code, out, _ = run_cli("check", write(tmp_path, {"fsdp": {"mixed_precision": "int8", "wrap": ["X"]}}), "--json")
    assert code == 1 and json.loads(out)["findings"][0]["key"] == "fsdp.mixed_precision"


def test_fsdp_wrap_class_missing_from_the_model(run_cli):
    found = by_key(check_config({"fsdp": {"wrap": ["GPT2Block"]}}, model="llama:tiny"))
    assert "LlamaDecoderLayer" in found["fsdp.wrap"].message
    code, out, _ = run_cli("check", DS_CONFIGS / "fsdp2_full_shard.json", "--model", "llama:tiny")
    assert code == 0, out


def test_accelerate_fsdp2_config_with_fsdp1_options(tmp_path):
    text = "distributed_type: FSDP\ncompute_environment: LOCAL_MACHINE\nfsdp_config:\n  fsdp_version: 2\n  fsdp_forward_prefetch: true\n  fsdp_transformer_layer_cls_to_wrap: GPT2Block\n"
    p = tmp_path / "accelerate.yaml"
    p.write_text(text)
    found = by_key(check_file(p, model=["LlamaForCausalLM", "LlamaDecoderLayer"]))
    assert found["fsdp_config.fsdp_forward_prefetch"].rule == "fsdp1-option"
    assert found["fsdp_config.fsdp_transformer_layer_cls_to_wrap"].rule == "fsdp-wrap-missing"


def test_checking_an_fsdp_config_does_not_import_torch():
    code = (
        "import sys; from shardkit.cli import main\n"
        f"rc = main(['check', {str(DS_CONFIGS / 'fsdp2_full_shard.json')!r}])\n"
        "assert rc == 0, rc\n"
        "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


# --- what the HF Trainer's json.load refuses: an error with --hf-auto, a named warning without -------------

HF_READY = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "bf16": {"enabled": "auto"}}
_PLAIN = json.dumps(HF_READY, indent=1)
NOT_JSON = [
    # (file bytes, what the finding names, the fix it gives)
    (b"\xef\xbb\xbf" + _PLAIN.encode(), r"a UTF-8 byte order mark \(BOM, bytes EF BB BF\) at byte 0\.",
     "save the file as UTF-8 without a BOM"),
    (_PLAIN.replace('\n "train_batch_size"', '\n // the Trainer fills it\n "train_batch_size"', 1).encode(),
     r"a comment at line 8, column 2\.", "remove the comment at line 8, column 2"),
    (_PLAIN.replace('"auto"\n}', '"auto",\n}').replace('"auto"\n }', '"auto",\n }').encode(),
     r"a trailing comma at line \d+, column \d+\.", "remove the comma at line"),
    (_PLAIN.replace('"train_batch_size"', "train_batch_size").encode(),
     r"an unquoted key at line \d+, column 2\.", "put the key in double quotes at line"),
]


@pytest.mark.parametrize("content, named, fix", NOT_JSON, ids=["bom", "comment", "trailing-comma", "unquoted-key"])
def test_what_the_trainers_json_load_refuses_fails_check_hf_auto_naming_where_and_the_fix(run_cli, tmp_path, content,
                                                                                          named, fix):
    import re

    p = tmp_path / "ds_hf.json"
    p.write_bytes(content)
    with pytest.raises(ValueError):  # the premise: what the Trainer's loader does with this file
        with open(p, encoding="utf-8") as f:
            json.load(f)
    code, out, err = run_cli("check", p, "--hf-auto", "--no-accelerator", "--json")
    data = json.loads(out)
    (syntax,) = [f for f in data["findings"] if f["rule"] == "config-syntax-hjson"]
    assert code == 1 and data["errors"] == 1 and syntax["severity"] == "error", data
    assert re.search("^not JSON: " + named, syntax["message"]), syntax["message"]
    assert "json.load" in syntax["message"] and fix in syntax["fix"], syntax
    assert ("BOM" in syntax["message"]) == (content[:3] == b"\xef\xbb\xbf")  # a BOM is named as a BOM, and only then
    # without --hf-auto (deepspeed.initialize reads it with hjson): a warning naming the same thing
    code, out, err = run_cli("check", p, "--no-accelerator", "--json")
    (syntax,) = [f for f in json.loads(out)["findings"] if f["rule"] == "config-syntax-hjson"]
    assert syntax["severity"] == "warning" and re.search("^not JSON: " + named, syntax["message"])
    assert "Traceback" not in err


def test_a_bom_and_a_trailing_comma_are_both_named_and_a_bom_file_without_json_suffix_is_not_read_as_yaml(tmp_path):
    from shardkit.config.loading import read_config

    p = tmp_path / "ds_config"  # no .json: a BOM is not whitespace, so this once went to the YAML parser silently
    p.write_bytes(b"\xef\xbb\xbf{\n \"zero_optimization\": {\"stage\": 3},\n}")
    loaded = read_config(p)
    assert loaded.syntax == "hjson" and loaded.data == {"zero_optimization": {"stage": 3}}
    assert loaded.not_json == ("a UTF-8 byte order mark (BOM, bytes EF BB BF) at byte 0, then a trailing comma at "
                               "line 2, column 35")
    report = check_file(p, expect_hf_auto=True, environment=None, accelerator=False)
    (f,) = [f for f in report.errors if f.rule == "config-syntax-hjson"]
    assert f.fix.startswith("save the file as UTF-8 without a BOM") and "remove the comma at line 2, column 35" in f.fix

