"""Hostile and careless rank environments: a preflight called a different number of times on
different ranks, environment variables that disagree with the launcher or the process group
(RANK, WORLD_SIZE, LOCAL_RANK, CUDA_VISIBLE_DEVICES), and SIGINT/SIGTERM during `shardkit launch`
(at rank start, mid-training, the launcher itself killed) and `shardkit consolidate`. What a user
would notice: no hang, a message naming the variable, its value, why it matters and the fix, a
non-zero exit where the run cannot go on (130/143 after a signal), no rank process left running, no
half-written output left behind, and a run that is fine left alone (a launcher that overrides a
stale export)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shardkit.platform.dist import rank_env_problems
from shardkit.run.launch_env import launch_env_findings
from shardkit.run.spawn.process import run_ranks
from tests import _ranks_hostile as targets
from tests._slow_writes import slow_fsync_cli

TIMEOUT_S = 180


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.slow
def test_rank1_calls_preflight_twice_rank0_once_named_with_the_counts_within_the_timeout():
    r0, r1 = [r.value for r in run_ranks(targets.uneven_preflight_calls, 2, args=([1, 2], 4.0), timeout=120,
                                           backend="gloo")]
    assert [o["ok"] for o in r0["outcomes"]] == [True]
    first, second = r1["outcomes"]
    assert first["ok"] is True
    text = second["text"]
    assert second["ok"] is False and "ranks [0] of 2 did not reach the placement preflight within 4s" in text, text
    assert "shardkit.preflight calls so far: 1 call: ranks [0]; 2 calls: ranks [1]" in text, text
    assert "call it on every rank, the same number of times" in text
    assert r1["seconds"] < 4.0 + 30  # the timeout, not forever (the grace for rank 0's verdict is not waited)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.slow
def test_a_rank_that_skips_the_preflight_is_named_with_zero_calls():
    r0, r1 = [r.value for r in run_ranks(targets.uneven_preflight_calls, 2, args=([1, 0], 4.0), timeout=120,
                                           backend="gloo")]
    assert r1["outcomes"] == []
    (only,) = r0["outcomes"]
    assert only["ok"] is False and "ranks [1] of 2 did not reach the placement preflight within 4s" in only["text"]
    assert "0 calls: ranks [1]; 1 call: ranks [0]" in only["text"], only["text"]


# --- the rank's variables against each other and the process group ------------------------------



def test_local_rank_unset_while_rank_and_world_size_are_set_names_deepspeeds_mpi_fallback():
    (problem,) = rank_env_problems({"RANK": "1", "WORLD_SIZE": "2"}, before_init=True, accelerators=2)
    assert problem.startswith("LOCAL_RANK is not set while RANK=1 and WORLD_SIZE=2 are: ")
    assert "No module named 'mpi4py'" in problem and "every rank of a node computes on device 0" in problem
    assert "LOCAL_RANK=$SLURM_LOCALID" in problem
    # a CPU run whose process group is already up picks no device by LOCAL_RANK: nothing to say
    assert rank_env_problems({"RANK": "1", "WORLD_SIZE": "2"}, group=(1, 2)) == []


@pytest.mark.parametrize(("env", "expected"), [
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK=2 with WORLD_SIZE=2: ranks count 0..1, so this rank cannot exist"),
    ({"RANK": "-1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK=-1 with WORLD_SIZE=2: ranks count 0..1"),
    ({"RANK": "0", "WORLD_SIZE": "0", "LOCAL_RANK": "0"}, "WORLD_SIZE=0: a run has at least 1 rank"),
    ({"RANK": "0", "WORLD_SIZE": "two", "LOCAL_RANK": "0"}, "WORLD_SIZE='two' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-3"}, "LOCAL_RANK=-3: a rank's index on its node is never negative"),
])
def test_impossible_rank_variables_are_named_with_their_values(env, expected):
    (problem,) = rank_env_problems(env, before_init=True)
    assert problem.startswith(expected), problem
    assert "Fix: launch with torchrun, the deepspeed launcher or `shardkit launch`" in problem


def test_local_rank_beyond_the_visible_devices_names_cuda_visible_devices():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "0,1"}
    (problem,) = rank_env_problems(env, accelerators=2)
    assert problem.startswith("LOCAL_RANK=3 but this rank sees 2 accelerator(s) (CUDA_VISIBLE_DEVICES='0,1'): "
                              "device 3 does not exist ('invalid device ordinal')"), problem
    assert "--nproc_per_node 2" in problem


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.slow
def test_a_stale_world_size_export_fails_the_preflight_on_every_rank_with_one_message():
    r0, r1 = [r.value for r in run_ranks(targets.env_disagrees_with_group, 2, args=("WORLD_SIZE", "3"), timeout=120,
                                           backend="gloo")]
    assert r0["ok"] is False and r0["text"] == r1["text"]
    assert ("[error] environment: ranks [0, 1]: WORLD_SIZE=3 in this rank's environment, but its process group has "
            "2 rank(s)") in r0["text"], r0["text"]
    assert "Fix: Unset WORLD_SIZE before launching, or let the launcher set it." in r0["text"]


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.slow
def test_a_rank_variable_that_disagrees_with_the_group_is_named_on_the_rank_it_is_wrong_on():
    # RANK=0 exported on both ranks: wrong on rank 1 only, and both ranks fail with the same table
    r0, r1 = [r.value for r in run_ranks(targets.env_disagrees_with_group, 2, args=("RANK", "0"), timeout=120,
                                           backend="gloo")]
    assert r0["ok"] is False and r0["text"] == r1["text"]
    assert "environment: rank 1: RANK=0 in this rank's environment, but it is rank 1 of its process group" in r0["text"]


# --- the launching shell against `shardkit launch` ------------------------------------------------



def _launch_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import os, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "print(f\"rank {dist.get_rank()} env WORLD_SIZE={os.environ['WORLD_SIZE']} group={dist.get_world_size()}\", flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    return script


def test_world_size_exported_against_launch_nproc_is_a_warning_naming_both(run_cli, tmp_path, monkeypatch):
    from shardkit.run.launcher import build_launch, check_launch_config

    script = _launch_script(tmp_path)
    plan = build_launch(["--nproc_per_node", "2", str(script)], "torchrun", environ={"WORLD_SIZE": "3", "RANK": "0"})
    (finding,) = [f for f in check_launch_config(plan).findings if f.key == "environment"]
    assert finding.severity.value == "warning" and finding.value == "RANK=0 WORLD_SIZE=3"
    assert finding.message.startswith("RANK=0 WORLD_SIZE=3 exported in the launching shell (WORLD_SIZE says 3, the "
                                      "launch starts 2 rank(s)): torchrun gives every rank its own values")
    assert finding.fix.startswith("unset RANK WORLD_SIZE before `shardkit launch`")
    # the CLI shows it and starts (a warning: the launcher's values win in every rank)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli("launch", "--dry-run", "--launcher", "torchrun", "--nproc_per_node", "2", str(script))
    assert code == 0 and "1 warning(s)" in out and "would run:" in err, out + err


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
def test_the_ranks_get_the_launchers_world_size_not_the_exported_one(tmp_path):
    env = dict(os.environ, WORLD_SIZE="3", RANK="5", LOCAL_RANK="7", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "shardkit", "launch", "--launcher", "torchrun", "--standalone",
                        "--nproc_per_node", "2", str(_launch_script(tmp_path))], env=env, capture_output=True,
                       text=True, timeout=150, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 0 env WORLD_SIZE=2 group=2" in r.stdout and "rank 1 env WORLD_SIZE=2 group=2" in r.stdout
    # the exported values are named before the start (a warning: the launcher's values win)
    assert "1 warning(s)" in r.stdout and "environment" in r.stdout, r.stdout


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
def test_preflight_ranks_get_their_own_variables_whatever_the_shell_exported(tmp_path):
    """`shardkit preflight --nproc 2` starts its own ranks: a stale RANK/WORLD_SIZE/LOCAL_RANK in the
    shell reaches none of them (each rank gets its own, and the group matches)."""
    from tests.conftest import DS_CONFIGS

    env = dict(os.environ, WORLD_SIZE="3", RANK="5", LOCAL_RANK="7", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "shardkit", "preflight", str(DS_CONFIGS / "zero3.json"), "--nproc", "2",
                        "--device", "cpu"], env=env, capture_output=True, text=True, timeout=TIMEOUT_S - 20, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "2 rank(s)" in r.stdout and "environment" not in r.stdout, r.stdout[-3000:]


def test_cuda_visible_devices_empty_with_an_fp16_config_stops_the_launch_and_says_why(run_cli, tmp_path, monkeypatch):
    import json

    from shardkit.platform.environment.accelerator import probe_cpu_fp16

    if probe_cpu_fp16():  # the fp16 error below is what a CPU without fp16 kernels gets; this one has them
        pytest.skip("this CPU runs fp16 (oneDNN AVX512-FP16/AMX-FP16): DeepSpeed accepts it, nothing to refuse")

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                               "fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}))
    from shardkit.run.launcher import build_launch, check_launch_config

    script = _launch_script(tmp_path)
    plan = build_launch(["--nproc_per_node", "2", str(script), "--deepspeed_config", str(cfg)], "torchrun",
                        environ={"CUDA_VISIBLE_DEVICES": ""})
    findings = {f.key: f for f in check_launch_config(plan).findings}
    assert findings["fp16.enabled"].severity.value == "error"  # what fails on a CPU run
    hidden = findings["CUDA_VISIBLE_DEVICES"]  # and why the run is a CPU run
    assert hidden.value == "" and hidden.message.startswith(
        "CUDA_VISIBLE_DEVICES='' hides every GPU from the ranks: this is a CPU run (gloo), and a config or script "
        "that asks for the accelerator (fp16, nccl, .cuda()) fails there")
    assert hidden.fix.startswith("unset CUDA_VISIBLE_DEVICES (or list the GPUs) to train on GPUs")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli("launch", "--launcher", "torchrun", "--nproc_per_node", "2", str(script),
                             "--deepspeed_config", str(cfg))
    assert code == 1 and "not started: 1 error(s)" in err, out + err
    assert "CUDA_VISIBLE_DEVICES" in out and "fp16.enabled" in out


def test_fewer_visible_gpus_than_ranks_per_node_is_an_error_before_anything_starts():
    (finding,) = launch_env_findings({"CUDA_VISIBLE_DEVICES": "0"}, launcher="torchrun", world_size=2, per_node=2, gpus=1)
    assert finding.severity.value == "error" and finding.key == "CUDA_VISIBLE_DEVICES" and finding.value == "0"
    assert finding.message.startswith("CUDA_VISIBLE_DEVICES='0' shows 1 GPU(s) but torchrun starts 2 rank(s) on this "
                                      "node: the ranks with LOCAL_RANK 1..1 ask for devices that do not exist")
    assert finding.fix == "start 1 rank(s) per node, or list 2 GPUs in CUDA_VISIBLE_DEVICES"
    # a CPU run: the list picks no device, nothing to say
    assert launch_env_findings({"CUDA_VISIBLE_DEVICES": "0"}, launcher="torchrun", world_size=2, per_node=2, gpus=0) == []


def test_hidden_gpus_are_named_where_it_matters_and_a_deliberate_cpu_run_is_left_alone():
    hidden = {"CUDA_VISIBLE_DEVICES": ""}
    kw = dict(launcher="torchrun", world_size=2, per_node=2, gpus=0)
    (on_gpu_node,) = launch_env_findings(hidden, gpus_present=True, **kw)
    assert on_gpu_node.key == "CUDA_VISIBLE_DEVICES" and on_gpu_node.severity.value == "warning"
    assert launch_env_findings(hidden, gpus_present=False, **kw) == []  # a CPU-only node: nothing hidden
    assert len(launch_env_findings({"CUDA_VISIBLE_DEVICES": "-1"}, gpus_present=False, config_failed=True, **kw)) == 1


# --- SIGINT / SIGTERM during `shardkit launch` and `shardkit consolidate` -------------------------


# Each rank leaves its pid (so the test can look for orphans), then either sleeps before the process
# group exists (a stop at rank start) or trains ZeRO-3 for real, leaving a marker after every step.
RANK_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    out = sys.argv[1]
    rank = os.environ["RANK"]
    # written whole, then renamed: the test reads the file as soon as it exists
    pid_file = os.path.join(out, f"rank{rank}.pid")
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)
    if sys.argv[2] == "start":
        time.sleep(300)
    import deepspeed, torch, torch.nn as nn
    deepspeed.init_distributed()
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for step in range(100000):
        loss = engine(torch.randn(4, 16)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        open(os.path.join(out, f"rank{rank}.step{step}"), "w").close()
        time.sleep(0.05)
    """
)


def _launch_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    return env


def _wait_for(paths: list[Path], proc: subprocess.Popen, timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, f"ended early with {proc.returncode}"
        assert time.monotonic() < deadline, f"never saw {paths}"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _stop_launch(tmp_path: Path, stage: str, sig: signal.Signals) -> tuple[int, str, list[int]]:
    script = tmp_path / "train.py"
    script.write_text(RANK_SCRIPT)
    proc = subprocess.Popen([sys.executable, "-m", "shardkit", "launch", "--launcher", "torchrun", "--standalone",
                             "--nproc_per_node", "2", str(script), str(tmp_path), stage],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_launch_env(),
                            cwd=tmp_path, start_new_session=True)
    try:
        marks = [tmp_path / f"rank{r}.pid" for r in (0, 1)]
        if stage == "train":
            marks += [tmp_path / f"rank{r}.step2" for r in (0, 1)]
        _wait_for(marks, proc)
        pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in (0, 1)]
        proc.send_signal(sig)  # to shardkit launch alone, as a scheduler's `kill` does
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, pids


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize(("stage", "sig", "code"), [("start", signal.SIGTERM, 143), ("train", signal.SIGINT, 130),
                                                    ("train", signal.SIGTERM, 143)])
def test_a_stopped_launch_leaves_no_rank_running_and_exits_with_the_signal(tmp_path, stage, sig, code):
    rc, out, pids = _stop_launch(tmp_path, stage, sig)
    assert rc == code, out[-3000:]
    assert f"shardkit launch: stopped by {sig.name}: torchrun and its ranks were stopped" in out, out[-3000:]
    assert f"exit {code}" in out
    assert [p for p in pids if _alive(p)] == [], "rank processes outlived the launch"


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
def test_ranks_a_killed_launcher_left_behind_are_stopped_and_named(tmp_path):
    import psutil

    script = tmp_path / "train.py"
    script.write_text(RANK_SCRIPT)
    proc = subprocess.Popen([sys.executable, "-m", "shardkit", "launch", "--launcher", "torchrun", "--standalone",
                             "--nproc_per_node", "2", str(script), str(tmp_path), "start"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_launch_env(),
                            cwd=tmp_path, start_new_session=True)
    try:
        _wait_for([tmp_path / f"rank{r}.pid" for r in (0, 1)], proc)
        pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in (0, 1)]
        (torchrun,) = psutil.Process(proc.pid).children()
        torchrun.kill()  # the launcher dies without stopping its ranks (OOM killer, kill -9)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 137, out[-3000:]
    assert "shardkit launch: torchrun exited; 2 process(es) the launcher left running were stopped: " in out, out[-3000:]
    assert all(str(p) in out for p in pids)
    assert [p for p in pids if _alive(p)] == []


@pytest.fixture(scope="module")
def big_source(tmp_path_factory) -> Path:
    """A sealed fp32 ZeRO-3 checkpoint scaled 150x (~250 MB): large enough to interrupt mid-write."""
    from benchmarks._scale_zero3 import scale_checkpoint
    from tests import _ranks_zero3 as R

    sources = R.build_sources(tmp_path_factory.getbasetemp() / "zero3")
    return scale_checkpoint(sources["fp32"], tmp_path_factory.mktemp("big"), 150).parent


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stopped_consolidate_removes_its_temporary_file_and_publishes_nothing(big_source, tmp_path, sig, code):
    out = tmp_path / "model.safetensors"
    # bf16 output: every piece is cast in memory, slow enough to be caught mid-write
    # fsyncs slowed (tests/_slow_writes.py): on an idle machine the whole write ended before the signal came
    proc = subprocess.Popen(slow_fsync_cli("consolidate", big_source, "-o", out, "--dtype", "bf16", "--no-verify"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_launch_env())
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".model.safetensors.tmp-*")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.005)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == code, err
    assert ("interrupted" if code == 130 else "terminated (SIGTERM); nothing was published") in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
def test_the_temporary_file_of_a_killed_consolidate_is_removed_by_the_next_run(big_source, tmp_path, run_cli):
    out = tmp_path / "model.safetensors"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that is not running any more
    left = tmp_path / f".model.safetensors.tmp-{dead.pid}-0123abcd"
    left.write_bytes(b"\0" * 4096)
    old = time.time() - 3600
    os.utime(left, (old, old))
    live = tmp_path / f".model.safetensors.tmp-{os.getpid()}-89abcdef"  # a live writer's: kept
    live.write_bytes(b"x")
    code, _, err = run_cli("consolidate", big_source, "-o", out, "--no-verify")
    assert code == 0, err
    assert f"removed {left} (4,096 bytes): the partial output of an earlier consolidate (pid {dead.pid}, no longer " \
           "running) that was killed before it could remove it" in err.replace("\n", " "), err
    assert not left.exists() and live.exists() and out.is_file()
