"""ZeRO-3 partial optimizer offload (``offload_optimizer: {device: cpu, ratio: R}``), judged as DeepSpeed
0.19.8 places it on a GPU: the first ``int((1 - R) * n)`` of the n fp32 sub-groups (and their Adam
state) stay on the accelerator, the rest go to the CPU, and the CPU optimizer numbers its ``state``
from its own first sub-group. The snapshots in tests/data/partial_offload/ are built by the script
beside them from the H100 recording z3_offopt.json; here each is judged healthy, any tensor moved to
the other side is named (name, device seen, device expected, why, fix), and the layout the script
assumes is checked against a real DeepSpeed engine on CPU. Plus the config rules of ``shardkit check``."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from shardkit.checks.runner import check_config
from shardkit.placement.expected import deepspeed_expected
from shardkit.placement.observed import judge_snapshot
from shardkit.platform.device_rules import zero3_first_cpu_subgroup, zero3_offload_ratio

DATA = Path(__file__).parent / "data" / "partial_offload"
SNAPSHOTS = sorted(p.name for p in DATA.glob("*.json"))
RATIO_KEY = "zero_optimization.offload_optimizer.ratio"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("partial_offload_generate", DATA / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load(name: str) -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


def _one_phase(snap: dict[str, Any], phase: str) -> dict[str, Any]:
    """The snapshot with only ``phase`` (judging one phase is half the work of judging both)."""
    return {k: v for k, v in snap.items() if not isinstance(v, list) or k == phase}


# --- the rule -------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio,count,first", [
    (1.0, 12, 0),     # the default: every sub-group on the CPU
    (0.0, 12, 12),    # none on the CPU
    (0.3, 12, 8),     # int(0.7 * 12) = int(8.399...) = 8
    (0.5, 10, 5),
    (0.3, 1, 0),      # one sub-group: any ratio above 0 offloads everything
    (0.0, 1, 1),
    (0.9, 10, 0),     # (1 - 0.9) * 10 = 0.999...: DeepSpeed keeps none on the accelerator, not one
    (0.99, 99, 0),
    (0.99, 100, 1),   # 0.01 * 100 = 1.0000000000000009
    (0.7, 10, 3),     # (1 - 0.7) * 10 = 3.0000000000000004
])
def test_first_cpu_subgroup_is_deepspeeds_expression_with_its_rounding(ratio, count, first):
    assert zero3_first_cpu_subgroup(ratio, count) == first


@pytest.mark.slow
def test_every_ratio_and_subgroup_count_splits_as_deepspeeds_own_loop():
    """ExpectedDevices against stage3.py:1104-1108 as the generator restates it, for ratios 0.00-1.00
    in steps of 0.01 and 1-64 sub-groups (the world size enters only through the sub-group count)."""
    deepspeed_loop = _generator().subgroup_devices
    for step in range(101):
        ratio = step / 100
        exp = deepspeed_expected({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": ratio}}}, "cuda:3")
        for count in range(1, 65):
            devices = deepspeed_loop(count, ratio, "cuda:3")
            assert [exp.fp32_subgroup(i, count)[0] for i in range(count)] == devices, (ratio, count)
            assert [exp.inner_state(k, count)[0] for k in range(devices.count("cpu"))] == ["cpu"] * devices.count("cpu")


@pytest.mark.parametrize("raw,ratio", [
    (0.3, 0.3), (0, 0.0), (1, 1.0), ("0.5", 0.5), (True, 1.0),          # pydantic's lax float, as DeepSpeed reads it
    (1.5, None), (-0.1, None), ("half", None), (None, None), (float("nan"), None),
])
def test_ratio_is_read_as_deepspeed_reads_it(raw, ratio):
    assert zero3_offload_ratio(raw) == ratio


def test_state_k_of_the_cpu_optimizer_is_the_kth_cpu_subgroup_not_subgroup_k():
    exp = deepspeed_expected({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}, "cuda:0")
    assert [exp.fp32_subgroup(i, 12)[0] for i in range(12)] == ["cuda:0"] * 8 + ["cpu"] * 4
    # the H100 false alarm: state[0..3] read as sub-groups 0-3 would be expected on cuda:0
    assert [exp.inner_state(k, 12)[0] for k in range(4)] == ["cpu"] * 4
    assert "state[2] is sub-group 10" in exp.inner_state(2, 12)[1]
    assert "sub-groups 0-7 on the accelerator and 8-11 on cpu" in exp.inner_state(2, 12)[1]


@pytest.mark.parametrize("zero", [
    {"stage": 3, "offload_optimizer": {"device": "none", "ratio": 0.3}},   # DeepSpeed ignores it: no offload
    {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.0}},
    {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 7}},      # refused by DeepSpeed: never an engine
    {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 1.0}},
])
def test_no_split_where_deepspeed_does_not_split(zero):
    exp = deepspeed_expected({"zero_optimization": zero}, "cuda:0")
    devices = {exp.fp32_subgroup(i, 12)[0] for i in range(12)} | {exp.inner_state(k, 12)[0] for k in range(12)}
    assert len(devices) == 1


# --- the snapshots --------------------------------------------------------------------------------


def test_snapshots_on_disk_are_exactly_what_the_generator_writes():
    built = _generator().build_all()
    assert sorted(built) == SNAPSHOTS
    for name, snap in built.items():
        assert (DATA / name).read_text() == _generator().render(snap), f"{name}: rerun tests/data/partial_offload/generate.py"


def test_snapshots_cover_every_ratio_world_size_and_subgroup_count():
    snaps = [_load(n) for n in SNAPSHOTS]
    ratios = {s["spec"]["config"]["zero_optimization"]["offload_optimizer"]["ratio"] for s in snaps}
    assert {0.0, 0.3, 0.5, 0.99, 1.0} <= ratios
    assert {s["world_size"] for s in snaps} == {1, 2, 4, 8}
    assert {s["sub_groups"] for s in snaps} == {1, 10, 12, 16}
    # both sides are exercised: some sub-groups on each, all on one, all on the other
    splits = {(s["first_cpu_sub_group"] > 0, s["first_cpu_sub_group"] < s["sub_groups"]) for s in snaps}
    assert splits == {(True, True), (True, False), (False, True)}


@pytest.mark.parametrize("name", SNAPSHOTS)
def test_each_snapshot_is_judged_healthy_with_every_tensor_checked(name):
    snap = _load(name)
    report = judge_snapshot(snap)
    assert report.ok, report.render()
    assert report.not_checked == []
    devices = sum(1 + ("ds_tensor" in e) for ph in ("after_init", "after_step") for e in snap[ph])
    assert report.checked == devices
    assert report.compute == f"cuda:{snap['rank']}"


def test_the_layout_is_the_one_described():
    snap = _load("z3_ratio0.3_ws1_sg1e5.json")
    fp32 = {e["name"]: e["device"] for e in snap["after_step"] if e["name"].startswith("opt.fp32_partitioned")}
    assert [fp32[f"opt.fp32_partitioned_groups_flat[{i}]"] for i in range(12)] == ["cuda:0"] * 8 + ["cpu"] * 4
    states = [e for e in snap["after_step"] if e["name"].startswith("state[")]
    assert [e["name"] for e in states][::2] == [f"state[{k}].exp_avg" for k in range(4)]
    assert {e["device"] for e in states} == {"cpu"}
    assert not [e for e in snap["after_init"] if e["name"].startswith("state[")]  # DeepSpeedCPUAdam is lazy
    # ratio 0: DeepSpeedCPUAdam steps nothing, so it holds no state at all
    assert not [e for e in _load("z3_ratio0_ws2_sg1e5.json")["after_step"] if e["name"].startswith("state[")]


def _other_side(device: str, compute: str) -> str:
    return compute if device == "cpu" else "cpu"


def _assert_move_is_named(snap: dict[str, Any], phase: str, entry: dict[str, Any], field: str) -> None:
    compute = snap["compute_device"]
    original = entry[field]
    moved = _other_side(original, compute)
    entry[field] = moved
    try:
        report = judge_snapshot(_one_phase(snap, phase))
    finally:
        entry[field] = original
    bad = report.phases[phase].mismatches
    assert not report.ok and len(bad) == 1, (phase, entry["name"], field, moved)
    rec = bad[0]
    short = entry["name"].split(" ", 1)[-1] + (".ds_tensor" if field == "ds_tensor" else "")
    assert rec.name == short and rec.actual == moved and rec.expected == original and rec.why
    text = report.render()
    assert short in text and rec.why in text and f"fix ({rec.kind}):" in text


@pytest.mark.parametrize("name", SNAPSHOTS)
def test_an_fp32_partition_or_adam_moment_moved_to_the_other_side_is_named(name):
    snap = _load(name)
    moved = 0
    for phase in ("after_init", "after_step"):
        for entry in snap[phase]:
            if entry["name"].startswith(("opt.fp32_partitioned_groups_flat[", "state[")):
                _assert_move_is_named(snap, phase, entry, "device")
                moved += 1
    assert moved >= 2 * snap["sub_groups"]


def test_any_tensor_of_a_split_run_moved_to_the_other_side_is_named():
    snap = _load("z3_ratio0.5_ws2_sg1e5.json")  # rank 1 of 2: cuda:1, sub-groups 0-4 there, 5-9 on cpu
    moved = 0
    for phase in ("after_init", "after_step"):
        for entry in snap[phase]:
            for field in ("device", "ds_tensor"):
                if field in entry:
                    _assert_move_is_named(snap, phase, entry, field)
                    moved += 1
    assert moved == judge_snapshot(snap).checked


def test_cli_names_a_moved_adam_moment_with_devices_why_and_fix(run_cli, tmp_path):
    snap = _load("z3_ratio0.3_ws1_sg1e5.json")
    entry = next(e for e in snap["after_step"] if e["name"] == "state[1].exp_avg")
    entry["device"] = "cuda:0"  # the CPU optimizer's second sub-group (9) left on the GPU
    path = tmp_path / "moved.json"
    path.write_text(json.dumps(snap))
    code, out, _ = run_cli("preflight", "--observed", path, "--json", tmp_path / "verdict.json")
    assert code == 1
    verdict = json.loads((tmp_path / "verdict.json").read_text())["phases"]["after_step"]
    (bad,) = verdict["mismatches"]
    assert (bad["name"], bad["actual"], bad["expected"]) == ("state[1].exp_avg", "cuda:0", "cpu")
    assert "state[1] is sub-group 9" in bad["why"]
    assert verdict["fixes"]["optimizer_state"].startswith("DeepSpeed places these from the config")
    row = next(line for line in out.splitlines() if line.strip().startswith("state[1].exp_avg"))
    assert row.split()[1:3] == ["cuda:0", "cpu"]
    assert "state[1] is sub-group 9" in row and "ratio=0.3 over 12 sub-group(s)" in row
    assert "fix (optimizer_state): DeepSpeed places these from the config" in out


def test_a_config_without_the_ratio_names_the_accelerator_side(run_cli, tmp_path):
    snap = _load("z3_ratio0.5_ws1_sg1e5.json")
    cfg = copy.deepcopy(snap["spec"]["config"])
    del cfg["zero_optimization"]["offload_optimizer"]["ratio"]  # judged as full offload
    report = judge_snapshot(snap, cfg, "full_offload.json")
    names = {r.name for r in report.phases["after_step"].mismatches}
    assert names == {f"opt.fp32_partitioned_groups_flat[{i}]" for i in range(6)}
    assert "offload_optimizer.device=cpu" in report.render()


# --- the live preflight: the accelerator side's AdamW -----------------------------------------------


def test_live_preflight_checks_the_accelerator_side_adamw_state():
    import torch

    from shardkit.placement.deepspeed import _backup_state_records

    exp = deepspeed_expected({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, "cuda:0")
    part = torch.zeros(4, requires_grad=True)
    backup = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    backup.state[part] = {"exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4), "step": torch.tensor(1.0)}
    recs = _backup_state_records(SimpleNamespace(backup_optimizer=backup), 0, {id(part): "cuda:0"}, {id(part): "3"}, exp)
    by_name = {r.name: r for r in recs}
    assert set(by_name) == {f"zero.backup_optimizer.state[3].{k}" for k in ("exp_avg", "exp_avg_sq", "step")}
    moment = by_name["zero.backup_optimizer.state[3].exp_avg"]
    assert (moment.actual, moment.expected) == ("cpu", "cuda:0") and "ratio=0.5" in moment.why
    assert by_name["zero.backup_optimizer.state[3].step"].ok  # torch's AdamW keeps step on the CPU
    assert _backup_state_records(SimpleNamespace(), 0, {}, {}, exp) == []  # ratio 1.0: no backup optimizer


# --- the layout against real DeepSpeed (CPU) --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_the_generator_layout_is_deepspeeds_on_cpu(world_size):
    """On DeepSpeed's CPU accelerator every sub-group is 'cpu' (get_accelerator()._name), so ratio 0.5
    runs like 1.0 plus an unused torch AdamW: the CPU optimizer steps every sub-group, in order. The
    names, numels and dtypes of that run are the generator's ratio-1.0 snapshot of the same layout."""
    from shardkit.run.spawn.process import run_ranks
    from tests import _ranks_partial_offload as targets

    cfg = _load(f"z3_ratio0.5_ws{world_size}_sg1e5.json")["spec"]["config"]
    results = run_ranks(targets.record_layout, world_size, args=(cfg,), timeout=400, device="cpu")
    live = results[-1].value
    expected = _load(f"z3_ratio1_ws{world_size}_sg1e5.json")
    keep = ("name", "dtype", "numel", "ds_numel", "ds_persist", "ds_status")
    for phase in ("after_init", "after_step"):
        assert live[phase] == [[e.get(k) for k in keep] for e in expected[phase]], phase
    n = expected["sub_groups"]
    assert live["subgroup_to_device"] == ["cpu"] * n
    assert live["inner"] == "DeepSpeedCPUAdam" and live["inner_state_subgroups"] == list(range(n))
    assert live["backup"] == "AdamW" and live["backup_state_subgroups"] == []
    assert live["saved_state_entries"] == n  # only the CPU optimizer's state is in a checkpoint
    assert live["live_misplaced"] == [] and len(live["live_fp32"]) == n


# --- shardkit check -------------------------------------------------------------------------------


def _cfg(stage: int, offload: dict[str, Any] | None, optimizer: dict[str, Any] | None = None, **zero: Any) -> dict[str, Any]:
    z: dict[str, Any] = {"stage": stage, **zero}
    if offload is not None:
        z["offload_optimizer"] = {"pin_memory": True, **offload}
    if stage == 3:
        z["stage3_gather_16bit_weights_on_model_save"] = True
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                           "bf16": {"enabled": True}, "zero_optimization": z}
    cfg["optimizer"] = optimizer if optimizer is not None else {"type": "AdamW", "params": {"lr": 1e-3}}
    if optimizer == {}:
        del cfg["optimizer"]
    return cfg


def _ratio_findings(cfg: dict[str, Any]) -> list[Any]:
    return [f for f in check_config(cfg).findings if f.rule.startswith("offload-ratio")]


@pytest.mark.parametrize("cfg,severity,key,value,message,fix", [
    (_cfg(3, {"device": "cpu", "ratio": 1.5}), "error", RATIO_KEY, 1.5,
     r"refuses the config: ratio must be a number from 0 to 1 \(deepspeed/runtime/zero/offload_config.py:99", r"1\.0 \(the default\)"),
    (_cfg(3, {"device": "cpu", "ratio": "half"}), "error", RATIO_KEY, "half", r"'half' is not", r"ratio"),
    (_cfg(2, {"device": "cpu", "ratio": 0.5}), "error", RATIO_KEY, 0.5,
     r"at stage 2 DeepSpeed refuses the whole config with 'Partial offloading only supported for ZeRO Stage 3\.'",
     r'remove "ratio" \(1\.0 is the default\), or set "zero_optimization\.stage": 3'),
    (_cfg(1, {"device": "none", "ratio": 0.5}), "error", RATIO_KEY, 0.5, r"whatever offload_optimizer\.device is", r"stage"),
    (_cfg(3, {"device": "none", "ratio": 0.3}), "warning", RATIO_KEY, 0.3,
     r"ratio has no effect: offload_optimizer\.device is 'none'.*stays on the accelerator", r'set "device": "cpu"'),
    (_cfg(3, {"device": "cpu", "ratio": 0.5}, {"type": "Lion", "params": {"lr": 1e-4}}), "error", RATIO_KEY, 0.5,
     r"optimizer\.type is 'Lion', so DeepSpeed stops at initialize with AssertionError 'Hybrid Optimizer Only Supports "
     r"DeepSpeedCPUAdam'", r'"type": "AdamW"'),
    (_cfg(3, {"device": "cpu", "ratio": 0.5}, {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}), "error",
     "optimizer.params.torch_adam", True, r"torch\.optim\.AdamW .*AssertionError", r'remove "torch_adam"'),
    (_cfg(3, {"device": "cpu", "ratio": 0.5}, zenflow={"topk_ratio": 0.1}), "error", "zero_optimization.zenflow", "set",
     r"ZenFlowCPUAdam .*exact type check", r'remove "ratio"'),
    (_cfg(3, {"device": "nvme", "nvme_path": "/nvme", "ratio": 0.5}), "warning", RATIO_KEY, 0.5,
     r"ratio with device nvme: .*swapped to NVMe whichever side it is on", r'use "device": "cpu" for partial offload'),
    (_cfg(3, {"device": "cpu", "ratio": 0.0}), "warning", RATIO_KEY, 0.0,
     r"ratio 0 offloads nothing: .*saves none of that Adam state", r"remove offload_optimizer"),
])
def test_check_names_each_ratio_problem(cfg, severity, key, value, message, fix):
    found = [f for f in _ratio_findings(cfg) if f.key == key and f.severity.value == severity and f.value == value]
    assert found, [(f.key, f.severity.value, f.value, f.message) for f in check_config(cfg).findings]
    assert any(re.search(message, f.message) and re.search(fix, f.fix) for f in found), found


def test_check_explains_what_an_accepted_ratio_does():
    (split,) = [f for f in _ratio_findings(_cfg(3, {"device": "cpu", "ratio": 0.99}, sub_group_size=100_000))
                if f.rule == "offload-ratio-split"]
    assert "one per 100,000 elements" in split.message
    assert "Below 100 sub-groups none stays on the accelerator" in split.message  # DeepSpeed's rounding
    assert "on resume the accelerator sub-groups' Adam moments restart from zero" in split.message
    assert "at least 100 sub-groups" in split.fix
    assert "Below 2 sub-groups" in _ratio_findings(_cfg(3, {"device": "cpu", "ratio": 0.3}))[0].message


@pytest.mark.parametrize("cfg", [
    _cfg(3, {"device": "cpu", "ratio": 1.0}),
    _cfg(2, {"device": "cpu", "ratio": 1.0}),   # the default, written out: no effect, nothing to say
    _cfg(3, {"device": "cpu"}),
    _cfg(3, None),
    _cfg(3, {"device": "cpu", "ratio": "auto"}),   # dropped by DeepSpeed; the "auto" rule names it
])
def test_no_ratio_findings_without_a_partial_ratio(cfg):
    assert _ratio_findings(cfg) == []


def test_deepspeed_schema_refusal_is_replaced_by_the_specific_message():
    findings = check_config(_cfg(2, {"device": "none", "ratio": 0.5})).findings
    assert [f.rule for f in findings] == ["offload-ratio"]  # DeepSpeed's own "Partial offloading ..." folded in
    assert check_config(_cfg(3, {"device": "cpu", "ratio": -0.1})).exit_code == 1


def test_cli_check_of_a_partial_offload_config(run_cli, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_cfg(3, {"device": "cpu", "ratio": 0.3}, sub_group_size=100_000)))
    code, out, _ = run_cli("check", path, "--json")
    assert code == 0
    rules = {f["rule"] for f in json.loads(out)["findings"]}
    assert "offload-ratio-split" in rules
