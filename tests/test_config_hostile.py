"""Hostile and misleading config files: every refusal is one line and exit 1,
never a traceback, a hang or a memory blow-up; what parsers hide (duplicate keys, NaN, coerced
stages) becomes a finding. Commands that could hang or eat memory on a regression run in a
subprocess with a timeout and an address-space limit."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardkit.checks import check_config, check_file
from shardkit.config import loading
from shardkit.config.loading import MAX_NESTING, MAX_VALUES, read_config
from shardkit.core.errors import ConfigError

BILLION_LAUGHS = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (3 * 1024**3, 3 * 1024**3))


def shardkit_cli(*argv: object, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """`shardkit ARGV` in a child with 3 GB of address space and a timeout (a regression fails the
    test instead of taking the machine down)."""
    return subprocess.run(
        [sys.executable, "-m", "shardkit", *map(str, argv)],
        capture_output=True, text=True, timeout=timeout, preexec_fn=_limit_memory,
        env={**os.environ, "COLUMNS": "200"},
    )


def assert_one_line_refusal(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    err = proc.stderr.strip()
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-2000:], err[-2000:])
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


# --- devices, pipes, bytes read, YAML alias expansion ------------------------------------------


def test_billion_laughs_yaml_is_refused_at_once(tmp_path):
    p = tmp_path / "laughs.yaml"
    p.write_text(BILLION_LAUGHS)
    start = time.monotonic()
    proc = shardkit_cli("check", p)
    assert_one_line_refusal(proc, str(p), "aliases expand to more than", str(MAX_VALUES))
    assert time.monotonic() - start < 60


def test_billion_laughs_stops_launch_dry_run_too(tmp_path):
    # launch reads configs through the same loader (a device file hung `launch --dry-run` as well)
    p = tmp_path / "laughs.yaml"
    p.write_text(BILLION_LAUGHS)
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    proc = shardkit_cli("launch", "--dry-run", "--launcher", "torchrun", "--nproc_per_node", "2", script,
                        "--deepspeed_config", p)
    assert proc.returncode == 1 and "aliases expand to more than" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_yaml_alias_cycle_is_refused(tmp_path):
    p = tmp_path / "cycle.yaml"
    p.write_text("zero_optimization: &z\n  stage: 3\n  again: *z\n")
    with pytest.raises(ConfigError, match=r"cycle\.yaml: a YAML alias refers to a mapping or list that contains it"):
        read_config(p)


def test_small_aliases_are_still_fine(tmp_path):
    p = tmp_path / "ok.yaml"
    p.write_text("base: &b {device: cpu, pin_memory: false}\nzero_optimization:\n  stage: 3\n"
                 "  offload_param: *b\n  offload_optimizer: *b\ntrain_micro_batch_size_per_gpu: 1\n")
    assert read_config(p).data["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": False}


def test_dev_zero_is_refused_without_reading_it():
    proc = shardkit_cli("check", "/dev/zero", timeout=60)
    assert_one_line_refusal(proc, "/dev/zero: is a character device, not a regular file")


def test_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "cfg.json"
    os.mkfifo(fifo)
    proc = shardkit_cli("check", fifo, timeout=60)
    assert_one_line_refusal(proc, "is a FIFO (named pipe), not a regular file")


def test_bytes_actually_read_are_capped_not_st_size(monkeypatch):
    # /proc files are regular files whose st_size is 0 whatever they hold
    monkeypatch.setattr(loading, "MAX_CONFIG_BYTES", 64)
    assert os.stat("/proc/self/maps").st_size == 0
    with pytest.raises(ConfigError, match=r"^/proc/self/maps: more than 64 bytes is too large for a config file"):
        read_config("/proc/self/maps")


def test_large_yaml_is_refused_before_the_slow_parser(tmp_path):
    p = tmp_path / "big.yaml"
    p.write_text("k: [" + ", ".join(["1"] * (loading.MAX_YAML_BYTES // 2)) + "]\n")
    with pytest.raises(ConfigError, match=rf"more than {loading.MAX_YAML_BYTES} bytes of YAML"):
        read_config(p)


# --- nesting -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, text", [
    ("deep.json", '{"a":' * 100_000 + "1" + "}" * 100_000),
    ("deep_list.json", "[" * 100_000 + "]" * 100_000),
    ("deep.yaml", "a: " + "[" * 100_000 + "]" * 100_000),
    ("just_over.json", '{"a":' * (MAX_NESTING + 1) + "1" + "}" * (MAX_NESTING + 1)),
])
def test_deep_nesting_is_one_line_naming_file_and_limit(run_cli, tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    code, out, err = run_cli("check", p)
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"{p}: nested more than {MAX_NESTING} levels deep" in err


def test_nesting_at_the_limit_is_read(tmp_path):
    p = tmp_path / "ok.json"
    p.write_text('{"a":' * MAX_NESTING + "1" + "}" * MAX_NESTING)
    assert read_config(p).data["a"]


def test_deep_json_stops_launch_with_one_line(tmp_path):
    p = tmp_path / "deep.json"
    p.write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    proc = shardkit_cli("launch", "--dry-run", "--launcher", "torchrun", "--nproc_per_node", "2", script,
                        "--deepspeed_config", p)
    assert proc.returncode == 1 and f"nested more than {MAX_NESTING} levels deep" in proc.stderr
    assert "Traceback" not in proc.stderr and "RecursionError" not in proc.stderr


# --- what parsing hides -------------------------------------------------------------------------

ZERO3 = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


@pytest.mark.parametrize("stage, coerced, severity", [(True, 1, "error"), (False, 0, "error"), ("1", 1, "warning")])
def test_stage_that_deepspeed_coerces_is_judged_as_deepspeed_reads_it(tmp_path, stage, coerced, severity):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    # ground truth: DeepSpeed's pydantic model really reads these values as this stage
    assert int(DeepSpeedZeroConfig(stage=stage).stage) == coerced
    cfg = {**ZERO3, "zero_optimization": {"stage": stage, "offload_param": {"device": "cpu", "pin_memory": False}}}
    report = check_file(_write(tmp_path, cfg))
    rules = {f.rule: f for f in report.findings}
    assert rules["stage-type"].severity.value == severity and rules["stage-type"].value == stage
    assert f"coerces it to stage {coerced}" in rules["stage-type"].message
    # the offload is silently ignored at the coerced stage: the offload rule fires as for an int
    assert rules["offload-param-stage"].key == "zero_optimization.offload_param.device"
    assert f"at stage {coerced}" in rules["offload-param-stage"].message and not report.ok


def test_duplicate_keys_at_any_depth_json(run_cli, tmp_path):
    p = tmp_path / "dup.json"
    p.write_text('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "stage": 1,'
                 ' "offload_param": {"device": "cpu", "device": "none"}}, "x": [{"k": 1, "k": 2}]}')
    code, out, _ = run_cli("check", p, "--json")
    dups = {f["key"]: f for f in json.loads(out)["findings"] if f["rule"] == "duplicate-key"}
    assert code == 1 and set(dups) == {"zero_optimization.stage", "zero_optimization.offload_param.device", "x[0].k"}
    assert dups["zero_optimization.stage"]["value"] == 1 and "keeps only the last value (1)" in dups["zero_optimization.stage"]["message"]


def test_duplicate_keys_yaml_but_not_merge_keys(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("base: &b {stage: 2}\nzero_optimization:\n  <<: *b\n  stage: 3\n  stage: 1\n"
                 "train_micro_batch_size_per_gpu: 1\n")
    loaded = read_config(p)
    # an explicit key overriding a merged one is YAML's own rule, not a duplicate
    assert [(path, key) for path, key, _ in loaded.duplicate_keys] == [("zero_optimization.stage", "stage")]
    assert {f.key for f in check_file(p).findings if f.rule == "duplicate-key"} == {"zero_optimization.stage"}


@pytest.mark.parametrize("text, key", [
    ('"gradient_clipping": NaN', "gradient_clipping"),
    ('"gradient_clipping": Infinity', "gradient_clipping"),
    ('"optimizer": {"type": "AdamW", "params": {"lr": -Infinity}}', "optimizer.params.lr"),
    ('"optimizer": {"type": "AdamW", "params": {"lr": NaN}}', "optimizer.params.lr"),
])
def test_nan_and_infinity_are_errors(tmp_path, text, key):
    p = tmp_path / "nan.json"
    p.write_text('{"train_micro_batch_size_per_gpu": 1, ' + text + "}")
    (f,) = [f for f in check_file(p).findings if f.rule == "non-finite-number"]
    assert f.key == key and f.severity.value == "error" and "not valid JSON" in f.message


# --- Accelerate DEEPSPEED YAML ---------------------------------------------------------------------

ACCELERATE = "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_processes: 2\n"


def test_accelerate_deepspeed_nvme_without_path(tmp_path):
    p = tmp_path / "acc.yaml"
    p.write_text(ACCELERATE + "deepspeed_config:\n  zero_stage: 3\n  offload_param_device: nvme\n"
                 "  offload_optimizer_device: cpu\nmixed_precision: bf16\n")
    by_key = {f.key: f for f in check_file(p).errors}
    f = by_key["deepspeed_config.offload_param_nvme_path"]
    assert f.rule == "nvme-path" and "zero.Init fails" in f.message
    assert "in this YAML: deepspeed_config.offload_param_nvme_path" in f.fix


def test_accelerate_inline_settings_get_the_same_rules_as_deepspeed_json(tmp_path):
    p = tmp_path / "acc.yaml"
    p.write_text(ACCELERATE + "deepspeed_config:\n  zero_stage: 2\n  offload_param_device: cpu\n")
    json_twin = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    assert "offload-param-stage" in {f.rule for f in check_config(json_twin).errors}
    (f,) = [f for f in check_file(p).errors if f.rule == "offload-param-stage"]
    assert f.key == "deepspeed_config.offload_param_device"


def test_accelerate_missing_deepspeed_config_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = tmp_path / "acc.yaml"
    p.write_text(ACCELERATE + "deepspeed_config:\n  deepspeed_config_file: nope/ds.json\n")
    (f,) = check_file(p).errors
    assert f.key == "deepspeed_config.deepspeed_config_file" and f.value == "nope/ds.json"
    assert "does not exist" in f.message and f.rule == "accelerate-config-file-missing"


def test_accelerate_referenced_file_is_checked_like_deepspeed_json(tmp_path, monkeypatch):
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "ds.json").write_text(json.dumps(
        {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    ))
    p = folder / "acc.yaml"
    p.write_text(ACCELERATE + "deepspeed_config:\n  deepspeed_config_file: ds.json\n  zero_stage: 3\n")
    monkeypatch.chdir(tmp_path)  # not the YAML's folder: the ranks would not find ds.json from here
    report = check_file(p)
    rules = {f.rule: f for f in report.findings}
    assert rules["offload-param-stage"].key == "ds.json:zero_optimization.offload_param.device"
    assert "auto-value" not in rules  # Accelerate fills "auto" itself
    assert rules["accelerate-config-file-relative"].severity.value == "warning"
    assert "relative to the directory `accelerate launch` runs in" in rules["accelerate-config-file-relative"].message
    clash = rules["accelerate-config-file-clash"]
    assert clash.key == "deepspeed_config.zero_stage" and "raises ValueError" in clash.message


# --- config, check and preflight agree ------------------------------------------------------------


def test_config_pin_memory_follows_the_runs_accelerator(run_cli, tmp_path):
    out = tmp_path / "x.json"
    code, _, err = run_cli("config", "zero3", "--offload-optimizer", "cpu", "--offload-param", "cpu",
                           "--no-accelerator", "-o", out)
    z = json.loads(out.read_text())["zero_optimization"]
    assert code == 0 and z["offload_optimizer"]["pin_memory"] is False and z["offload_param"]["pin_memory"] is False
    assert f"passes `shardkit check {out} --no-accelerator`" in err and "pin_memory false because the run has no accelerator" in err
    assert run_cli("check", out, "--no-accelerator")[1].strip().endswith("no findings")
    run_cli("config", "zero3", "--offload-optimizer", "cpu", "--accelerator", "-o", out)
    assert json.loads(out.read_text())["zero_optimization"]["offload_optimizer"]["pin_memory"] is True


def test_config_then_preflight_static_has_no_pin_memory_warning(run_cli, tmp_path):
    # the issue: config wrote pin_memory true, check accepted it, preflight (no accelerator) warned
    out = tmp_path / "x.json"
    assert run_cli("config", "zero3", "--offload-optimizer", "cpu", "--offload-param", "cpu", "-o", out)[0] == 0
    code, stdout, _ = run_cli("preflight", out, "--nproc", "2", "--static")
    assert code == 0 and "pin_memory" not in stdout, stdout


def test_config_for_8_ranks_says_how_to_regenerate_for_2(run_cli, tmp_path):
    out = tmp_path / "ds.json"
    code, _, err = run_cli("config", "zero3", "--world-size", "8", "-o", out)
    assert code == 0 and "train_batch_size is fixed for 8 rank(s)" in err
    code, stdout, _ = run_cli("check", out, "--world-size", "2", "--json")
    (f,) = json.loads(stdout)["findings"]
    assert code == 1 and f["key"] == "train_batch_size" and "fixes the global batch for 8 rank(s)" in f["message"]
    assert "--world-size 2" in f["fix"] and "--grad-accum 4" in f["fix"]


def _write(tmp_path: Path, cfg: dict) -> Path:
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(cfg))
    return p


def test_accelerate_mixed_precision_fp16_gets_the_machines_cpu_fp16_row(tmp_path):
    from shardkit.platform.environment.accelerator import CudaProbe
    from shardkit.platform.environment.facts import probe_environment

    p = tmp_path / "acc.yaml"
    p.write_text(ACCELERATE + "deepspeed_config:\n  zero_stage: 3\nmixed_precision: fp16\n")
    no_fp16 = probe_environment({}, memlock_bytes=None, cuda=CudaProbe(build=None, available=None), cpu_fp16=False)
    (f,) = [f for f in check_file(p, accelerator=False, environment=no_fp16).errors if "cpu-fp16" in f.rule]
    assert f.key == "mixed_precision"  # named by the YAML key that turns fp16 on
    assert not [f for f in check_file(p, accelerator=True, environment=no_fp16).errors if "cpu-fp16" in f.rule]


@pytest.mark.parametrize("text", [
    '// written by hand\n{"train_batch_size": 8, "zero_optimization": {"stage": 3,},}',
    '{"train_batch_size": 8, /* ZeRO */ "zero_optimization": {stage: 3}}',
    '# a comment\n{"train_batch_size": 8, "zero_optimization": {"stage": 3}}',
])
def test_comments_and_trailing_commas_are_read_as_deepspeed_reads_them_with_a_warning(tmp_path, run_cli, text):
    """DeepSpeed loads its config file with hjson (runtime/config.py), so comments, trailing commas
    and unquoted keys are valid for it; transformers and accelerate read the same file with
    json.load. The check reads it as DeepSpeed does, checks it, and warns for the HF path."""
    import deepspeed.runtime.config as ds_config

    p = tmp_path / "ds.json"
    p.write_text(text)
    assert ds_config.hjson.loads(text)["zero_optimization"]["stage"] == 3  # DeepSpeed's own loader takes it
    code, out, err = run_cli("check", p, "--json")
    assert "Traceback" not in err
    findings = json.loads(out)["findings"]
    syntax = [f for f in findings if f["key"] == "<syntax>"]
    assert len(syntax) == 1 and syntax[0]["severity"] == "warning" and "json.load" in syntax[0]["message"], findings
    assert "json.load takes no comments, trailing commas or unquoted keys" in syntax[0]["fix"]
    assert re.search(r"not JSON: an? [a-z -]+ at line \d+, column \d+", syntax[0]["message"]), syntax[0]
