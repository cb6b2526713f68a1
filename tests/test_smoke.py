"""`shardkit smoke`: the main job. Real 2-rank ZeRO-3 and FSDP2 runs on CPU (gloo)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from shardkit.run.smoke.options import SmokeOptions, fit_config
from shardkit.run.smoke.report import EngineResult, _compare, print_smoke_report
from shardkit.run.smoke.runs import run_smoke


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_smoke_resumes_bit_exact(engine, run_cli, tmp_path):
    out_json = tmp_path / "smoke.json"
    code, out, err = run_cli("smoke", "--engine", engine, "--nproc", "2", "--device", "cpu", "--steps", "4", "--json", out_json, "--quiet")
    assert code == 0, out + err
    assert "bit-exact" in out and "all passed" in out
    report = json.loads(out_json.read_text())
    (result,) = report["results"]
    assert result["engine"] == engine and result["ok"] and result["exact"]
    # the resumed curve (runs B + C) is the uninterrupted one, on both ranks, bit for bit
    assert result["losses_resumed"] == result["losses_uninterrupted"]
    assert len(result["losses_uninterrupted"]) == 2 and len(result["losses_uninterrupted"][0]) == 4
    assert result["preflight"] == "passed"
    # both sides went through shardkit.checkpoint (no plain DeepSpeed / DCP fallback)
    assert result["checkpoint"] == {"zero3": "shardkit atomic -> verified zero3", "fsdp2": "shardkit atomic dcp -> verified dcp"}[engine]


def _corrupt_rank1_shard(root: Path) -> None:
    tag = (root / "latest").read_text().strip()
    (victim,) = sorted((root / tag).glob("__1_*.distcp"))  # rank 1's DCP shard
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, different content
    victim.write_bytes(bytes(data))


@pytest.mark.slow
def test_smoke_fails_with_one_clear_line_on_a_corrupted_checkpoint(tmp_path):
    opts = SmokeOptions(engines=("fsdp2",), nproc=2, device="cpu", steps=2, workdir=str(tmp_path), after_save=_corrupt_rank1_shard)
    report = run_smoke(opts, progress=False)
    assert report.exit_code == 1
    (result,) = report.results
    assert not result.ok
    assert result.failure.startswith("run C (resume) failed on rank ")
    assert "CheckpointError" in result.failure and "__1_0.distcp" in result.failure
    assert "blake3 mismatch" in result.failure
    out = io.StringIO()
    print_smoke_report(report, file=out)
    text = out.getvalue()
    assert "FAIL fsdp2: run C (resume) failed" in " ".join(text.split()) and "smoke: failed" in text


def test_a_differing_resumed_loss_is_named_by_step_and_rank():
    r = EngineResult(engine="zero3", device="cpu", preflight="passed")
    r.losses_uninterrupted = [[6.0, 5.0, 4.0, 3.0], [6.5, 5.5, 4.5, 3.5]]
    r.losses_resumed = [[6.0, 5.0, 4.0, 3.0], [6.5, 5.5, 4.5000001, 3.5]]
    _compare(r)
    assert not r.ok and not r.exact
    assert "at step 2 on rank 1" in r.failure and "did not restore the full training state" in r.failure


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
@pytest.mark.parametrize("preflight", ["not run", "unavailable"])
def test_equal_losses_without_a_passed_preflight_fail(device, preflight):
    r = EngineResult(engine="zero3", device=device, preflight=preflight)
    r.losses_uninterrupted = r.losses_resumed = [[6.0, 5.0]]
    _compare(r)
    assert not r.ok and "placement preflight after resume did not pass" in r.failure


def test_cpu_results_must_match_bit_for_bit_even_when_close():
    r = EngineResult(engine="fsdp2", device="cpu", preflight="passed")
    r.losses_uninterrupted = [[1.0, 1.0]]
    r.losses_resumed = [[1.0, 1.0 + 1e-12]]
    _compare(r)
    assert not r.ok


def test_config_mismatched_with_engine_is_a_usage_error(run_cli, tmp_path):
    cfg = tmp_path / "fsdp.json"
    cfg.write_text(json.dumps({"fsdp": {"wrap": ["LlamaDecoderLayer"]}}))
    code, out, err = run_cli("smoke", "--engine", "zero3", "--config", cfg, "--quiet")
    assert code == 2
    assert "is a fsdp config but --engine zero3 needs a deepspeed config" in err


def test_zero3_config_must_be_stage_3(run_cli, tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}))
    code, out, err = run_cli("smoke", "--engine", "zero3", "--config", cfg, "--quiet")
    assert code == 2 and "zero_optimization.stage is 2" in err


def test_fit_config_sets_batch_keys_for_the_world_size_and_drops_auto():
    cfg = {"train_batch_size": 64, "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}
    fitted = fit_config("zero3", cfg, nproc=2, batch=2)
    assert "train_batch_size" not in fitted
    assert fitted["train_micro_batch_size_per_gpu"] == 2 and fitted["gradient_accumulation_steps"] == 1
    assert "reduce_bucket_size" not in fitted["zero_optimization"]
    assert cfg["train_batch_size"] == 64  # the caller's dict is untouched


def test_too_few_steps_is_a_usage_error(run_cli):
    code, out, err = run_cli("smoke", "--engine", "fsdp2", "--steps", "1", "--quiet")
    assert code == 2 and "--steps must be at least 2" in err


# ---------------------------------------------------------------- DeepSpeed op builds


@pytest.mark.slow
def test_a_failed_op_build_is_one_line_naming_the_op_and_the_cause_and_progress_is_printed(tmp_path, monkeypatch, capsys):
    # A real build failure: an empty extension cache (everything is built again) and a compiler
    # that does not work. Output is not a terminal here, so every stage gets a line on stderr.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    monkeypatch.setenv("CXX", "/bin/false")
    report = run_smoke(SmokeOptions(engines=("zero3",), nproc=2, device="cpu", steps=2), progress=True)
    (result,) = report.results
    assert report.exit_code == 1 and not result.ok
    assert result.failure.startswith("DeepSpeed op CPUAdamBuilder failed to build: CalledProcessError: ")
    assert "/bin/false" in result.failure and "the ZeRO-3 runs were not started" in result.failure
    assert result.seconds == {}  # no run was started to fail the same way minutes later
    log = result.failure.split("(build output: ")[1].split(")")[0]
    assert Path(log).is_file()
    err = capsys.readouterr().err
    assert "deepspeed ops: building CPUAdamBuilder (or loading it from the cache) ..." in err
    assert "deepspeed ops: FAILED CPUAdamBuilder: CalledProcessError" in err
    assert "ready" not in err and "built " not in err


@pytest.mark.slow
def test_hopper_arch_list_failure_names_the_op_the_deepspeed_function_and_the_fix(tmp_path, monkeypatch):
    """DeepSpeed 0.19.8's JIT builder on a Hopper image (TORCH_CUDA_ARCH_LIST=9.0a), replayed on CPU:
    the accelerator hands out DeepSpeed's real CUDA FusedAdamBuilder, whose compute_capability_args
    raises exactly as on the H100."""
    from shardkit.engines.deepspeed import op_failure_line, prebuild_ops_in_subprocess

    (tmp_path / "sitecustomize.py").write_text(
        "import deepspeed.accelerator.cpu_accelerator as ca\n"
        "original = ca.CPU_Accelerator.create_op_builder\n"
        "def create_op_builder(self, name):\n"
        "    if name == 'FusedAdamBuilder':\n"
        "        from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder\n"
        "        return FusedAdamBuilder()\n"
        "    return original(self, name)\n"
        "ca.CPU_Accelerator.create_op_builder = create_op_builder\n"
    )
    import os

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    events = []
    status, _ = prebuild_ops_in_subprocess(events.append, names=("FusedAdamBuilder",), timeout=300)
    cause = "ValueError: invalid literal for int() with base 10: '0a' (in compute_capability_args)"
    assert status == {"FusedAdamBuilder": f"failed: {cause}"}
    assert [e["stage"] for e in events] == ["building", "failed"]
    line = op_failure_line("FusedAdamBuilder", status["FusedAdamBuilder"])
    assert line == f"DeepSpeed op FusedAdamBuilder failed to build: {cause}; TORCH_CUDA_ARCH_LIST='9.0a' has entries " \
        "DeepSpeed cannot parse: export TORCH_CUDA_ARCH_LIST=9.0 (or unset it: DeepSpeed then builds for the visible GPUs)"


@pytest.mark.parametrize("arch, fix", [
    ("sm_90", "export TORCH_CUDA_ARCH_LIST=9.0 "),  # the old private regex left it as "sm_90", which fails again
    ("8.0;9.0a+PTX", 'export TORCH_CUDA_ARCH_LIST="8.0;9.0+PTX" '),
    ("hopper", "export TORCH_CUDA_ARCH_LIST=<major.minor of your GPU"),
])
def test_op_failure_fix_is_the_one_check_gives(arch, fix):
    """A failed op build and `shardkit check` name the same fix (environment.arch_list.arch_list_fix), and it parses."""
    from shardkit.engines.deepspeed import op_failure_line
    from shardkit.platform.environment.arch_list import arch_list_fix, deepspeed_arch_list_error

    error = deepspeed_arch_list_error(arch)
    line = op_failure_line("FusedAdamBuilder", f"failed: {error} (in compute_capability_args)", {"TORCH_CUDA_ARCH_LIST": arch})
    assert line.endswith(f"has entries DeepSpeed cannot parse: {arch_list_fix(arch)}") and fix in line, line
    exported = fix.split("=", 1)[1].strip().strip('"')
    assert "<" in exported or deepspeed_arch_list_error(exported) is None
    # a build that failed for another reason is not blamed on the variable
    other = op_failure_line("CPUAdamBuilder", "failed: CalledProcessError: ninja", {"TORCH_CUDA_ARCH_LIST": arch})
    assert "TORCH_CUDA_ARCH_LIST" not in other


def test_smoke_refuses_more_ranks_than_visible_gpus(run_cli, monkeypatch):
    import shardkit.run.spawn.plan

    monkeypatch.setattr(shardkit.run.spawn.plan, "visible_gpus", lambda: 1)
    code, out, err = run_cli("smoke", "--engine", "fsdp2", "--nproc", "2", "--quiet")
    assert code == 2
    assert "--world-size 2 asks for 2 ranks but 1 GPU(s) are visible" in err and "or --device cpu to run 2 CPU ranks" in err
    assert "--nproc is now --world-size" in err  # the old spelling works, and says what replaced it


def test_keep_checkpoint_never_replaces_files(tmp_path):
    from shardkit.core.errors import UsageError
    from shardkit.run.smoke.options import SmokeOptions
    from shardkit.run.smoke.runs import run_smoke

    keep = tmp_path / "ckpt"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match=r"--keep-checkpoint .*ckpt.* already exists and is not an empty folder"):
        run_smoke(SmokeOptions(engines=("fsdp2",), nproc=2, device="cpu", keep_checkpoint=str(keep)), progress=False)
    assert (keep / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------- --keep-checkpoint failures, run failure lines


def _fake_checkpoint(base: Path) -> Path:
    ckpt = base / "checkpoint"
    (ckpt / "step2").mkdir(parents=True)
    (ckpt / "step2" / "shard.bin").write_bytes(b"x")
    return ckpt


def test_keep_checkpoint_that_cannot_move_is_one_line_and_leaves_the_checkpoint_where_it_was(tmp_path):
    from shardkit.run.smoke.runs import keep_checkpoint

    ckpt = _fake_checkpoint(tmp_path / "work")
    keep = tmp_path / "kept"
    keep.mkdir()
    (keep / "appeared-during-the-run.txt").write_text("someone else's")  # empty when checked, not now
    line = keep_checkpoint(ckpt, keep)
    assert line is not None and "\n" not in line
    assert line.startswith(f"--keep-checkpoint {keep}: could not move the checkpoint there: ")
    assert "Directory not empty" in line and f"it was left in {ckpt}" in line
    assert (ckpt / "step2" / "shard.bin").read_bytes() == b"x"
    assert (keep / "appeared-during-the-run.txt").read_text() == "someone else's"
    # a parent that is a file (or unwritable, or a full disk): the same one line, nothing moved
    (tmp_path / "file").write_text("")
    line = keep_checkpoint(ckpt, tmp_path / "file" / "kept")
    assert line is not None and f"--keep-checkpoint {tmp_path / 'file' / 'kept'}: could not move" in line
    assert (ckpt / "step2" / "shard.bin").exists()
    # and when it can move, it does
    assert keep_checkpoint(ckpt, tmp_path / "new" / "kept") is None
    assert (tmp_path / "new" / "kept" / "step2" / "shard.bin").read_bytes() == b"x" and not ckpt.exists()


def test_a_keep_failure_is_marked_in_the_result_and_printed_as_a_warning():
    r = EngineResult(engine="fsdp2", ok=True, exact=True, max_abs_diff=0.0, losses_uninterrupted=[[1.0, 0.5]],
                     losses_resumed=[[1.0, 0.5]], preflight="passed",
                     keep_error="--keep-checkpoint /k: could not move the checkpoint there: boom; it was left in /w/checkpoint")
    from shardkit.run.smoke.report import SmokeReport

    buf = io.StringIO()
    print_smoke_report(SmokeReport(results=[r], nproc=2, steps=2), file=buf)
    assert "fsdp2: --keep-checkpoint /k: could not move the checkpoint there: boom; it was left in /w/checkpoint" in buf.getvalue()
    assert r.to_dict()["keep_error"].startswith("--keep-checkpoint /k")


@pytest.mark.parametrize("message, expected", [
    ("  \n ", "ValueError"),  # IndexError before: a whitespace-only message has no first line
    ("", "ValueError"),
    ("\nsecond\nthird", "ValueError: second"),
])
def test_a_failed_runs_line_survives_any_message(tmp_path, message, expected):
    from shardkit.run.smoke.runs import run_failure
    from shardkit.run.spawn.results import RankResult

    killed = RankResult(rank=0, exitcode=None, error="rank 0 was still running 20s after another rank failed")
    raised = RankResult(rank=1, exitcode=1, error="Traceback ...", error_type="ValueError", error_message=message)
    exc = run_failure("C", [killed, raised], tmp_path)
    assert str(exc) == f"run C (resume) failed on rank 1: {expected} (log: {tmp_path / 'rank1.log'})"
    blank = RankResult(rank=0, exitcode=-9, error=" \n")
    assert str(run_failure("A", [blank], tmp_path)).startswith("run A (uninterrupted run) failed on rank 0: exit code -9 ")


@pytest.mark.slow
def test_files_put_in_the_keep_folder_during_the_run_leave_a_passing_smoke_with_one_warning(tmp_path):
    keep = tmp_path / "ckpt"
    work = tmp_path / "work"

    def someone_writes_there(_ckpt: Path) -> None:  # between run B's save and the resume
        keep.mkdir()
        (keep / "theirs.txt").write_text("not ours")

    report = run_smoke(SmokeOptions(engines=("fsdp2",), nproc=2, device="cpu", steps=2, keep_checkpoint=str(keep),
                                    workdir=str(work), after_save=someone_writes_there), progress=False)
    (r,) = report.results
    assert r.ok and report.ok and r.kept_checkpoint is None
    assert r.keep_error.startswith(f"--keep-checkpoint {keep}: could not move the checkpoint there: ")
    assert f"it was left in {work / 'fsdp2' / 'checkpoint'}" in r.keep_error
    assert (work / "fsdp2" / "checkpoint").is_dir() and sorted(p.name for p in keep.iterdir()) == ["theirs.txt"]
    buf = io.StringIO()
    print_smoke_report(report, file=buf)
    assert "could not move the checkpoint there" in buf.getvalue() and "all passed" in buf.getvalue()
