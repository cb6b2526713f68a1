"""`shardkit launch`: argv building (no spawning), config checks that stop a launch, and real local
runs under torchrun / the deepspeed launcher with the automatic placement preflight."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardkit.autopreflight import ENV_CONFIG, ENV_ENABLE, EXIT_CODE, site_dir
from shardkit.core.errors import UsageError
from shardkit.run.launcher import build_launch, find_config, infer_world_size, launcher_command, split_script

REPO = Path(__file__).resolve().parents[1]
PRESET = str(REPO / "ds_configs" / "zero3.json")


# ---------------------------------------------------------------- argv building (no processes)


def test_argv_is_the_real_launcher_then_every_argument_untouched():
    args = ["--nproc_per_node", "2", "--standalone", "train.py", "--deepspeed_config", PRESET, "--lr=3e-4", "a b"]
    plan = build_launch(args, "torchrun", environ={})
    assert plan.argv == [*launcher_command("torchrun"), *args]
    assert plan.argv[0].endswith("torchrun") or plan.argv[1:3] == ["-m", "torch.distributed.run"]
    assert plan.script == "train.py" and plan.script_args == ["--deepspeed_config", PRESET, "--lr=3e-4", "a b"]
    assert plan.config_path == PRESET and plan.world_size == 2


def test_deepspeed_launcher_argv_and_world_size():
    plan = build_launch(["--num_gpus=4", "--num_nodes", "2", "train.py", "--deepspeed", "--deepspeed_config=ds.json"], "deepspeed", environ={})
    assert plan.argv[len(launcher_command("deepspeed")):] == ["--num_gpus=4", "--num_nodes", "2", "train.py", "--deepspeed", "--deepspeed_config=ds.json"]
    assert plan.config_path == "ds.json" and plan.world_size == 8


@pytest.mark.parametrize(
    "script_args, expected",
    [
        (["--deepspeed_config", "ds.json"], "ds.json"),
        (["--deepspeed_config=ds.json"], "ds.json"),
        (["--deepspeed", "cfg/ds.yaml"], "cfg/ds.yaml"),  # HF Trainer: --deepspeed PATH
        (["--deepspeed", "--deepspeed_config", "ds.json"], "ds.json"),  # DeepSpeed's flag + path
        (["--config=run.json"], "run.json"),
        (["--deepspeed"], None),
        (["--deepspeed_config", "ds"], "ds"),  # always a path: checked (and refused) even without a suffix
        (["--deepspeed", "not-a-path"], None),  # DeepSpeed's flag followed by a script argument
        (["--lr", "1e-4"], None),
    ],
)
def test_config_is_found_in_every_spelling(script_args, expected):
    assert find_config(script_args) == expected


@pytest.mark.parametrize("script_args, seen", [
    (["--deepspeed_config"], "with no value"),
    (["--deepspeed_config", "--lr", "1e-4"], "followed by '--lr'"),
    (["--deepspeed-config="], "with no value"),
    (["--deepspeed", "--deepspeed_config"], "with no value"),
])
def test_a_path_only_config_flag_without_its_path_is_a_usage_error_naming_it(script_args, seen):
    flag = script_args[-1].rstrip("=") if len(script_args) != 3 else "--deepspeed_config"
    with pytest.raises(UsageError, match=rf"^{flag} {seen}: it takes the config's path, so the config would go unchecked; "
                                         rf"pass `{flag} ds_config.json`"):
        find_config(script_args)


def test_launch_with_a_bare_deepspeed_config_flag_starts_nothing(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    code, out, err = run_cli("launch", "--dry-run", "train.py", "--deepspeed_config")
    assert code != 0 and "--deepspeed_config with no value" in err
    assert "no config named" not in err and "would run" not in err


def _fp16_config(tmp_path: Path) -> Path:
    cfg = tmp_path / "fp16.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True},
                               "zero_optimization": {"stage": 3}}))
    return cfg


def test_fp16_on_a_machine_without_a_gpu_stops_the_launch(tmp_path):
    from shardkit.platform.environment.accelerator import CudaProbe
    from shardkit.platform.environment.facts import probe_environment
    from shardkit.run.launcher import check_launch_config

    cfg = _fp16_config(tmp_path)
    plan = build_launch(["train.py", "--deepspeed_config", str(cfg)], "deepspeed", environ={})
    no_gpu = probe_environment({}, memlock_bytes=None, cuda=CudaProbe(build=None, available=None), cpu_fp16=False)
    report = check_launch_config(plan, facts=no_gpu)
    (err,) = [f for f in report.errors if f.key == "fp16.enabled"]
    assert "fp16 on a CPU run (the run has no accelerator)" in err.message and err.fix
    # the ranks would get a GPU here: the same config launches
    gpu = probe_environment({}, memlock_bytes=None, cuda=CudaProbe(build="12.8", available=True, device_count=1), cpu_fp16=False)
    assert not [f for f in check_launch_config(plan, facts=gpu).findings if f.key == "fp16.enabled"]
    # DS_ACCELERATOR=cpu in the ranks' environment forces DeepSpeed's CPU accelerator even with a GPU
    forced = probe_environment({"DS_ACCELERATOR": "cpu"}, memlock_bytes=None,
                               cuda=CudaProbe(build="12.8", available=True, device_count=1), cpu_fp16=False)
    assert [f for f in check_launch_config(plan, facts=forced).errors if f.key == "fp16.enabled"]


def test_launch_dry_run_of_fp16_on_this_cpu_only_machine_exits_1(run_cli, tmp_path, monkeypatch):
    from shardkit.platform.environment.accelerator import probe_cpu_fp16

    if probe_cpu_fp16():
        pytest.skip("this CPU runs fp16 (oneDNN AVX512-FP16/AMX-FP16): DeepSpeed accepts it")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    cfg = _fp16_config(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("")
    code, out, err = run_cli("launch", "--dry-run", script, "--deepspeed_config", cfg)
    assert code == 1 and "fp16.enabled" in out and f"not started: 1 error(s) in {cfg}" in err
    assert "would run" not in err


def test_module_form_and_missing_script():
    launcher_args, script, rest = split_script(["--nproc_per_node", "2", "-m", "pkg.train", "--config", "c.json"])
    assert launcher_args == ["--nproc_per_node", "2", "-m", "pkg.train"] and script == "pkg.train" and rest == ["--config", "c.json"]
    with pytest.raises(UsageError, match=r"no training script in --nproc_per_node 2"):
        split_script(["--nproc_per_node", "2"])


def test_world_size_from_elastic_nnodes_and_unknown():
    assert infer_world_size("torchrun", ["--nnodes=2:4", "--nproc-per-node=8"]) == 16
    assert infer_world_size("torchrun", ["--standalone"]) is None


def test_preflight_environment_and_no_preflight():
    plan = build_launch(["train.py", "--deepspeed_config", PRESET], "deepspeed", environ={"PYTHONPATH": "/x"})
    assert plan.env["PYTHONPATH"].split(os.pathsep) == [str(site_dir()), "/x"]
    assert plan.env[ENV_ENABLE] == "1" and plan.env[ENV_CONFIG] == PRESET
    assert (site_dir() / "sitecustomize.py").is_file()
    off = build_launch(["train.py"], "deepspeed", preflight=False, environ={"PYTHONPATH": "/x"})
    assert off.env == {"PYTHONPATH": "/x"}


def test_own_options_first_then_pass_through(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    code, out, err = run_cli("launch", "--launcher", "torchrun", "--no-preflight", "--dry-run", "--nproc_per_node", "2", "t.py", "--dry-run")
    assert code == 0
    assert "no preflight" in err and err.rstrip().endswith("--nproc_per_node 2 t.py --dry-run")
    # a dry run starts nothing and says so
    assert "would run: " in err and "starting" not in err


def test_a_script_that_does_not_exist_is_refused_before_anything_starts(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for dry in (["--dry-run"], []):
        code, out, err = run_cli("launch", *dry, "--launcher", "torchrun", "--nproc_per_node", "1", "nope.py")
        assert code == 1
        assert f"not started: training script nope.py does not exist (looked for {tmp_path / 'nope.py'})" in err
        assert "starting" not in err and "would run" not in err
    (tmp_path / "folder.py").mkdir()
    code, out, err = run_cli("launch", "--dry-run", "folder.py")
    assert code == 1 and "training script folder.py is not a file" in err


@pytest.mark.parametrize("spelling", [["--deepspeed_config", "{dir}"], ["--deepspeed_config={dir}"], ["--deepspeed", "{dir}"]])
def test_a_config_flag_naming_a_directory_is_an_error_naming_it(run_cli, tmp_path, monkeypatch, spelling):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    (tmp_path / "cfgdir").mkdir()
    code, out, err = run_cli("launch", "--dry-run", "train.py", *[a.format(dir=tmp_path / "cfgdir") for a in spelling])
    assert code == 1
    assert f"{tmp_path / 'cfgdir'}: is a directory, not a config file" in err
    assert "no config named" not in err and "would run" not in err


def test_a_missing_config_without_a_json_suffix_is_an_error_naming_it(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    code, out, err = run_cli("launch", "--dry-run", "train.py", "--deepspeed_config", "ds_config")
    assert code == 1 and "ds_config: no such file" in err and "no config named" not in err


def test_preflight_failure_markers_become_the_last_line():
    from shardkit.run.launcher import preflight_summary

    line = preflight_summary({0: "tensors on the wrong device:", 1: "tensors on the wrong device:"}, 2)
    assert line.startswith("shardkit launch: placement preflight failed on rank(s) [0, 1] of 2 before the first optimizer step")
    assert "exit 3" in line and "--no-preflight" in line


def test_bad_config_stops_the_launch_before_anything_starts(run_cli, tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True}, "bf16": {"enabled": True},
                               "zero_optimization": {"stage": 3}}))
    marker = tmp_path / "started"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    code, out, err = run_cli("launch", "--launcher", "torchrun", "--nproc_per_node", "1", script, "--deepspeed_config", cfg)
    assert code == 1
    # (on a machine without a GPU fp16 is a second error)
    assert "bf16.enabled" in out and f" error(s) in {cfg}" in err and "not started: " in err
    assert not marker.exists()


def test_missing_config_file_is_one_clear_error(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    code, out, err = run_cli("launch", "--dry-run", "train.py", "--deepspeed_config", tmp_path / "nope.json")
    assert code == 1 and "nope.json: no such file" in err


# ---------------------------------------------------------------- real local runs

GOOD_AND_BAD = textwrap.dedent(
    """
    import sys
    import torch, torch.distributed as dist, torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 8)
            self.out_head = nn.Linear(8, 4)
        def forward(self, x):
            return self.out_head(torch.relu(self.body(x)))

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Net().to("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if "--replace-head" in sys.argv:
        # a replaced head, CPU analog: the new head's tensors are not where the model lives
        model.out_head = nn.Linear(8, 4, device="meta")
    for step in range(2):
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(f"rank {dist.get_rank()} trained", flush=True)
    dist.destroy_process_group()
    """
)


def _run(argv: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    """Run a launcher in its own process group and kill the whole group at the timeout."""
    # CPU ranks even on a GPU machine (2 ranks on one GPU would fail in nccl): the ready scripts'
    # DEVICE=cpu, and the same pins for the plain launches
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", DEVICE="cpu", CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{argv} did not finish within {timeout}s:\n{out}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


@pytest.mark.slow
def test_ready_torchrun_script_two_cpu_ranks_pass_the_automatic_preflight(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(GOOD_AND_BAD)
    # through the ready script in launch/ (NPROC=2 is its default)
    r = _run(["bash", str(REPO / "launch" / "torchrun_local.sh"), str(script)])
    assert r.returncode == 0, r.stdout
    assert "placement preflight passed on 2 rank(s)" in r.stdout
    assert "rank 0 trained" in r.stdout and "rank 1 trained" in r.stdout


@pytest.mark.slow
def test_torchrun_stops_every_rank_when_a_module_was_replaced_after_init(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(GOOD_AND_BAD)
    r = _run([sys.executable, "-m", "shardkit", "launch", "--launcher", "torchrun", "--standalone", "--nproc_per_node", "2",
              str(script), "--replace-head"])
    assert r.returncode == EXIT_CODE, r.stdout
    # shardkit's own summary comes after torchrun's ChildFailedError traceback: the last line
    assert "ChildFailedError" in r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith(
        "shardkit launch: placement preflight failed on rank(s) [0, 1] of 2 before the first optimizer step: "
    )
    # the table names the tensor, where it is and where it should be; no rank trained
    assert "out_head.weight" in r.stdout and "meta" in r.stdout and "cpu" in r.stdout
    assert "placement preflight failed before the first optimizer step" in r.stdout
    assert f"exit {EXIT_CODE}" in r.stdout
    assert "trained" not in r.stdout


@pytest.mark.slow
def test_ready_deepspeed_launch_script_runs_zero3_on_two_ranks():
    r = _run(["bash", str(REPO / "launch" / "deepspeed_local.sh")], timeout=300)
    assert r.returncode == 0, r.stdout[-4000:]
    assert "placement preflight passed on 2 rank(s)" in r.stdout and "(DeepSpeed engine)" in r.stdout
    assert "training finished" in r.stdout


def test_slurm_template_launches_through_shardkit():
    text = (REPO / "launch" / "slurm_multinode.sbatch").read_text()
    assert "#SBATCH --nodes=" in text and "srun" in text
    assert "shardkit launch --launcher torchrun" in text and "--rdzv_endpoint" in text
    subprocess.run(["bash", "-n", str(REPO / "launch" / "slurm_multinode.sbatch")], check=True)
