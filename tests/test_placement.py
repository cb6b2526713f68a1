"""Per-rank placement rules, in one process (no collective): torch state, step rule, expected
devices from DeepSpeed/FSDP configs, and the cross-rank verdict on hand-made rank reports."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from shardkit.config.loading import config_digest
from shardkit.core.errors import PreflightError
from shardkit.placement import collect_records
from shardkit.placement import records as R
from shardkit.placement.expected import deepspeed_expected, torch_expected
from shardkit.placement.preflight import decode, encode, preflight
from shardkit.placement.records import PlacementRecord, RankReport, devices_match
from shardkit.placement.torch_state import optimizer_records, scaler_records
from shardkit.placement.verdict import judge
from tests._ranks_preflight import Classifier


def _bad(report):
    return {(r.name, r.actual, r.expected) for r in report.records if not r.ok}


def test_device_strings_compare_like_torch_devices():
    assert devices_match("cpu", "cpu")
    assert devices_match("cuda", "cuda:0")
    assert not devices_match("cuda:1", "cuda:0")
    assert not devices_match("meta", "cpu")


def test_replaced_head_is_named_with_its_device_and_the_expected_one():
    # A head replaced after the move, in plain torch: model.to(device), then a new head on another device.
    model = Classifier().to("cpu")
    model.out_head = nn.Linear(32, 7, device="meta")
    assert _bad(collect_records(model=model, rank=0, world_size=1)) == {
        ("out_head.weight", "meta", "cpu"),
        ("out_head.bias", "meta", "cpu"),
    }
    with pytest.raises(PreflightError, match=r"out_head\.weight\s+meta\s+cpu\s+0\s+896"):
        preflight(model=model)


def test_the_table_ends_with_one_fix_per_kind_of_misplaced_tensor():
    model = Classifier().to("cpu")
    model.out_head = nn.Linear(32, 7, device="meta")  # two parameters, one kind: one fix line
    with pytest.raises(PreflightError) as info:
        preflight(model=model)
    text = str(info.value)
    assert text.count("fix (param): move the model to its device before building the optimizer") == 1
    assert "fix (optimizer_state)" not in text


def test_clean_model_and_optimizer_pass_and_count_bytes():
    model = Classifier()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    report = preflight(model=model, optimizer=opt)
    assert report.ok
    n_params = sum(p.numel() for p in model.parameters())
    # params + grads + exp_avg + exp_avg_sq, 4 bytes each, plus one 4-byte `step` per parameter
    assert report.bytes_by_device()[0]["cpu"] == 4 * 4 * n_params + 4 * len(list(model.parameters()))


def _stepped_adam(**kw):
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), **kw)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


def test_step_stays_on_cpu_for_the_default_optimizer_even_when_params_are_on_an_accelerator():
    model, opt = _stepped_adam()
    devs = {id(p): "cuda:1" for p in model.parameters()}
    recs = optimizer_records(opt, 0, devs, "cuda:1")
    steps = [r for r in recs if r.kind == R.OPTIMIZER_STEP]
    assert steps and all(r.expected == "cpu" and r.ok for r in steps)
    # exp_avg/exp_avg_sq do follow the parameter (here: they are on cpu, expected cuda:1)
    assert {r.expected for r in recs if r.kind == R.OPTIMIZER_STATE} == {"cuda:1"}


@pytest.mark.parametrize("flag", ["fused", "capturable"])
def test_step_must_be_on_the_param_device_for_fused_and_capturable_groups(flag):
    # Fused/capturable flags restored from a checkpoint make torch read `step` on the device.
    model, opt = _stepped_adam()
    opt.param_groups[0][flag] = True
    devs = {id(p): "cuda:1" for p in model.parameters()}
    bad = [r for r in optimizer_records(opt, 0, devs, "cuda:1") if r.kind == R.OPTIMIZER_STEP]
    assert bad and all(r.expected == "cuda:1" and r.actual == "cpu" and not r.ok for r in bad)
    assert all(r.name.startswith("optimizer.state[") and r.name.endswith("].step") for r in bad)


def test_custom_param_group_tensors_are_checked_but_a_cpu_tensor_lr_is_fine():
    # Prodigy-style running_d_* tensors that load_state_dict never moves.
    model, opt = _stepped_adam(lr=torch.tensor(1e-3))
    opt.param_groups[0]["running_d_numerator"] = torch.zeros((), device="meta")
    bad = [r for r in optimizer_records(opt, 0, {}, "cpu") if not r.ok]
    assert [(r.name, r.actual, r.expected) for r in bad] == [("optimizer.param_groups[0].running_d_numerator", "meta", "cpu")]


def test_nested_param_group_and_state_tensors_keep_their_dots_and_brackets():
    model, opt = _stepped_adam()
    opt.param_groups[0]["running_d"] = {"num": torch.zeros((), device="meta"), "hist": [torch.zeros((), device="meta")]}
    opt.state[next(iter(opt.state))]["extra"] = {"den": torch.zeros(2, device="meta")}
    bad = sorted(r.name for r in optimizer_records(opt, 0, {}, "cpu") if not r.ok)
    assert bad == [
        "optimizer.param_groups[0].running_d.hist[0]",
        "optimizer.param_groups[0].running_d.num",
        "optimizer.state[0].extra.den",
    ]


def test_grad_scaler_tensors_follow_the_compute_device():
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(1))
    assert all(r.ok for r in scaler_records(scaler, 0, "cpu"))
    scaler._scale = scaler._scale.to("meta")
    assert [r.name for r in scaler_records(scaler, 0, "cpu") if not r.ok] == ["scaler.scale"]


@pytest.mark.parametrize(
    "zero, param_shard, optimizer",
    [
        ({"stage": 3}, "cuda:1", "cuda:1"),
        ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, "cuda:1", "cpu"),
        ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}, "offload_optimizer": {"device": "nvme"}}, "cpu", "cpu"),
        # stage 1/2 ignore offload_param; "auto" is dropped by DeepSpeed, i.e. no offload
        ({"stage": 2, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "auto"}}, "cuda:1", "cuda:1"),
        ({"stage": 1, "offload_optimizer": {"device": "nvme"}}, "cuda:1", "cpu"),
    ],
)
def test_expected_devices_come_from_the_config_and_the_accelerator(zero, param_shard, optimizer):
    exp = deepspeed_expected({"zero_optimization": zero}, "cuda:1")
    assert (exp.compute, exp.param_shard, exp.optimizer) == ("cuda:1", param_shard, optimizer)


@pytest.mark.parametrize(
    "zero, param_shard, optimizer, optimizer_why",
    [
        # JSON/YAML often give 3.0: DeepSpeed takes it as stage 3, and so does `shardkit check`
        ({"stage": 3.0, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}, "cpu", "cpu",
         "zero_optimization.offload_optimizer.device=cpu"),
        # the deprecated booleans DeepSpeed maps to cpu offload blocks
        ({"stage": 3, "cpu_offload": True, "cpu_offload_param": True}, "cpu", "cpu", "zero_optimization.cpu_offload=true"),
        ({"stage": 2, "cpu_offload": True}, "cuda:1", "cpu", "zero_optimization.cpu_offload=true"),
    ],
)
def test_expected_devices_read_the_config_like_the_static_checks(zero, param_shard, optimizer, optimizer_why):
    from shardkit.config.view import deepspeed_view

    cfg = {"zero_optimization": zero}
    exp = deepspeed_expected(cfg, "cuda:1")
    assert (exp.param_shard, exp.optimizer, exp.optimizer_why) == (param_shard, optimizer, optimizer_why)
    view = deepspeed_view(cfg)  # the checks' reading of the same config agrees
    assert (exp.optimizer == "cpu") == view.offload_optimizer.active
    assert (exp.param_shard == "cpu") == (view.offload_param.active and view.stage == 3)


@pytest.mark.parametrize(
    "a, b", [("cpu", "cpu:0"), ("cuda", "cuda:0"), ("cuda:1", "cuda:0"), ("meta", "cpu"), ("xpu:1", "xpu:1"), ("cpu", "meta")]
)
def test_record_device_matching_is_device_rules_same_device(a, b):
    from shardkit.platform.device_rules import same_device

    assert devices_match(a, b) == same_device(torch.device(a), torch.device(b))
    assert devices_match("nvme", "nvme") and not devices_match("nvme", "cpu")


def test_partial_offload_ratio_splits_fp32_subgroups_like_deepspeed():
    exp = deepspeed_expected({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}, "cuda:0")
    # stage3.py: sub-group i goes to cpu when i >= int((1 - ratio) * count)
    assert [exp.fp32_subgroup(i, 10)[0] for i in range(10)] == ["cuda:0"] * 7 + ["cpu"] * 3


def _rank(rank, **kw):
    base = dict(rank=rank, world_size=2, host="node0", compute_device="cpu", engine="deepspeed-zero3",
                versions={"torch": "2.13.0", "deepspeed": "0.19.8"}, config_digest="abc")
    base.update(kw)
    return RankReport(**base)


def test_verdict_names_version_skew_config_skew_and_shared_accelerators():
    rep = judge([
        _rank(0, compute_device="cuda:0", versions={"torch": "2.13.0", "deepspeed": "0.19.8"}),
        _rank(1, compute_device="cuda:0", versions={"torch": "2.13.0", "deepspeed": "0.14.0"}, config_digest="def"),
    ])
    rules = {f.rule: f for f in rep.findings}
    assert set(rules) == {"placement.version_skew", "placement.config_skew", "placement.shared_accelerator"}
    assert "0.14.0 on ranks [1]; 0.19.8 on ranks [0]" in rules["placement.version_skew"].message
    assert "ranks [0, 1] all compute on cuda:0 on node0" in rules["placement.shared_accelerator"].message
    # CPU ranks share a host by design; ranks on different hosts may use the same index
    assert judge([_rank(0), _rank(1)]).ok
    assert judge([_rank(0, compute_device="cuda:0"), _rank(1, compute_device="cuda:0", host="node1")]).ok


def test_verdict_checks_the_parameter_set_and_zero3_coverage():
    numels = {"w": 11, "b": 3}
    good = judge([_rank(r, param_numels=numels, zero3_partitions={"w": 6, "b": 2}) for r in (0, 1)])
    assert good.ok
    short = judge([_rank(0, param_numels=numels, zero3_partitions={"w": 6, "b": 2}),
                   _rank(1, param_numels=numels, zero3_partitions={"w": 4, "b": 2})])
    (f,) = short.findings
    assert f.rule == "placement.zero3_coverage" and "w partition numel per rank {0: 6, 1: 4}" in f.message
    lacking = judge([_rank(0, param_numels=numels), _rank(1, param_numels={"w": 11})])
    assert [f.message for f in lacking.findings] == ["rank 1 lacks 1 parameter(s) other ranks have: b."]


def test_when_every_rank_differs_rank0_reads_few_maps_and_still_names_every_rank():
    # 20 ranks, ranks 1-19 each missing a different parameter: 20 digest groups. Rank 0 reads the maps
    # of the 16 largest (never world x parameters), names what those lack, and names the rest by rank.
    numels = {f"p{i}": 4 for i in range(20)}
    reports = [_rank(0, world_size=20, param_numels=numels)]
    reports += [_rank(r, world_size=20, param_numels={k: v for k, v in numels.items() if k != f"p{r}"})
                for r in range(1, 20)]
    rep = judge(reports)
    lacks = [f for f in rep.findings if "lacks 1 parameter(s)" in f.message]
    assert [f.key for f in lacks] == [f"rank {r}: parameters" for r in range(1, 16)]
    (rest,) = [f for f in rep.findings if f.key == "parameter_set_digest"]
    assert "20 different parameter sets" in rest.message and "ranks [16, 17, 18, 19]" in rest.message
    assert "Build the same model on every rank" in rest.fix


def test_report_round_trips_through_the_store_encoding_and_counts_shared_storage_once():
    recs = [
        PlacementRecord(0, "zero.fp32_partition[0]", R.ZERO_FP32_PARTITION, "cpu", "cpu", 400, 100, "", "cpu@1", 400),
        PlacementRecord(0, "module.w.ds_tensor", R.ZERO_PARAM_SHARD, "cpu", "cpu", 40, 10, "", "cpu@2", 400),
        PlacementRecord(0, "module.b.ds_tensor", R.ZERO_PARAM_SHARD, "cpu", "cpu", 40, 10, "", "cpu@2", 400),
    ]
    rep = _rank(0, records=recs)
    assert decode(encode(rep)) == rep
    assert judge([rep]).bytes_by_device() == {0: {"cpu": 800}}


def test_digest_ignores_key_order():
    assert config_digest({"a": 1, "b": {"c": 2}}) == config_digest({"b": {"c": 2}, "a": 1}) != config_digest({"a": 2})
    assert torch_expected("cpu").optimizer == "cpu"


@pytest.mark.gpu
def test_replaced_head_on_a_gpu_is_found_on_the_cpu():
    # The real case of a replaced head: the new head is created on the default device (cpu).
    model = Classifier().to("cuda:0")
    model.out_head = nn.Linear(32, 7)
    assert _bad(collect_records(model=model, rank=0, world_size=1)) == {
        ("out_head.weight", "cpu", "cuda:0"),
        ("out_head.bias", "cpu", "cuda:0"),
    }


@pytest.mark.gpu
def test_fused_adam_step_moved_to_cpu_is_found_on_a_gpu():
    # State loaded with map_location='cpu' into a fused optimizer.
    model = nn.Linear(3, 2).to("cuda:0")
    opt = torch.optim.Adam(model.parameters(), fused=True)
    model(torch.ones(1, 3, device="cuda:0")).sum().backward()
    opt.step()
    for state in opt.state.values():
        state["step"] = state["step"].cpu()
    bad = _bad(collect_records(model=model, optimizer=opt, rank=0, world_size=1))
    assert bad == {("optimizer.state[0].step", "cpu", "cuda:0"), ("optimizer.state[1].step", "cpu", "cuda:0")}


def test_preflight_cli_flags_are_frozen(run_cli):
    code, out, _ = run_cli("preflight", "--help")
    assert code == 0
    flags = set(re.findall(r"(--[a-z][a-z-]*)", out.split("options:", 1)[1]))
    # --nproc and --timeout: the old spellings of --world-size and --rank-wait, kept so no script breaks
    assert flags == {"--help", "--world-size", "--nproc", "--device", "--model", "--static", "--json", "--json-file",
                     "--rank-wait", "--timeout", "--observed", "--config", "--record"}
    assert "example:\n  shardkit preflight ds_config.json --world-size 2" in out


def test_public_names_are_lazy_exports():
    import shardkit
    import shardkit.placement

    assert shardkit.preflight is preflight
    assert shardkit.collect_records is collect_records is shardkit.placement.collect_records
