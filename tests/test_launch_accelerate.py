"""`shardkit launch --launcher accelerate`: accelerate's arguments split from the script's, the
Accelerate config the run will read (--config_file, the default location, command-line overrides)
checked before anything starts, and real `accelerate launch` runs on 2 CPU ranks with the automatic
preflight on every rank.

Accelerate's FSDP is not run for real here: accelerate 1.15 turns FSDP on only for GPU-like device
types (AcceleratorState: MULTI_GPU/NPU/XPU/...; CPU ranks are MULTI_CPU), so on CPU ranks the FSDP
YAML is checked, not trained.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from shardkit.autopreflight import ENV_ENABLE, EXIT_CODE, site_dir
from shardkit.core.errors import ConfigError, UsageError
from shardkit.run.accelerate_config import default_config_file, effective_config
from shardkit.run.launcher import build_launch, check_launch_config, launcher_command
from tests.test_launch import GOOD_AND_BAD, _run

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def zero3_json(tmp_path_factory) -> Path:
    """A DeepSpeed ZeRO-3 config for 2 ranks, written by `shardkit config zero3` (the command users run)."""
    from shardkit.cli import main

    out = tmp_path_factory.mktemp("ds") / "ds_zero3.json"
    assert main(["config", "zero3", "--world-size", "2", "-o", str(out)]) == 0
    return out


def _yaml(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def _deepspeed_yaml(folder: Path, ds_json: Path | str, extra: str = "", section_extra: str = "") -> Path:
    return _yaml(
        folder / "acc.yaml",
        f"""
        compute_environment: LOCAL_MACHINE
        distributed_type: DEEPSPEED
        deepspeed_config:
          deepspeed_config_file: {ds_json}
          zero3_init_flag: false
        {section_extra}
        num_machines: 1
        num_processes: 2
        machine_rank: 0
        main_process_port: 0
        {extra}
        """,
    )


@pytest.fixture
def no_default_config(tmp_path, monkeypatch):
    """An empty HF_HOME: accelerate's default config location holds nothing."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # the ranks have no accelerator, on any machine
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ---------------------------------------------------------------- the plan (no processes)


def test_default_config_location_is_accelerates_own():
    from accelerate.commands.config import config_args

    # accelerate computed it at import from this process's environment
    assert str(default_config_file(os.environ)) == config_args.default_yaml_config_file
    assert default_config_file({"HF_HOME": "/h"}) == Path("/h/accelerate/default_config.yaml")
    assert default_config_file({"XDG_CACHE_HOME": "/c"}) == Path("/c/huggingface/accelerate/default_config.yaml")
    assert default_config_file({"HF_HOME": "/h", "XDG_CACHE_HOME": "/c"}) == Path("/h/accelerate/default_config.yaml")


def test_accelerate_arguments_are_split_from_the_scripts_and_passed_untouched(tmp_path, no_default_config, zero3_json):
    cfg = _deepspeed_yaml(tmp_path, zero3_json)
    args = ["--config_file", str(cfg), "--num-processes=4", "--main_process_port", "0", "train.py",
            "--config_file", "app.yaml", "--num_processes", "9", "a b"]
    plan = build_launch(args, "accelerate", environ=dict(os.environ))
    assert plan.argv == [*launcher_command("accelerate"), *args]
    assert plan.argv[1] == "launch" or plan.argv[1:3] == ["-m", "accelerate.commands.launch"]
    assert plan.script == "train.py" and plan.script_args == ["--config_file", "app.yaml", "--num_processes", "9", "a b"]
    assert plan.config_path == str(cfg)
    # the command line's --num-processes wins over the YAML's 2 (the script's own flag counts for nothing)
    assert plan.world_size == 4
    assert plan.env[ENV_ENABLE] == "1" and plan.env["PYTHONPATH"].split(os.pathsep)[0] == str(site_dir())


def test_the_default_location_is_read_unless_cpu(tmp_path, no_default_config):
    default = default_config_file(os.environ)
    default.parent.mkdir(parents=True)
    _yaml(default, """
        compute_environment: LOCAL_MACHINE
        distributed_type: MULTI_GPU
        num_processes: 3
        """)
    plan = build_launch(["train.py"], "accelerate")
    assert plan.config_path == str(default) and plan.world_size == 3
    # accelerate: `args.config_file is not None or os.path.isfile(default_config_file) and not args.cpu`
    assert build_launch(["--cpu", "train.py"], "accelerate").config_path is None
    # no file there: accelerate's built-in defaults, nothing to read
    default.unlink()
    assert build_launch(["train.py"], "accelerate").config_path is None


def test_command_line_overrides_land_where_accelerate_puts_them():
    file_cfg = {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 2}, "num_processes": 8}
    cfg = effective_config(file_cfg, {"zero_stage": 3, "offload_optimizer_device": "cpu", "num_processes": 2})
    assert cfg["deepspeed_config"] == {"zero_stage": 3, "offload_optimizer_device": "cpu"} and cfg["num_processes"] == 2
    assert file_cfg["deepspeed_config"] == {"zero_stage": 2}  # the file's data is left alone
    # a paradigm flag replaces the file's distributed_type; FSDP options arrive as strings
    cfg = effective_config(file_cfg, {"use_fsdp": True, "fsdp_version": "2", "fsdp_offload_params": "true"})
    assert cfg["distributed_type"] == "FSDP" and cfg["fsdp_config"] == {"fsdp_version": 2, "fsdp_offload_params": True}
    # with a DeepSpeed config file, --zero_stage only fills the file's "auto" entries: not a YAML clash
    with_file = {"distributed_type": "DEEPSPEED", "deepspeed_config": {"deepspeed_config_file": "ds.json"}}
    assert effective_config(with_file, {"zero_stage": 3})["deepspeed_config"] == {"deepspeed_config_file": "ds.json"}
    # string-typed flags become what the YAML would hold; a section that is not a mapping is left for the checks
    assert effective_config({}, {"use_deepspeed": True, "zero3_init_flag": "true"})["deepspeed_config"] == {"zero3_init_flag": True}
    assert effective_config({"deepspeed_config": "oops"}, {"zero_stage": 3})["deepspeed_config"] == "oops"


def test_usage_errors_name_the_problem(no_default_config):
    with pytest.raises(UsageError, match=r"^accelerate launch arguments --num_processes 2: no training script; expected "
                                         r"`shardkit launch --launcher accelerate \[accelerate args\] train.py"):
        build_launch(["--num_processes", "2"], "accelerate")
    with pytest.raises(UsageError, match=r"takes one of --cpu, --multi_gpu, --tpu, --use_deepspeed, --use_fsdp at a "
                                         r"time, got --use_deepspeed and --use_fsdp"):
        build_launch(["--use_deepspeed", "--use_fsdp", "train.py"], "accelerate")


def test_a_double_dash_separator_is_not_taken_for_an_accelerate_option(no_default_config):
    # argparse drops a `--` before or after the script from what it hands over: slicing by the
    # count of script arguments took the script itself (or the `--`) for one of accelerate's options
    from shardkit.run.accelerate_config import parse_accelerate_args

    for args, script_args in (
        (["--num_processes", "2", "train.py", "--", "--lr", "1"], ["--lr", "1"]),
        (["--num_processes", "2", "--", "train.py", "--lr", "1"], ["--lr", "1"]),
        (["--num_processes", "2", "train.py", "train.py"], ["train.py"]),
    ):
        run = parse_accelerate_args(args, os.environ)
        assert (run.accelerate_args, run.script, run.script_args) == (["--num_processes", "2"], "train.py", script_args), args


def test_accelerates_parser_is_built_once_per_launch(no_default_config, zero3_json, monkeypatch):
    import accelerate.commands.launch as acc_launch

    built: list[int] = []
    original = acc_launch.launch_command_parser

    def counting(*a, **kw):
        built.append(1)
        return original(*a, **kw)

    monkeypatch.setattr(acc_launch, "launch_command_parser", counting)
    cfg = _deepspeed_yaml(no_default_config, zero3_json)
    plan = build_launch(["--config_file", str(cfg), "--zero_stage", "3", "train.py"], "accelerate")
    check_launch_config(plan)
    assert len(built) == 1
    assert plan.notes == []  # the plan's notes are settled when it is built, not by the check


def test_a_trainer_scripts_own_deepspeed_json_is_checked_too(run_cli, no_default_config):
    # the usual HF recipe: `accelerate launch train.py --deepspeed ds.json`: the Trainer hands that
    # file to deepspeed.initialize whatever the YAML says; its "auto" values are the Trainer's to fill
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
          "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    (no_default_config / "ds_hf.json").write_text(json.dumps(ds))
    script, marker = _marker_script(no_default_config)
    args = ["--num_processes", "2", str(script), "--deepspeed", "ds_hf.json"]
    plan = build_launch(args, "accelerate")
    assert plan.script_config_path == "ds_hf.json"
    report = check_launch_config(plan)
    assert [(f.key, f.rule) for f in report.errors] == [("ds_hf.json:zero_optimization.offload_param.device", "offload-param-stage")]
    assert not [f for f in report.findings if f.rule == "auto-value"]
    (note,) = [n for n in plan.notes if '"auto" accepted' in n]
    assert "train_micro_batch_size_per_gpu" in note and "`--deepspeed PATH` is the HF Trainer's flag" in note
    assert "not a Trainer and passes this file to deepspeed.initialize must fill them itself" in note
    code, out, err = run_cli("launch", "--dry-run", "--launcher", "accelerate", *args)
    assert code == 1 and "offload_param" in out and "would run" not in err and not marker.exists()
    # the same file named by the YAML too: checked once, under the YAML's rules
    cfg = _deepspeed_yaml(no_default_config, "ds_hf.json")
    both = check_launch_config(build_launch(["--config_file", str(cfg), str(script), "--deepspeed", "ds_hf.json"], "accelerate"))
    assert [f.key for f in both.errors].count("ds_hf.json:zero_optimization.offload_param.device") == 1


def test_the_yaml_keys_accelerate_refuses_beside_a_deepspeed_file_are_accelerates_own_list(no_default_config):
    # DeepSpeedPlugin._deepspeed_config_checks keeps the list in a local variable (not importable):
    # pin shardkit's copy (checks/accelerate_deepspeed.TO_DEEPSPEED + mixed_precision) to the
    # installed accelerate's source, so an accelerate release that changes it fails here
    import ast
    import inspect

    from accelerate.utils.dataclasses import DeepSpeedPlugin

    from shardkit.checks.accelerate_deepspeed import TO_DEEPSPEED

    tree = ast.parse(textwrap.dedent(inspect.getsource(DeepSpeedPlugin._deepspeed_config_checks)))
    names = next(n for n in ast.walk(tree) if isinstance(n, ast.List) and n.elts and isinstance(n.elts[0], ast.Constant))
    refused = {str(e.value).replace("ACCELERATE_", "").replace("DEEPSPEED_", "").lower() for e in names.elts}
    assert refused == set(TO_DEEPSPEED) | {"mixed_precision"}
    # and the launch names every one of them found in the YAML
    (no_default_config / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}))
    cfg = no_default_config / "acc.yaml"
    cfg.write_text("distributed_type: DEEPSPEED\nnum_processes: 2\nmixed_precision: bf16\ndeepspeed_config:\n"
                   "  deepspeed_config_file: ds.json\n" + "".join(f"  {k}: 1\n" for k in sorted(TO_DEEPSPEED)))
    clash = [f for f in check_launch_config(build_launch(["--config_file", str(cfg), "train.py"], "accelerate")).errors
             if f.rule == "accelerate-config-file-clash"]
    named = " ".join(f.message + f.key for f in clash)
    assert all(k in named for k in [*TO_DEEPSPEED, "mixed_precision"]), named


def test_an_unusable_config_file_is_one_clear_error(no_default_config):
    with pytest.raises(ConfigError, match=r"^the Accelerate config \(--config_file\) cannot be used: nope.yaml: no such file"):
        build_launch(["--config_file", "nope.yaml", "train.py"], "accelerate")
    (no_default_config / "folder.yaml").mkdir()
    with pytest.raises(ConfigError, match=r"folder.yaml: is a directory, not a config file"):
        build_launch(["--config_file", "folder.yaml", "train.py"], "accelerate")


# ---------------------------------------------------------------- refused before anything starts


def _marker_script(folder: Path) -> tuple[Path, Path]:
    marker = folder / "started"
    script = folder / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    return script, marker


@pytest.mark.parametrize(
    "extra, section_extra, key, words",
    [
        # misspelled inside deepspeed_config: accelerate sets an attribute nothing reads (no offload at all)
        ("", "  offload_optimizer_devic: cpu", "deepspeed_config.offload_optimizer_devic",
         "did you mean 'offload_optimizer_device'?"),
        # misspelled at the top: accelerate refuses the file itself
        ("num_procesess: 2", "", "num_procesess", "did you mean 'num_processes'?"),
        # accelerate refuses mixed_precision next to deepspeed_config_file on every rank
        ("mixed_precision: bf16", "", "mixed_precision", "set bf16/fp16 in the DeepSpeed JSON"),
    ],
)
def test_a_bad_accelerate_yaml_stops_the_launch_naming_the_key(run_cli, no_default_config, extra, section_extra, key, words):
    cfg = _deepspeed_yaml(no_default_config, "ds.json", extra=extra, section_extra=section_extra)
    (no_default_config / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}))
    script, marker = _marker_script(no_default_config)
    (err,) = check_launch_config(build_launch(["--config_file", str(cfg), str(script)], "accelerate")).errors
    assert err.key == key and words in err.fix + err.message
    # through the CLI (no --dry-run): the table, one line, exit 1, and the script never ran
    code, out, err_text = run_cli("launch", "--launcher", "accelerate", "--config_file", cfg, script)
    assert code == 1 and key.rpartition(".")[2][:12] in out
    assert f"not started: 1 error(s) in {cfg}" in err_text and "starting" not in err_text
    assert not marker.exists()


def test_check_of_the_yaml_names_mixed_precision_beside_a_deepspeed_file_and_the_jsons_own(run_cli, no_default_config):
    """`shardkit check acc.yaml` (not only launch): mixed_precision beside deepspeed_config_file is refused
    by accelerate on every rank, and when the JSON enables another precision the message says so."""
    (no_default_config / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": False},
                                                           "fp16": {"enabled": True}, "zero_optimization": {"stage": 3}}))
    cfg = _deepspeed_yaml(no_default_config, "ds.json", extra="mixed_precision: bf16")
    from shardkit.checks import check_file

    errors = {f.key: f for f in check_file(cfg).errors}
    f = errors["mixed_precision"]
    assert f.value == "bf16" and "the DeepSpeed JSON sets fp16, which disagrees with mixed_precision: bf16" in f.message
    assert "remove mixed_precision from the YAML" in f.fix
    code, out, _ = run_cli("check", cfg)
    assert code == 1 and "mixed_precision" in out
    # without it in the YAML, nothing to say about precision
    clean = _deepspeed_yaml(no_default_config, "ds.json")
    assert "mixed_precision" not in {f.key for f in check_file(clean).findings}


def test_launch_names_the_precision_clash_once_and_not_for_a_command_line_override(no_default_config):
    (no_default_config / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}))
    cfg = _deepspeed_yaml(no_default_config, "ds.json", extra="mixed_precision: bf16")
    script, _ = _marker_script(no_default_config)
    found = check_launch_config(build_launch(["--config_file", str(cfg), str(script)], "accelerate")).findings
    assert [f.key for f in found].count("mixed_precision") == 1
    # --mixed_precision on the command line: accelerate does not count it as a field from the YAML
    found = check_launch_config(build_launch(["--config_file", str(cfg), "--mixed_precision", "bf16", str(script)],
                                             "accelerate")).findings
    assert "mixed_precision" not in [f.key for f in found if f.severity.value == "error"]


def test_files_accelerate_itself_writes_or_still_reads_have_no_unknown_keys(no_default_config, zero3_json):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.config.default import write_basic_config

    write_basic_config(mixed_precision="no", save_location=str(no_default_config / "basic.yaml"))
    full = ClusterConfig(
        compute_environment="LOCAL_MACHINE", distributed_type="DEEPSPEED", mixed_precision=None, use_cpu=False, debug=False,
        num_processes=2, deepspeed_config={"deepspeed_config_file": str(zero3_json), "zero3_init_flag": False},
    )
    full.to_yaml_file(str(no_default_config / "full.yaml"))
    # the old top-level fp16 key: ClusterConfig.process_config converts it before refusing unknown keys
    legacy = _yaml(no_default_config / "legacy.yaml", """
        compute_environment: LOCAL_MACHINE
        distributed_type: MULTI_GPU
        fp16: false
        num_processes: 2
        """)
    for name in ("basic.yaml", "full.yaml", legacy.name):
        report = check_launch_config(build_launch(["--config_file", name, "train.py"], "accelerate"))
        assert not [f for f in report.findings if f.rule == "accelerate-unknown-key"], (name, report.findings)
        assert report.ok, (name, report.errors)


def test_the_deepspeed_json_the_yaml_names_is_checked_with_the_deepspeed_rules(run_cli, no_default_config):
    # offload_param at stage 2: DeepSpeed ignores it silently (the offload the user asked for never happens)
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    (no_default_config / "ds.json").write_text(json.dumps(ds))
    cfg = _deepspeed_yaml(no_default_config, "ds.json")
    script, marker = _marker_script(no_default_config)
    report = check_launch_config(build_launch(["--config_file", str(cfg), str(script)], "accelerate"))
    assert [(f.key, f.rule) for f in report.errors] == [("ds.json:zero_optimization.offload_param.device", "offload-param-stage")]
    assert "stage 3" in report.errors[0].message
    code, out, err = run_cli("launch", "--launcher", "accelerate", "--config_file", cfg, script)
    assert code == 1 and f"not started: 1 error(s) in {cfg}" in err and not marker.exists()


def test_a_command_line_override_is_checked_too(run_cli, no_default_config):
    cfg = _yaml(no_default_config / "inline.yaml", """
        compute_environment: LOCAL_MACHINE
        distributed_type: DEEPSPEED
        deepspeed_config:
          zero_stage: 2
        num_processes: 2
        """)
    script, marker = _marker_script(no_default_config)
    code, out, err = run_cli("launch", "--dry-run", "--launcher", "accelerate", "--config_file", cfg, script)
    assert code == 0 and "would run" in err
    # the same YAML, with param offload asked for on the command line: stage 2 ignores it
    code, out, err = run_cli("launch", "--dry-run", "--launcher", "accelerate", "--config_file", cfg,
                             "--offload_param_device", "cpu", script)
    assert code == 1 and "would run" not in err
    plan = build_launch(["--config_file", str(cfg), "--offload_param_device", "cpu", str(script)], "accelerate")
    assert "deepspeed_config.offload_param_device" in [f.key for f in check_launch_config(plan).errors]


def test_without_a_config_file_the_command_line_settings_are_checked(run_cli, no_default_config):
    script, marker = _marker_script(no_default_config)
    code, out, err = run_cli("launch", "--dry-run", "--launcher", "accelerate", "--use_deepspeed", "--zero_stage", "2",
                             "--offload_param_device", "cpu", "--num_processes", "2", script)
    assert code == 1 and "not started: 1 error(s) in accelerate's command-line settings (no config file)" in err
    code, out, err = run_cli("launch", "--dry-run", "--launcher", "accelerate", "--use_deepspeed", "--zero_stage", "3",
                             "--num_processes", "2", script)
    assert code == 0 and "accelerate's command-line settings (no config file) checked; " in err and "would run" in err
    # nothing at all: accelerate's defaults (one process, no engine settings), said before the launch
    code, out, err = run_cli("launch", "--dry-run", "--launcher", "accelerate", script)
    assert code == 0 and "distributed_type NO: no DeepSpeed or FSDP settings to check in the Accelerate config" in err
    assert not marker.exists()


def test_accelerate_fsdp2_settings_are_checked_with_the_fsdp_rules(no_default_config):
    from shardkit.cli import main
    from shardkit.platform.environment.accelerator import CudaProbe
    from shardkit.platform.environment.facts import probe_environment

    assert main(["config", "fsdp", "--format", "accelerate", "--world-size", "2", "--no-accelerator", "-o", "fsdp.yaml"]) == 0
    no_gpu = probe_environment({}, memlock_bytes=None, cuda=CudaProbe(build=None, available=None), cpu_fp16=False)
    gpu = probe_environment({}, memlock_bytes=None, cuda=CudaProbe(build="12.8", available=True, device_count=2), cpu_fp16=False)
    (no_default_config / "train.py").write_text("")
    plan = build_launch(["--config_file", "fsdp.yaml", "train.py"], "accelerate")
    assert plan.world_size == 2 and check_launch_config(plan, facts=no_gpu).ok
    # CPU offload: Accelerate's FSDP2 offload is CPUOffloadPolicy() with pinned memory, which needs an accelerator
    offload = build_launch(["--config_file", "fsdp.yaml", "--fsdp_offload_params", "true", "train.py"], "accelerate")
    (err,) = check_launch_config(offload, facts=no_gpu).errors
    assert err.key == "fsdp_config.fsdp_offload_params" and err.rule == "fsdp-pin-no-accelerator"
    assert "CPUOffloadPolicy() with pin_memory=True" in err.message and "pin_memory=False" in err.fix
    assert check_launch_config(offload, facts=gpu).ok
    # an FSDP1 option in an FSDP2 config, and a misspelled FSDP key: refused, named
    text = Path("fsdp.yaml").read_text().replace("fsdp_config:\n", "fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n"
                                                  "  fsdp_ofload_params: true\n")
    Path("fsdp.yaml").write_text(text)
    errors = {f.key: f for f in check_launch_config(build_launch(["--config_file", "fsdp.yaml", "train.py"], "accelerate"),
                                                   facts=no_gpu).errors}
    assert errors["fsdp_config.fsdp_sharding_strategy"].rule == "fsdp1-option"
    assert "did you mean 'fsdp_offload_params'?" in errors["fsdp_config.fsdp_ofload_params"].fix


def test_dry_run_prints_the_accelerate_command_and_starts_nothing(run_cli, no_default_config, zero3_json):
    cfg = _deepspeed_yaml(no_default_config, zero3_json)
    script, marker = _marker_script(no_default_config)
    code, out, err = run_cli("launch", "--dry-run", "--launcher", "accelerate", "--config_file", cfg, script, "--steps", "2")
    assert code == 0, out + err
    assert f"shardkit launch: {cfg} checked; placement preflight requested on every rank; would run: " in err
    assert err.rstrip().endswith(f"launch --config_file {cfg} {script} --steps 2")
    assert not marker.exists()
    # a script that does not exist: one line, nothing started
    code, out, err = run_cli("launch", "--dry-run", "--launcher", "accelerate", "--config_file", cfg, "nope.py")
    assert code == 1 and "not started: training script nope.py does not exist" in err and "would run" not in err


def test_the_import_watcher_survives_a_find_spec_probe(tmp_path, monkeypatch):
    """accelerate and transformers probe `importlib.util.find_spec("deepspeed")` before importing
    it; the watcher that wraps deepspeed.initialize must still fire on the real import."""
    import importlib.util

    from shardkit.autopreflight.hooks import _AfterImport

    (tmp_path / "sk_probe_target.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[str] = []
    watcher = _AfterImport({"sk_probe_target": lambda module: seen.append(module.__name__)})
    monkeypatch.setattr(sys, "meta_path", [watcher, *sys.meta_path])
    assert importlib.util.find_spec("sk_probe_target") is not None and seen == []
    import sk_probe_target  # noqa: F401

    assert seen == ["sk_probe_target"]
    sys.modules.pop("sk_probe_target", None)


# ---------------------------------------------------------------- real accelerate launch runs

ACCELERATE_SCRIPT = textwrap.dedent(
    """
    import torch, torch.nn as nn
    from accelerate import Accelerator
    from accelerate.utils import DummyOptim, InitProcessGroupKwargs

    # On a machine without a GPU accelerate leaves its own backend unset under DeepSpeed and every
    # rank believes it is process 0 of 1; naming gloo gives it the real world size.
    acc = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = DummyOptim(model.parameters())  # the optimizer is the DeepSpeed JSON's
    model, optimizer = acc.prepare(model, optimizer)
    for step in range(2):
        x = torch.randn(1, 16, device=acc.device, dtype=torch.bfloat16)
        loss = model(x).float().square().mean()
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    print(f"rank {acc.process_index} of {acc.num_processes} trained ({acc.distributed_type})", flush=True)
    acc.wait_for_everyone()
    acc.end_training()
    # torch 2.13 CPU can abort a finished rank at interpreter finalization ("terminate called
    # without an active exception", docs/slurm.md): leave once everything is flushed
    import os, sys
    sys.stdout.flush()
    os._exit(0)
    """
)


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory, zero3_json):
    """One real `shardkit launch --launcher accelerate` of a ZeRO-3 Accelerate script on 2 CPU ranks."""
    folder = tmp_path_factory.mktemp("acc_zero3")
    cfg = _deepspeed_yaml(folder, zero3_json)
    script = folder / "train_acc.py"
    script.write_text(ACCELERATE_SCRIPT)
    return _run([sys.executable, "-m", "shardkit", "launch", "--launcher", "accelerate", "--config_file", str(cfg), str(script)],
                timeout=300)


@pytest.mark.slow
def test_accelerate_zero3_on_two_cpu_ranks_runs_the_preflight_on_every_rank(zero3_run):
    out = zero3_run.stdout
    assert zero3_run.returncode == 0, out[-4000:]
    assert "acc.yaml checked; placement preflight requested on every rank; starting: " in out
    # the preflight gathered both ranks' records, through the engine Accelerate built
    assert "placement preflight passed on 2 rank(s)" in out and "(DeepSpeed engine)" in out
    assert "rank 0 of 2 trained (DistributedType.DEEPSPEED)" in out and "rank 1 of 2 trained" in out


@pytest.mark.slow
def test_accelerate_launch_stops_every_rank_when_a_module_was_replaced(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(GOOD_AND_BAD)
    # plain torch ranks under accelerate's multi-process launcher (torch's elastic agent)
    r = _run([sys.executable, "-m", "shardkit", "launch", "--launcher", "accelerate", "--multi_gpu", "--num_processes", "2",
              "--main_process_port", "0", str(script), "--replace-head"])
    assert r.returncode == EXIT_CODE, r.stdout[-4000:]
    assert r.stdout.rstrip().splitlines()[-1].startswith(
        "shardkit launch: placement preflight failed on rank(s) [0, 1] of 2 before the first optimizer step: "
    )
    assert "out_head.weight" in r.stdout and "trained" not in r.stdout
