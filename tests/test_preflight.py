"""The collective preflight on real ranks (gloo): the failure cases of the issue on a real 2-rank
ZeRO-3 engine, a missing and a late rank, FSDP2, and the `shardkit preflight` command."""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest

from shardkit.run.spawn.process import run_ranks
from tests import _ranks_preflight as targets

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def zero3(tmp_path_factory):
    """One real 2-rank ZeRO-3 engine, every failure case injected in turn (init runs once).

    Under pytest-xdist the workers share one run through a file lock (xdist's recipe for session
    fixtures), so `pytest -n 2` does not pay for the engine twice.
    """
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    cache, json_path = root / "preflight_zero3.json", root / "preflight_zero3_placement.json"
    with FileLock(str(cache) + ".lock"):
        if not cache.is_file():
            results = run_ranks(targets.zero3_failure_cases, 2, args=(str(json_path),), timeout=300, backend="gloo")
            cache.write_text(json.dumps([r.value for r in results]))
    return json.loads(cache.read_text()), json_path


CASES = ["fp32_partition", "optimizer_state", "param_group", "version_skew", "replaced_head"]


@pytest.mark.parametrize("case", CASES)
def test_every_rank_fails_with_the_same_message(zero3, case):
    r0, r1 = zero3[0]
    assert r0[case]["ok"] is False and r1[case]["ok"] is False
    assert r0[case]["text"] == r1[case]["text"]


def test_clean_engine_passes_and_rank0_writes_the_json_report(zero3):
    (r0, r1), json_path = zero3
    assert r0["clean"]["ok"] and r1["clean"]["ok"] and r0["after_repair"]["ok"]
    data = json.loads(json_path.read_text())
    assert data["ok"] is True and data["world_size"] == 2
    kinds = {rec["kind"] for rank in data["ranks"] for rec in rank["records"]}
    assert {"zero.param_shard", "zero.fp32_partition", "zero.grad_partition", "param"} <= kinds
    assert set(data["bytes_by_device"]) == {"0", "1"}


def test_fp32_partition_on_the_wrong_device_on_rank1_only(zero3):
    text = zero3[0][0]["fp32_partition"]["text"]
    assert re.search(r"zero\.fp32_partition\[0\]\s+meta\s+cpu\s+1\s+[\d,]+", text)
    assert "rank 0" not in text and not re.search(r"fp32_partition\[0\]\s+meta\s+cpu\s+0", text)


def test_optimizer_state_tensor_on_the_wrong_device(zero3):
    r0 = zero3[0][0]
    assert r0["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    assert re.search(r"zero\.optimizer\.state\[0\]\.exp_avg\s+meta\s+cpu\s+0", r0["optimizer_state"]["text"])


def test_param_group_tensor_on_the_wrong_device(zero3):
    text = zero3[0][0]["param_group"]["text"]
    assert re.search(r"zero\.optimizer\.param_groups\[0\]\.d_numerator\s+meta\s+cpu\s+0", text)
    assert "load_state_dict never moves it" in text


def test_version_skew_between_ranks_is_named(zero3):
    text = zero3[0][0]["version_skew"]["text"]
    assert "versions.deepspeed" in text and "0.14.0 on ranks [1]; 0.19.8 on ranks [0]" in text


def test_module_replaced_after_initialize_is_named_and_unmanaged(zero3):
    # A head replaced after the engine was built (analog: the new head's tensors on meta instead of the CPU).
    text = zero3[0][0]["replaced_head"]["text"]
    for rank in (0, 1):
        assert re.search(rf"module\.out_head\.weight\s+meta\s+cpu\s+{rank}\s+896", text)
        assert re.search(rf"module\.out_head\.bias\s+meta\s+cpu\s+{rank}\s+28", text)
    assert "have no ds_id: created after deepspeed.initialize" in text
    assert "module.out_head.bias, module.out_head.weight" in text


def test_zero2_with_optimizer_offload_passes_after_a_step_and_names_a_misplaced_partition():
    r0, r1 = [r.value for r in run_ranks(targets.zero2_offload_cases, 2, timeout=300, backend="gloo")]
    assert r0["clean"]["ok"] and r1["clean"]["ok"], r0["clean"]["text"]
    assert "deepspeed-zero2, 2 rank(s)" in r0["clean"]["text"]
    text = r0["fp32_partition"]["text"]
    assert text == r1["fp32_partition"]["text"]
    assert re.search(r"zero\.fp32_partition\[0\]\s+meta\s+cpu\s+0\s+[\d,]+\s+zero_optimization\.offload_optimizer\.device=cpu", text)


def test_a_rank_that_exits_before_preflight_is_named_within_the_timeout():
    r0, r1 = [r.value for r in run_ranks(targets.rank1_exits_before_preflight, 2, args=(3.0,), timeout=120, backend="gloo")]
    assert r1 == {"exited": True}
    assert r0["ok"] is False
    assert r0["text"].startswith("ranks [1] of 2 did not reach the placement preflight within 3s")
    # the deadline plus the preflight's first imports (torch.distributed.fsdp ...): 10.2 s measured at load 8.6
    # on 2 cores, so 3 + 30 as in test_hostile_env; a hang would be the ranks' 120 s timeout
    assert r0["elapsed"] < 3.0 + 30


def test_a_rank_that_arrives_after_the_others_gave_up_fails_the_same_way():
    r0, r1 = [r.value for r in run_ranks(targets.rank1_arrives_late, 2, args=(2.0,), timeout=120, backend="gloo")]
    assert r0["ok"] is False and r1["ok"] is False
    assert r0["text"] == r1["text"]
    assert "ranks [1] of 2 did not reach the placement preflight within 2s" in r1["text"]


def test_rank0_alone_reads_the_summaries_and_every_round_leaves_no_keys():
    r0, r1 = [r.value for r in run_ranks(targets.store_is_clean_after_rounds, 2, timeout=120, backend="gloo")]
    # every rank holds only its own records; rank 0 alone reads the others' summaries
    assert r0["ranks_held"] == [0] and r1["ranks_held"] == [1]
    assert r0["summaries_held"] == [0, 1] and r1["summaries_held"] == []
    assert r0["failed"]["ok"] is False and r0["failed"]["text"] == r1["failed"]["text"]
    assert re.search(r"out_head\.weight\s+meta\s+cpu\s+1", r1["failed"]["text"])
    assert r0["left"] == [] and r1["left"] == []


def test_a_rank0_that_arrives_after_the_others_gave_up_fails_the_same_way():
    r0, r1 = [r.value for r in run_ranks(targets.rank0_arrives_late, 2, args=(2.0,), timeout=120, backend="gloo")]
    assert r0["ok"] is False and r1["ok"] is False
    assert r0["text"] == r1["text"]
    assert r1["text"].startswith("ranks [0] of 2 did not reach the placement preflight within 2s")
    assert r0["left"] == []


def test_fsdp2_with_cpu_offload_passes_and_a_misplaced_state_shard_is_named():
    r0, r1 = [r.value for r in run_ranks(targets.fsdp2_cases, 2, args=(True,), timeout=180, backend="gloo")]
    assert r0["clean"]["ok"] and r1["clean"]["ok"]
    assert "fsdp2, 2 rank(s)" in r0["clean"]["text"]
    assert r0["state"]["text"] == r1["state"]["text"]
    assert re.search(r"optimizer\.state\[0\]\.exp_avg\s+meta\s+cpu\s+1\s+[\d,]+\s+fsdp\.cpu_offload=true", r0["state"]["text"])


ZERO3_CLI = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "train_batch_size": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                          "stage3_gather_16bit_weights_on_model_save": True},
}


def test_cli_runs_static_checks_ranks_preflight_and_one_step(run_cli, tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(ZERO3_CLI))
    out_json = tmp_path / "placement.json"
    code, out, err = run_cli("preflight", cfg, "--nproc", "2", "--device", "cpu", "--json", out_json)
    assert code == 0, out + err
    assert "placement preflight (deepspeed-zero3, 2 rank(s)" in out and ": ok" in out
    assert "one training step after the preflight: ok" in out
    data = json.loads(out_json.read_text())
    # offload_optimizer=cpu: the fp32 partition's expected device says why
    fp32 = [r for r in data["ranks"][0]["records"] if r["kind"] == "zero.fp32_partition"]
    assert fp32 and fp32[0]["why"] == "zero_optimization.offload_optimizer.device=cpu"


def test_cli_static_stops_before_spawning_and_static_errors_exit_1(run_cli, tmp_path):
    good = tmp_path / "ds.json"
    good.write_text(json.dumps(ZERO3_CLI))
    code, out, _ = run_cli("preflight", good, "--static", "--nproc", "2", "--device", "cpu")
    assert code == 0 and "spawning 2 rank" not in out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**ZERO3_CLI, "train_batch_size": 3}))
    code, out, _ = run_cli("preflight", bad, "--nproc", "2", "--device", "cpu")
    assert code == 1 and "static checks failed" in out and "spawning 2 rank" not in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world-size", "0"], r"--world-size 0: must be at least 1"),
        (["--nproc", "0"], r"--world-size 0: must be at least 1"),
        (["--model", "nodots"], r"--model 'nodots': expected 'pkg.module:factory'"),
        (["--rank-wait", "0"], r"--rank-wait 0.0: must be positive"),
        (["--timeout", "0"], r"--rank-wait 0.0: must be positive"),
    ],
)
def test_cli_usage_errors_exit_2(run_cli, tmp_path, argv, message):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(ZERO3_CLI))
    code, _, err = run_cli("preflight", cfg, "--world-size", "2", "--device", "cpu", *argv) if argv[0] not in ("--nproc", "--world-size") else run_cli("preflight", cfg, *argv)
    assert code == 2 and re.search(message, err), err


def test_cli_missing_config_names_the_file(run_cli, tmp_path):
    code, _, err = run_cli("preflight", tmp_path / "nope.json")
    assert code == 1 and "nope.json: no such file" in err


def test_cli_fsdp2_config_with_a_user_model_factory(run_cli, tmp_path):
    cfg = tmp_path / "fsdp.json"
    cfg.write_text(json.dumps({"fsdp": {"cpu_offload": True, "pin_memory": False, "mixed_precision": "none"}}))
    code, out, err = run_cli("preflight", cfg, "--nproc", "2", "--device", "cpu", "--model", "tests._ranks_preflight:Classifier")
    assert code == 0, out + err
    assert "placement preflight (fsdp2, 2 rank(s)" in out
    # a model without config.vocab_size gets no synthetic causal-LM step, and says so
    assert "no training step: the model has no config.vocab_size" in out


def test_cli_names_each_dead_ranks_exception_and_log_and_writes_a_failure_json(run_cli, tmp_path, monkeypatch):
    import shardkit.run.spawn.plan

    monkeypatch.setattr(shardkit.run.spawn.plan, "usable_cores", lambda: 1)  # 3 ranks on "1 core": warned
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({**ZERO3_CLI, "train_batch_size": 3}))
    out_json = tmp_path / "placement.json"
    code, out, err = run_cli("preflight", cfg, "--nproc", "3", "--device", "cpu", "--model", "tests._ranks_preflight:fails_to_build",
                             "--json", out_json)
    assert code == 1
    assert "warning: --world-size 3 starts 3 CPU ranks on 1 core(s)" in err
    assert "3 of 3 rank(s) failed before the preflight finished:" in err
    data = json.loads(out_json.read_text())
    assert data["ok"] is False and data["world_size"] == 3 and [f["rank"] for f in data["failures"]] == [0, 1, 2]
    for f in data["failures"]:
        line = f"rank {f['rank']}: ValueError: Type fp16 is not supported on your device (rank {f['rank']}) (log: {f['log']})"
        assert line in err  # one line per rank: type, first line of the message, log path
        log = open(f["log"]).read()
        assert "building the model" in log and "Traceback (most recent call last)" in log and "second line of the message" in log
    assert "second line of the message" not in err


def test_cli_refuses_more_ranks_than_visible_gpus_before_spawning(run_cli, tmp_path, monkeypatch):
    import shardkit.run.spawn.plan

    monkeypatch.setattr(shardkit.run.spawn.plan, "visible_gpus", lambda: 1)  # a one-GPU machine
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(ZERO3_CLI))
    code, out, err = run_cli("preflight", cfg, "--nproc", "2")
    assert code == 2 and "spawning" not in out
    assert "--world-size 2 asks for 2 ranks but 1 GPU(s) are visible" in err and "--device cpu" in err


def test_cli_static_checks_at_any_world_size_on_a_one_gpu_machine(run_cli, tmp_path, monkeypatch):
    import shardkit.run.spawn.plan

    monkeypatch.setattr(shardkit.run.spawn.plan, "visible_gpus", lambda: 1)  # --static spawns nothing: no refusal
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(ZERO3_CLI))  # train_batch_size 2 = 1 x 1 x world 2
    code, out, err = run_cli("preflight", cfg, "--static", "--nproc", "2")
    assert code == 0, out + err
    assert "asks for 2 ranks" not in err and "spawning" not in out
    # nproc is still the world size the config is checked at
    code, out, _ = run_cli("preflight", cfg, "--static", "--nproc", "3")
    assert code == 1 and "train_batch_size" in out and "static checks failed" in out
    code, _, err = run_cli("preflight", cfg, "--static", "--nproc", "0")
    assert code == 2 and "--world-size 0: must be at least 1" in err


def _after_preflight_results(json_path):
    from shardkit.run.spawn.results import RankResult

    if json_path:  # what rank 0's preflight wrote before rank 1 died in the step
        Path(json_path).write_text(json.dumps({"ok": True, "world_size": 2, "ranks": [{"rank": 0, "records": []}]}))
    passed = {"rank": 0, "preflight_ok": True, "text": "placement preflight (deepspeed-zero3, 2 rank(s)): ok", "loss": 1.0}
    return [
        RankResult(rank=0, exitcode=0, value=passed),
        RankResult(rank=1, exitcode=1, error="Traceback (most recent call last):\n  ...\nRuntimeError: gloo died\nmore",
                   error_type="RuntimeError", error_message="gloo died\nsecond line"),
    ]


@pytest.mark.parametrize("json_arg", [None, "file", "-"])
def test_ranks_dying_after_the_preflight_get_one_line_each_and_a_failure_json(tmp_path, json_arg):
    from shardkit.core.errors import DistributedError
    from shardkit.run.preflight import PreflightOptions, RankSpec, verdict
    from shardkit.run.spawn.plan import RankPlan

    out_json = {None: None, "file": str(tmp_path / "placement.json"), "-": "-"}[json_arg]
    spec_json = str(tmp_path / "report.json") if json_arg == "-" else out_json
    opts = PreflightOptions(config=str(tmp_path / "ds.json"), nproc=2, device="cpu", json_path=out_json)
    spec = RankSpec({}, "deepspeed", None, 60.0, spec_json, str(tmp_path))
    out = io.StringIO()
    with pytest.raises(DistributedError) as info:
        verdict(opts, RankPlan(2, "cpu"), _after_preflight_results(spec_json), spec, str(tmp_path), out)
    msg = str(info.value)
    assert msg.startswith("1 of 2 rank(s) failed after the preflight:\n")
    assert f"  rank 1: RuntimeError: gloo died (log: {tmp_path / 'rank1.log'})" in msg
    assert "Traceback" not in msg and "second line" not in msg and "more" not in msg
    if json_arg:
        text = Path(out_json).read_text() if json_arg == "file" else out.getvalue().split(": ok\n", 1)[1]
        data = json.loads(text)
        assert data["ok"] is False and data["stage"] == "ranks failed after the preflight"
        assert [f["rank"] for f in data["failures"]] == [1] and data["failures"][0]["error"] == "RuntimeError: gloo died"
        assert data["ranks"] == [{"rank": 0, "records": []}]  # the placement the survivors reported is kept
