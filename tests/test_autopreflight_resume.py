"""A resume through DeepSpeed's own ``engine.load_checkpoint`` under `shardkit launch` and the HF
Trainer's PreflightCallback, with no shardkit call in the script: the CPU Adam kernel state DeepSpeed
keeps outside the checkpoint is restored after the load (the continuation is bit-exact with an
uninterrupted run), and a checkpoint whose files are named for another precision than the config is
named before DeepSpeed's FileNotFoundError. Real torchrun, real DeepSpeed ZeRO-3 on 2 gloo ranks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TIMEOUT_S = 300

# Plain DeepSpeed: initialize, a plain load_checkpoint when --load is given, N steps, optional save.
# Prints every loss and, at the end, a digest of the rank's fp32 masters (the bits the next step reads).
SCRIPT = textwrap.dedent(
    """
    import argparse, hashlib, json, os, sys
    import deepspeed, torch, torch.nn as nn
    import torch.distributed as dist

    p = argparse.ArgumentParser()
    p.add_argument("--deepspeed_config")
    p.add_argument("--steps", type=int)
    p.add_argument("--load")
    p.add_argument("--save")
    a = p.parse_args()

    def say(line):
        # one write per line: both ranks share the pipe, and print() writes the text and its newline
        # separately, so two ranks' lines could run together and a loss go unparsed
        sys.stdout.flush()
        os.write(1, (line + "\\n").encode())

    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=a.deepspeed_config)
    rank = dist.get_rank()
    if a.load:
        path, _ = engine.load_checkpoint(a.load)  # DeepSpeed's own load, nothing by hand after it
        assert path is not None, a.load
    start = engine.global_steps
    for step in range(start, start + a.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(4, 16, generator=g).to(engine.device, torch.bfloat16 if engine.bfloat16_enabled() else torch.float32)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        say(f"rank {rank} step {step} loss {loss.item().hex()}")
    if a.save:
        engine.save_checkpoint(a.save)
    masters = b"".join(t.detach().cpu().numpy().tobytes() for t in engine.optimizer.fp32_partitioned_groups_flat)
    say(f"rank {rank} masters {hashlib.sha256(masters).hexdigest()}")
    dist.barrier()
    dist.destroy_process_group()
    # done and flushed: leave without interpreter finalization, where torch 2.13 CPU ranks abort now
    # and then ("terminate called without an active exception"; launch/train_tiny.py, docs/slurm.md)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
    """
)


def _config(path: Path, precision: str) -> Path:
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False}},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    path.write_text(json.dumps(cfg))
    return path


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    return env


def _launch(tmp: Path, config: Path, *args: str, preflight: bool = True) -> subprocess.CompletedProcess:
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    own = [] if preflight else ["--no-preflight"]
    argv = [sys.executable, "-m", "shardkit", "launch", *own, "--launcher", "torchrun", "--standalone",
            "--nproc_per_node", "2", str(script), "--deepspeed_config", str(config), *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                            start_new_session=True, cwd=tmp)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{argv} did not finish within {TIMEOUT_S}s:\n{out}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


def _losses(out: str) -> dict[tuple[int, int], str]:
    return {(int(r), int(s)): v for r, s, v in re.findall(r"rank (\d) step (\d+) loss (\S+)", out)}


def _masters(out: str) -> dict[int, str]:
    return {int(r): h for r, h in re.findall(r"rank (\d) masters ([0-9a-f]{64})", out)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """An uninterrupted 5-step run; 2 steps saved at step 2; that checkpoint resumed for 3 steps by
    a plain load_checkpoint under `shardkit launch`, and (the control) with --no-preflight."""
    tmp = tmp_path_factory.mktemp("resume")
    cfg = _config(tmp / "ds_fp32.json", "fp32")
    ckpt = tmp / "ckpt"
    # saved at step 2: the first resumed step is 3, where float32 0.999**3 by multiplication (one
    # process) and by pow (a new process) differ in the last bit (tests/test_cpu_adam_kernel.py)
    out = {"whole": _launch(tmp, cfg, "--steps", "5"), "first": _launch(tmp, cfg, "--steps", "2", "--save", str(ckpt))}
    out["resumed"] = _launch(tmp, cfg, "--steps", "3", "--load", str(ckpt))
    out["control"] = _launch(tmp, cfg, "--steps", "3", "--load", str(ckpt), preflight=False)
    for name, r in out.items():
        assert r.returncode == 0, f"{name}:\n{r.stdout[-4000:]}"
    return out


def test_a_plain_load_checkpoint_under_launch_continues_bit_exactly(runs):
    whole, resumed = _losses(runs["whole"].stdout), _losses(runs["resumed"].stdout)
    assert sorted(resumed) == [(r, s) for r in (0, 1) for s in (2, 3, 4)], runs["resumed"].stdout[-3000:]
    assert {k: whole[k] for k in resumed} == resumed
    assert _masters(runs["resumed"].stdout) == _masters(runs["whole"].stdout)
    assert "placement preflight passed on 2 rank(s)" in runs["resumed"].stdout


def test_without_the_launch_hooks_the_same_plain_load_is_not_bit_exact(runs):
    """The control: the same resume without shardkit's hooks differs from the uninterrupted run in
    the fp32 masters (DeepSpeed's CPU Adam kernel restarts its beta powers from pow(beta, step))."""
    assert _masters(runs["control"].stdout) != _masters(runs["whole"].stdout)


def test_a_bf16_checkpoint_loaded_by_an_fp32_config_is_named_before_deepspeeds_traceback(tmp_path):
    bf16, fp32 = _config(tmp_path / "ds_bf16.json", "bf16"), _config(tmp_path / "ds_fp32.json", "fp32")
    ckpt = tmp_path / "ckpt_bf16"
    saved = _launch(tmp_path, bf16, "--steps", "1", "--save", str(ckpt))
    assert saved.returncode == 0, saved.stdout[-4000:]
    r = _launch(tmp_path, fp32, "--steps", "1", "--load", str(ckpt))
    assert r.returncode != 0
    # shardkit's CheckpointError names the files' precision, the config's, and the fix; DeepSpeed never
    # got to open a file it cannot find
    assert "CheckpointError" in r.stdout, r.stdout[-4000:]
    assert "its ZeRO optimizer files are named for bf16" in r.stdout and "FileNotFoundError:" not in r.stdout, r.stdout[-4000:]
    assert "Fix:" in r.stdout


# --- the HF Trainer: its resume is DeepSpeed's plain load_checkpoint --------------------------------


def test_trainer_resume_with_a_callback_added_after_init_restores_the_kernel_state_and_says_so(tmp_path):
    """The Trainer loads its checkpoint inside train(), before any callback event; a PreflightCallback
    added with trainer.add_callback (no `shardkit launch`) restores the CPU kernel state at
    on_train_begin, and says that the precision check could not come first."""
    from tests.test_hf_callback import TORCHRUN, _both, _run

    first = _run(TORCHRUN, ["--max-steps", "2", "--save-steps", "2"], tmp_path)
    assert first.returncode == 0, _both(first)
    ckpt = tmp_path / "out" / "checkpoint-2"
    resumed = _run(TORCHRUN, ["--max-steps", "3", "--save-steps", "100", "--resume", str(ckpt), "--callback"], tmp_path)
    assert resumed.returncode == 0, _both(resumed)
    flat = " ".join(resumed.stderr.split())
    assert ("shardkit: PreflightCallback: the Trainer loaded a DeepSpeed checkpoint before this callback could guard "
            "the load (the callback was added after the Trainer was built): CPU Adam kernel state restored now "
            "(FusedAdam CPU kernel (adamw mode) to step 2)") in flat, _both(resumed)
    assert "Trainer(callbacks=[PreflightCallback()]) or run under `shardkit launch` for both" in flat
    # under `shardkit launch` the engine's load_checkpoint is guarded when deepspeed.initialize returns:
    # nothing is left to restore at on_train_begin, and the run passes its preflight
    from tests.test_hf_callback import LAUNCH

    launched = _run(LAUNCH, ["--max-steps", "3", "--save-steps", "100", "--resume", str(ckpt)], tmp_path)
    assert launched.returncode == 0, _both(launched)
    assert "could guard the load" not in launched.stderr
    assert "placement preflight passed on 2 rank(s)" in launched.stderr, _both(launched)
