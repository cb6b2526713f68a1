"""shardkit.integrations.hf.PreflightCallback with a real transformers Trainer.

Multi-rank runs (tests/_ranks_trainer.py: a tiny Llama on 2 CPU ranks, DeepSpeed ZeRO-3 through
the Trainer, 2 steps): the callback `shardkit launch` injects into an unmodified script (clean:
trains to max_steps, one preflight); a module added after the engine was built (every rank stops
before step 1, naming it); a filled "auto" value this machine cannot run (fp16: stopped before
deepspeed.initialize); FSDP through the Trainer on CPU ranks, which Accelerate silently turns into
DDP (stopped, with the reason). One test per run holds all its assertions; every run has a hard
timeout that kills its whole process group. In-process: the checks on a filled config, and the
one-callback-per-Trainer rule with a real single-process Trainer (no DeepSpeed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkit.autopreflight import EXIT_CODE

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "tests" / "_ranks_trainer.py")
RUN_TIMEOUT = 300
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
LAUNCH = [sys.executable, "-m", "shardkit", "launch", "--launcher", "torchrun", "--standalone", "--nproc_per_node", "2"]


def _run(launcher: list[str], script_args: list[str], tmp_path: Path, **env_extra: str) -> subprocess.CompletedProcess[str]:
    """One real 2-rank Trainer run (2 steps); the launcher and every rank are killed after RUN_TIMEOUT."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **env_extra}
    env.pop("SHARDKIT_AUTOPREFLIGHT", None)
    argv = [*launcher, SCRIPT, "--out", str(tmp_path / "out"), "--max-steps", "2", "--save-steps", "100", *script_args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"run timed out after {RUN_TIMEOUT}s: {argv}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _both(r: subprocess.CompletedProcess[str]) -> str:
    return f"exit {r.returncode}\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-6000:]}"


def _stop_lines(r: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """rank -> the line a rank printed when the callback stopped it."""
    out = {}
    for line in r.stderr.splitlines():
        if line.startswith("shardkit autopreflight: rank ") and ("failed before" in line or "failed when" in line):
            out[line.split()[3].rstrip(":")] = line
    return out


# ---------------------------------------------------------------- real Trainer runs on 2 CPU ranks


@pytest.mark.slow
def test_shardkit_launch_injects_the_callback_into_an_unmodified_trainer_script(tmp_path):
    result = tmp_path / "result.json"
    r = _run(LAUNCH, ["--result", str(result)], tmp_path)  # no --callback: no code change
    assert r.returncode == 0, _both(r)
    # the preflight came from the injected callback, exactly once (the torch forward/step hooks
    # stood down), over the engine the Trainer built
    passed = [ln for ln in r.stderr.splitlines() if ln.startswith("shardkit autopreflight: placement preflight passed")]
    assert len(passed) == 1, _both(r)
    assert "on 2 rank(s)" in passed[0] and "HF Trainer, DeepSpeed ZeRO-3 engine + optimizer" in passed[0]
    # and both ranks reported it to the launch, whose last line says so
    assert r.stderr.strip().splitlines()[-1].startswith("shardkit launch: placement preflight passed on 2 of 2 rank(s)")
    assert "before the first optimizer step" in passed[0]
    # the filled config was checked (this config's one warning, printed once by rank 0)
    summary = '0 error(s), 1 warning(s) in HF Trainer DeepSpeed config ("auto" values filled by the Trainer)'
    assert r.stderr.count(summary) == 1, _both(r)
    assert "stage3_gather_16bit_weights_on_model_save" in r.stderr
    # training itself is unaffected: both steps ran and logged a loss
    assert json.loads(result.read_text())["global_step"] == 2
    assert r.stdout.count("'loss'") == 2, _both(r)


@pytest.mark.slow
def test_a_module_added_after_the_engine_stops_every_rank_before_step_1(tmp_path):
    # The script adds the callback itself (the one line) and adds `fault_head` after
    # deepspeed.initialize. Under shardkit launch the injected callback stands aside for the
    # script's: one table, one verdict; both ranks exit 3 and the launch ends with its summary.
    result = tmp_path / "result.json"
    r = _run(LAUNCH, ["--callback", "--fault", "unmanaged", "--result", str(result)], tmp_path)
    assert r.returncode == EXIT_CODE, _both(r)
    assert "module.fault_head.weight" in r.stdout and "module.fault_head.bias" in r.stdout, _both(r)
    assert "have no ds_id: created after deepspeed.initialize" in r.stdout
    assert r.stdout.count("placement preflight (deepspeed-zero3, 2 rank(s)") == 1, _both(r)
    stops = _stop_lines(r)
    assert set(stops) == {"0", "1"}, _both(r)
    assert all("placement preflight failed before the first optimizer step" in s for s in stops.values())
    assert "shardkit launch: placement preflight failed on rank(s) [0, 1] of 2" in r.stderr.strip().splitlines()[-1]
    # stopped before step 1: no loss logged, no result written
    assert "'loss'" not in r.stdout and not result.exists()


@pytest.mark.slow
def test_a_filled_fp16_auto_value_this_cpu_cannot_run_stops_before_deepspeed_initialize(tmp_path):
    from shardkit.platform.environment.fp16 import fp16_support

    if fp16_support(device="cpu").supported:
        pytest.skip("this CPU runs fp16 (oneDNN has fp16 here), so the filled fp16 value is fine on it")
    # "fp16": {"enabled": "auto"} + TrainingArguments(fp16=True): the Trainer fills True; the
    # injected callback checks right after Trainer.__init__, before deepspeed.initialize would
    # refuse it with no fix
    r = _run(LAUNCH, ["--fp16"], tmp_path)
    assert r.returncode == EXIT_CODE, _both(r)
    stops = _stop_lines(r)
    assert set(stops) == {"0", "1"}, _both(r)
    for line in stops.values():
        assert "failed when the Trainer was built, before deepspeed.initialize (every Trainer is checked" in line
        assert "fp16.enabled=True: fp16 on a CPU run" in line
        assert 'Fix: use bf16 on CPU runs' in line
    assert '1 error(s), 1 warning(s) in HF Trainer DeepSpeed config ("auto" values filled by the Trainer)' in r.stderr
    # DeepSpeed never got to refuse it itself
    assert not any(ln.startswith("ValueError") for ln in r.stderr.splitlines()), _both(r)


@pytest.mark.slow
def test_fsdp_through_the_trainer_on_cpu_ranks_is_stopped_with_the_reason(tmp_path):
    # Accelerate 1.15 enables FSDP only on accelerator ranks; on CPU ranks the Trainer silently
    # trains DDP. The callback (added by the script, run under plain torchrun) says so and stops.
    r = _run(TORCHRUN, ["--engine", "fsdp2", "--callback"], tmp_path)
    assert r.returncode != 0, _both(r)
    stops = _stop_lines(r)
    assert set(stops) == {"0", "1"}, _both(r)
    for line in stops.values():
        assert "TrainingArguments.fsdp=True: FSDP was asked for, but Accelerate did not enable it (distributed_type MULTI_CPU)" in line
        assert "Fix: run on GPUs" in line
    assert "remove the PreflightCallback to skip the check" in r.stderr  # not a shardkit launch run
    assert "'loss'" not in r.stdout


@pytest.mark.gpu
@pytest.mark.slow
def test_fsdp2_through_the_trainer_on_gpus_passes_the_preflight(tmp_path):
    n = torch.cuda.device_count()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), SCRIPT,
            "--out", str(tmp_path / "out"), "--max-steps", "2", "--save-steps", "100", "--engine", "fsdp2", "--callback", "--gpu"]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=RUN_TIMEOUT)
    assert r.returncode == 0, _both(r)
    assert "HF Trainer, FSDP2 model + optimizer" in r.stderr and "placement preflight passed" in r.stderr, _both(r)


# ---------------------------------------------------------------- in one process


@pytest.fixture(autouse=True)
def _restore_hook_state():
    """The callback claims the process's one automatic preflight (HookState.done): put the state
    back so no test depends on the order the others ran in."""
    from shardkit.autopreflight.run import HookState

    saved = (HookState.done, list(HookState.handles), HookState.original_optimizer_init)
    yield
    HookState.done, HookState.handles[:], HookState.original_optimizer_init = saved[0], saved[1], saved[2]


def _judge_on_rank(fail_ranks: list[int]) -> list[str]:
    """One rank of the agreement test, once per entry: only that rank found an error (an
    environment row of its node; -1: none did)."""
    return [_judge_once(r) for r in fail_ranks]


def _judge_once(fail_rank: int) -> str:
    import torch.distributed as dist

    from shardkit.core.errors import ConfigError
    from shardkit.core.findings import Finding, Report, Severity
    from shardkit.integrations.hf import PreflightCallback

    report = Report(subject="HF Trainer DeepSpeed config")
    if dist.get_rank() == fail_rank:
        report.add(Finding(Severity.ERROR, "fp16.enabled", True, "fp16 on a CPU run", "use bf16", "env-fp16"))
    try:
        PreflightCallback(on_failure="raise")._judge(report, final=False)
    except ConfigError as exc:
        return str(exc)
    return "went on"


@pytest.mark.slow
def test_ranks_agree_before_stopping_so_no_node_goes_on_alone():
    # environment rows are probed per node: rank 1's node fails, rank 0's passes; both must stop,
    # or rank 0 would go on into deepspeed.initialize and wait there for a rank that left
    from shardkit.run.spawn.process import run_ranks

    results = run_ranks(_judge_on_rank, 2, args=([1, -1],), device="cpu", timeout=120)
    (msg0, clean0), (msg1, clean1) = (r.value for r in results)
    assert msg0 != "went on" and "error(s) on rank(s) [1]" in msg0 and "checks of their own node" in msg0
    assert "1 error(s) when the Trainer was built, before deepspeed.initialize" in msg1 and "fp16 on a CPU run" in msg1
    assert "every Trainer is checked: train(), evaluate() and predict()" in msg1
    # then nobody failed: nobody stops (and every rank took part in the one all_reduce, or this would hang)
    assert (clean0, clean1) == ("went on", "went on")


def test_a_trainer_never_ready_gets_one_warning_naming_what_is_missing(tmp_path, monkeypatch, capsys):
    from transformers import Trainer

    from shardkit.integrations.hf import PreflightCallback

    for var in ("RANK", "SHARDKIT_AUTOPREFLIGHT"):
        monkeypatch.delenv(var, raising=False)

    class FiringTrainer(Trainer):
        def fire(self, event: str) -> None:  # the Trainer is the caller, as in train()
            getattr(self.callback_handler, event)(self.args, self.state, self.control)

    trainer = _tiny_trainer(tmp_path)
    trainer.__class__ = FiringTrainer
    callback = PreflightCallback(on_failure="raise")
    trainer.add_callback(callback)
    assert trainer.optimizer is None  # built lazily: train() never ran
    trainer.fire("on_train_begin")  # not ready yet: waits for the first step
    assert capsys.readouterr().err == ""
    trainer.fire("on_step_begin")
    trainer.fire("on_step_begin")
    err = capsys.readouterr().err
    assert err.count("placement preflight not run: at the first step trainer.optimizer is None") == 1, err
    assert callback.ran == 0


def test_filled_config_checks_drop_accelerates_own_value_and_name_autos_the_trainer_never_fills():
    from shardkit.integrations.hf.config_check import filled_config_report
    from shardkit.platform.environment.facts import probe_environment

    facts = probe_environment({"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}, memlock_bytes=None, cpu_fp16=False)
    # what the Trainer hands to deepspeed.initialize, minus Accelerate's steps_per_print=inf
    # (filled_deepspeed_config drops it; here it never was), with one key the Trainer never fills
    cfg: dict[str, Any] = {
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                              "offload_optimizer": {"device": "cpu", "pin_memory": "auto"}},
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": False},
    }
    early = filled_config_report(cfg, world_size=2, final=False, facts=facts)
    assert not [f for f in early.findings if f.rule == "hf-auto-unfilled"]  # deepspeed_init fills more later
    final = filled_config_report(cfg, world_size=2, final=True, facts=facts)
    unfilled = [f for f in final.findings if f.rule == "hf-auto-unfilled"]
    assert len(unfilled) == 1 and unfilled[0].key == "zero_optimization.offload_optimizer.pin_memory"
    assert "DeepSpeed drops every other" in unfilled[0].message and "set a concrete value" in unfilled[0].fix
    # a filled batch that cannot hold for the world size is judged like `shardkit check` does
    bad = filled_config_report({**cfg, "train_batch_size": 6}, world_size=2, final=True, facts=facts)
    assert any(f.rule == "batch-arithmetic" and f.value == 6 for f in bad.errors)


def _tiny_trainer(tmp_path: Path, callbacks: list[Any] | None = None) -> Any:
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from _ranks_trainer import SyntheticTokens, tiny_llama
    finally:
        sys.path.remove(str(REPO / "tests"))
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, save_strategy="no",
                             logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True)
    return Trainer(model=tiny_llama(), args=args, train_dataset=SyntheticTokens(8), callbacks=callbacks)


@pytest.mark.slow
def test_one_callback_per_trainer_and_a_meta_tensor_raises_with_its_name(tmp_path, monkeypatch):
    from transformers import TrainerCallback

    from shardkit.core.errors import PreflightError, UsageError
    from shardkit.integrations.hf.callback import PreflightCallback, inject_preflight_callback

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SHARDKIT_AUTOPREFLIGHT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(UsageError, match=r"on_failure='quit'\): not a failure mode; use on_failure='exit'"):
        PreflightCallback(on_failure="quit")  # type: ignore[arg-type]

    # what shardkit launch does to a Trainer, then the script's own line: the script's callback runs
    trainer = _tiny_trainer(tmp_path / "a")
    injected = inject_preflight_callback(trainer)
    assert injected is not None and injected.injected
    assert inject_preflight_callback(trainer) is None  # never two injected
    mine = PreflightCallback(on_failure="raise")
    trainer.add_callback(mine)
    trainer.train()
    assert (mine.ran, injected.ran) == (1, 0)
    assert trainer.state.global_step == 1

    class MetaBufferAfterPrepare(TrainerCallback):  # runs before the callback (given to the constructor)
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            model.register_buffer("fault_buf", torch.zeros(4, device="meta"))

    trainer = _tiny_trainer(tmp_path / "b", callbacks=[MetaBufferAfterPrepare()])
    trainer.add_callback(PreflightCallback(on_failure="raise"))
    with pytest.raises(PreflightError, match=r"fault_buf[\s\S]*meta"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_launch_accepts_auto_values_in_a_config_given_to_the_trainer_as_deepspeed_path(tmp_path):
    # `--deepspeed PATH` is the HF Trainer's spelling: the Trainer fills "auto" and the ranks'
    # callback checks the filled values; `--deepspeed_config PATH` goes to deepspeed.initialize as is
    from shardkit.platform.environment.facts import probe_environment
    from shardkit.run.launcher import build_launch, check_launch_config

    cfg = tmp_path / "ds_hf.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
                               "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                               "train_batch_size": "auto", "bf16": {"enabled": "auto"}}))
    facts = probe_environment({"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}, memlock_bytes=None, cpu_fp16=False)
    for spelling in (["--deepspeed", str(cfg)], [f"--deepspeed={cfg}"]):
        plan = build_launch(["--nproc_per_node", "2", "train.py", *spelling], "torchrun", environ={})
        report = check_launch_config(plan, facts)
        assert not [f for f in report.findings if f.rule == "auto-value"], spelling
        # said before the launch: accepted because --deepspeed is the Trainer's flag, and who else must fill them
        (note,) = plan.notes
        assert note.startswith(f'{cfg}: "auto" accepted in train_micro_batch_size_per_gpu, gradient_accumulation_steps, '
                               "train_batch_size (+1 more) because `--deepspeed PATH` is the HF Trainer's flag")
        assert "A script that is not a Trainer and passes this file to deepspeed.initialize must fill them" in note
    plan = build_launch(["--nproc_per_node", "2", "train.py", "--deepspeed", "--deepspeed_config", str(cfg)], "torchrun", environ={})
    auto = [f for f in check_launch_config(plan, facts).errors if f.rule == "auto-value"]
    assert len(auto) == 1 and "train_micro_batch_size_per_gpu" in auto[0].message


@pytest.mark.parametrize("content, named", [
    (b'\xef\xbb\xbf{"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}',
     "a UTF-8 byte order mark (BOM, bytes EF BB BF) at byte 0"),
    (b'{\n // ZeRO-3\n "zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}',
     "a comment at line 2, column 2"),
    (b'{"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",\n}',
     "a trailing comma at line 1, column 77"),
], ids=["bom", "comment", "trailing-comma"])
def test_a_config_the_trainers_json_load_refuses_is_named_before_any_rank_starts(tmp_path, content, named):
    # The Trainer reads `--deepspeed PATH` in TrainingArguments (HfDeepSpeedConfig: open as utf-8, json.load),
    # before any callback exists: it dies there with a bare JSONDecodeError, so the callback's own check only
    # ever sees a filled dict. The check that can name the file is the one `shardkit launch` gives the
    # Trainer's config before its ranks start: an error, with where and the fix.
    from transformers import TrainingArguments

    from shardkit.platform.environment.facts import probe_environment
    from shardkit.run.launcher import build_launch, check_launch_config

    p = tmp_path / "ds_hf.json"
    p.write_bytes(content)
    with pytest.raises(json.JSONDecodeError):
        TrainingArguments(output_dir=str(tmp_path / "out"), deepspeed=str(p), use_cpu=True)
    facts = probe_environment({"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}, memlock_bytes=None, cpu_fp16=False)
    plan = build_launch(["--nproc_per_node", "2", "train.py", "--deepspeed", str(p)], "torchrun", environ={})
    (f,) = [f for f in check_launch_config(plan, facts).errors if f.rule == "config-syntax-hjson"]
    assert f.message.startswith(f"not JSON: {named}. The HF Trainer and Accelerate read it with json.load"), f.message
    where = "without a BOM" if "BOM" in named else named.rsplit(" at ", 1)[1]
    assert where in f.fix, f.fix
