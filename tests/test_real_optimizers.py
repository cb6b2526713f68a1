"""The real custom optimizers whose tensors torch's resume path forgets: prodigyopt's ``Prodigy``
(1.1.2) and prodigy-plus-schedule-free's ``ProdigyPlusScheduleFree`` (2.0.1).

Where they keep their tensors (read from their sources):
- Prodigy: per parameter ``s``, ``p0``, ``exp_avg``, ``exp_avg_sq`` and an int ``step``; its
  param_groups hold only numbers (``d``, ``d_numerator`` ...), except with ``fsdp_in_use=True``,
  which makes ``d_numerator`` a CUDA tensor (``.cuda()`` is hard-coded: GPU only).
- ProdigyPlusScheduleFree: ``running_d_numerator`` / ``running_d_denom`` tensors in param_groups
  (every group with ``split_groups``, only the first without), created on the first parameter's
  device and moved there again by the optimizer on its next step; per parameter ``z`` (the
  schedule-free iterate), ``exp_avg_sq`` (or its factored ``_row``/``_col``) and ``p0``/``s`` kept
  in **bfloat16** beside float32 parameters; ``train()``/``eval()`` move the weights between the
  two schedule-free points and record the mode in ``param_groups[i]['train_mode']``.

Single-process tests use ``meta`` as the accelerator (as tests/test_replace.py does). The ZeRO-3
tests run both as DeepSpeed client optimizers on 2 gloo ranks, the FSDP2 tests on DTensor shards
(tests/_ranks_real_optimizers.py): each rank gets its own D statistics back (at the saved world
size; at another, a warning names what cannot be mapped).
"""

from __future__ import annotations

import re

import pytest
import torch

import shardkit
from shardkit.checkpoint.ops.torch_training import resume_training, save_training
from shardkit.core.errors import CheckpointError, PreflightError
from shardkit.placement.replace import plan_optimizer_moves

prodigyopt = pytest.importorskip("prodigyopt")
prodigyplus = pytest.importorskip("prodigyplus")

OPTIMIZERS = ["prodigy", "plus"]


# d0 for each: D adapts within the 40 steps of these tests (measured), so its statistics shape the curve
D0 = {"prodigy": 1e-5, "plus": 1e-3}


def _make(name: str, model: torch.nn.Module, **kw):
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}]
    if name == "prodigy":
        return prodigyopt.Prodigy(groups, lr=1.0, d0=D0[name], **kw)
    return prodigyplus.ProdigyPlusScheduleFree(groups, lr=1.0, d0=D0[name], **kw)


def _model(device: str = "cpu") -> torch.nn.Sequential:
    torch.manual_seed(0)
    # 64x64: big enough that ProdigyPlusScheduleFree factors its second moment (dims >= 32)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device)


def _steps(model, opt, start: int, stop: int) -> list[float]:
    losses = []
    for s in range(start, stop):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 1, generator=g)
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture
def swap_params():
    """module.to() swaps tensors in place (parameter objects survive a move to/from meta)."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.mark.parametrize("name, kw, group_tensors", [
    ("prodigy", {}, []),
    ("plus", {}, ["param_groups[0].running_d_denom", "param_groups[0].running_d_numerator",
                  "param_groups[1].running_d_denom", "param_groups[1].running_d_numerator"]),
    ("plus", {"split_groups": False}, ["param_groups[0].running_d_denom", "param_groups[0].running_d_numerator"]),
], ids=["prodigy", "plus-split-groups", "plus-one-d"])
def test_every_tensor_each_optimizer_keeps_is_planned_for_the_device(name, kw, group_tensors):
    model = _model()
    opt = _make(name, model, **kw)
    _steps(model, opt, 0, 2)
    moves = plan_optimizer_moves(opt, device_for=lambda p: torch.device("cuda:1"), model=model)
    assert sorted(m.name for m in moves if m.name.startswith("param_groups")) == group_tensors
    state = {m.name.split(".", 1)[1].split(".", 1)[1] for m in moves if m.name.startswith("state")}
    expected = {"s", "p0", "exp_avg", "exp_avg_sq"} if name == "prodigy" else {
        "z", "p0", "s", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq"}
    assert state == expected and all(m.to_device == "cuda:1" for m in moves)
    assert all(m.bytes == 4 for m in moves if m.name.startswith("param_groups"))  # 0-d float32


@pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter")
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_resume_onto_the_accelerator_places_every_tensor_and_keeps_dtypes(tmp_path, swap_params, name):
    model = _model()
    opt = _make(name, model)
    _steps(model, opt, 0, 3)
    save_training(tmp_path, model=model, optimizer=opt, step=3)

    model2 = _model("meta")  # the model already on its accelerator, as Accelerate prepares it
    opt2 = _make(name, model2)
    res = resume_training(tmp_path, model=model2, optimizer=opt2)
    # torch moves per-parameter state at load; only the param_group tensors were left on the CPU
    moved = sorted(m.name for m in res.moves)
    if name == "prodigy":
        assert moved == [] and not any(torch.is_tensor(v) for g in opt2.param_groups for v in g.values())
    else:
        assert moved == ["param_groups[0].running_d_denom", "param_groups[0].running_d_numerator",
                         "param_groups[1].running_d_denom", "param_groups[1].running_d_numerator"]
        assert res.notes[-1].startswith("re-placed optimizer state: 4 tensor(s), 0.00 MiB cpu -> meta")
    tensors = [v for st in opt2.state.values() for v in st.values() if torch.is_tensor(v)]
    tensors += [v for g in opt2.param_groups for v in g.values() if torch.is_tensor(v)]
    assert tensors and all(t.device.type == "meta" for t in tensors)
    saved = {k: v.dtype for k, v in opt.state[model[0].weight].items() if torch.is_tensor(v)}
    assert {k: v.dtype for k, v in opt2.state[model2[0].weight].items() if torch.is_tensor(v)} == saved
    if name == "plus":
        assert saved["p0"] == saved["s"] == torch.bfloat16


@pytest.mark.parametrize("name, eval_at_save", [("prodigy", False), ("plus", False), ("plus", True)],
                         ids=["prodigy", "plus", "plus-saved-in-eval-mode"])
def test_resumed_loss_curve_equals_the_uninterrupted_one_bit_for_bit(tmp_path, name, eval_at_save):
    model = _model()
    opt = _make(name, model)
    _steps(model, opt, 0, 10)
    if eval_at_save:
        opt.eval()  # schedule-free: evaluation weights in the model while it is saved
    save_training(tmp_path, model=model, optimizer=opt, step=10)
    if eval_at_save:
        opt.train()
    d_at_save = opt.param_groups[0]["d"]
    reference = _steps(model, opt, 10, 40)
    assert opt.param_groups[0]["d"] > d_at_save  # D kept adapting: its statistics shape the curve

    model2 = _model()
    opt2 = _make(name, model2)
    res = resume_training(tmp_path, model=model2, optimizer=opt2)
    if eval_at_save:
        assert opt2.param_groups[0]["train_mode"] is False  # the mode came back with the weights
        opt2.train()
    assert _steps(model2, opt2, 10, 40) == reference
    if name == "plus":
        assert [n for n in res.notes if "load_state_dict cast it to float32" in n] == [
            f"optimizer state '{k}' (4 tensor(s)): torch's Optimizer.load_state_dict cast it to float32 (its "
            f"parameter's dtype); restored to bfloat16, the dtype the optimizer saved it in, so the run continues "
            "as it would have" for k in ("p0", "s")]
    else:
        assert res.notes == []


def test_torch_load_state_dict_alone_widens_prodigy_plus_state_and_the_curve_drifts():
    """Why resume_training restores dtypes: torch's own load of the same state drifts."""
    import copy

    model = _model()
    opt = _make("plus", model)
    _steps(model, opt, 0, 10)
    model_sd, opt_sd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    reference = _steps(model, opt, 10, 40)
    model2 = _model()
    model2.load_state_dict(model_sd)
    opt2 = _make("plus", model2)
    opt2.load_state_dict(opt_sd)
    assert opt2.state[model2[0].weight]["p0"].dtype == torch.float32  # torch's cast to the parameter dtype
    assert _steps(model2, opt2, 10, 40) != reference


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_preflight_passes_a_healthy_run_and_names_a_misplaced_optimizer_tensor(name):
    model = _model()
    opt = _make(name, model)
    _steps(model, opt, 0, 2)
    report = shardkit.preflight(model=model, optimizer=opt)
    kinds = {r.kind for rank in report.ranks for r in rank.records}
    assert report.ok and ("param_group" in kinds) == (name == "plus")

    if name == "plus":
        slot, key = opt.param_groups[1], "running_d_numerator"
        shown = r"optimizer\.param_groups\[1\]\.running_d_numerator\s+meta\s+cpu\s+0\s+4\s+param_group tensor"
    else:
        slot, key = opt.state[model[2].weight], "p0"
        shown = r"optimizer\.state\[2\]\.p0\s+meta\s+cpu\s+0\s+256\s+optimizer state follows its parameter"
    slot[key] = torch.empty_like(slot[key], device="meta")
    with pytest.raises(PreflightError, match=shown) as info:
        shardkit.preflight(model=model, optimizer=opt)
    assert "1 problem(s)" in str(info.value)


# ---- as DeepSpeed ZeRO-3 client optimizers (2 gloo ranks) ------------------------------------------


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    from shardkit.run.spawn.process import run_ranks
    from tests import _ranks_real_optimizers as targets

    root = tmp_path_factory.mktemp("client_optimizers")
    return [r.value for r in run_ranks(targets.both, 2, args=(str(root),), timeout=420, backend="gloo")]


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_zero3_refuses_them_until_the_config_allows_untested_optimizers(zero3, name):
    for rank in zero3:
        assert '"zero_allow_untested_optimizer": true' in rank[name]["refused"]
        assert rank[name]["inner"] == ("Prodigy" if name == "prodigy" else "ProdigyPlusScheduleFree")


@pytest.mark.slow
@pytest.mark.parametrize("name, shown", [
    ("prodigy", r"zero\.optimizer\.state\[0\]\.p0\s+meta\s+cpu\s+1\s"),
    ("plus", r"zero\.optimizer\.param_groups\[0\]\.running_d_numerator\s+meta\s+cpu\s+1\s+4\s"),
])
def test_zero3_preflight_passes_and_names_a_misplaced_optimizer_tensor(zero3, name, shown):
    r0, r1 = (rank[name] for rank in zero3)
    assert r0["clean"]["ok"] and r1["clean"]["ok"]
    assert r0["misplaced"]["ok"] is False and r0["misplaced"]["text"] == r1["misplaced"]["text"]
    assert re.search(shown, r0["misplaced"]["text"]) and "1 problem(s)" in r0["misplaced"]["text"]
    if name == "plus":  # the fix a user can apply: DeepSpeed does not place a client optimizer's group tensors
        assert "under DeepSpeed ZeRO-3 pass it engine.optimizer" in r0["misplaced"]["text"]


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_zero3_d_statistics_are_per_rank_and_deepspeeds_own_load_keeps_each_ranks(zero3, name):
    r0, r1 = (rank[name] for rank in zero3)
    assert r0["saved"]["d_numerator"] != r1["saved"]["d_numerator"]  # computed from each rank's partition
    for r in (r0, r1):
        loaded, saved = r["plain"]["loaded"], r["saved"]
        assert {k: loaded[k] for k in ("d", "d_numerator", "d_denom", "k", "running_d")} == {
            k: saved[k] for k in ("d", "d_numerator", "d_denom", "k", "running_d")}
        assert r["plain"]["losses"] == r["reference"][-3:]
    if name == "prodigy":
        assert r0["plain"]["loaded"]["state_sha"] == r0["saved"]["state_sha"]
    else:
        # torch's load_state_dict inside DeepSpeed's load widens p0/s to float32, and DeepSpeed's
        # loader has no shardkit step to narrow them back (resume_training does, see above)
        assert r0["saved"]["dtypes"]["p0"] == "bfloat16" and r0["plain"]["loaded"]["dtypes"]["p0"] == "float32"


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_zero3_replace_optimizer_state_takes_the_engine_optimizer_and_reaches_param_group_tensors(zero3, name):
    # ZeRO-3 empties the inner optimizer's params between steps: the partitions stand in for them
    plans = zero3[0][name]["plain"]["replace"]
    assert plans["here"] == []  # after DeepSpeed's load on CPU ranks: everything in place
    keys = {"s", "p0", "exp_avg", "exp_avg_sq"} if name == "prodigy" else {"z", "p0", "s", "exp_avg_sq"}
    expected = {("state", k, "cuda:0") for k in keys}
    if name == "plus":
        expected |= {("param_groups", "running_d_numerator", "cuda:0"), ("param_groups", "running_d_denom", "cuda:0")}
    assert {tuple(t) for t in plans["to_gpu"]} == expected


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_zero3_shardkit_loader_keeps_each_ranks_d_statistics(zero3, name):
    # at the saved world size every rank reads its own optim file: its own D statistics, and the
    # continuation is DeepSpeed's own load's, loss for loss
    keys = ("d", "d_numerator", "d_denom", "k", "running_d")
    for rank in zero3:
        loaded, saved = rank[name]["shardkit"]["loaded"], rank[name]["saved"]
        assert {k: loaded[k] for k in keys} == {k: saved[k] for k in keys}
        assert rank[name]["shardkit"]["losses"] == rank[name]["plain"]["losses"] == rank[name]["reference"][-3:]
        assert not [n for n in rank[name]["shardkit"]["notes"] if "per-rank" in n]
    if name == "prodigy":
        assert zero3[1][name]["shardkit"]["loaded"]["state_sha"] == zero3[1][name]["saved"]["state_sha"]


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_zero3_shardkit_loader_replaces_optimizer_tensors_before_its_preflight(zero3, name):
    # a client optimizer's param_group tensors stay where torch.load put them (the CPU): re-placed
    # first, so the preflight never blocks a healthy GPU run over them; nothing to move on CPU ranks
    for rank in zero3:
        run = rank[name]["shardkit"]
        assert run["order"] == ["replace_optimizer_state", "preflight"] and run["placement_checked"]
        assert run["moves"] == []


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_zero3_at_another_world_size_names_the_per_rank_values_it_cannot_keep(zero3, name):
    """Rank values a 2-rank save cannot hand to 1 rank: numbers are taken from rank 0 with a warning
    naming each key and both ranks' values; partition-sized state (prodigy-plus's sliced p0/s) is refused."""
    from shardkit.checkpoint.ops.resume_zero3_state import optim_state_for_rank
    from shardkit.checkpoint.readers.zero3 import read_zero3
    from shardkit.checkpoint.readers.zero3_open import open_zero3_layout
    from shardkit.checkpoint.readers.zero3_rank_values import PerRankValuesWarning, check_rank_values
    from shardkit.checkpoint.zero3.repartition import plan_layout
    from shardkit.core.errors import CheckpointError

    ckpt = open_zero3_layout(zero3[0][name]["root"])
    assert check_rank_values(ckpt, 2) is None  # the saved world size: each rank reads its own file
    saved = [rank[name]["saved"]["d_numerator"] for rank in zero3]
    with pytest.warns(PerRankValuesWarning) as caught:
        note = check_rank_values(ckpt, 1)
    assert len(caught) == 1 and str(caught[0].message) == note
    assert f"param_groups[0].d_numerator (rank 0: {saved[0]!r}, rank 1: {saved[1]!r})" in note
    assert "every rank resumes with rank 0's value" in note and "resume at world size 2" in note
    assert "param_groups[0].lr" not in note and ".step" not in note  # the same on both ranks: kept silently
    model = read_zero3(ckpt.tag_dir)
    if name == "prodigy":  # its per-parameter state is all partition-shaped: rebuilt for the new partition
        osd = optim_state_for_rank(ckpt, model, plan_layout(ckpt, 1), 0)["optimizer_state_dict"]
        assert osd["optimizer_state_dict"]["param_groups"][0]["d_numerator"] == saved[0]
    else:
        with pytest.raises(CheckpointError, match=r"optimizer state 'p0' of sub-group 0 is a tensor of shape \(\d+,\), "
                           r"neither a scalar nor the partition's \d+ elements.*Resume at world size 2"):
            optim_state_for_rank(ckpt, model, plan_layout(ckpt, 1), 0)


# ---- on FSDP2 shards (2 gloo ranks, DCP through save/load_fsdp_checkpoint) ------------------------


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    from shardkit.run.spawn.process import run_ranks
    from tests import _ranks_real_optimizers as targets

    root = tmp_path_factory.mktemp("fsdp2_client_optimizers")
    return [r.value for r in run_ranks(targets.fsdp2_all, 2, args=(str(root),), timeout=420, backend="gloo")]


@pytest.mark.slow
def test_fsdp2_prodigy_resumes_through_dcp_with_the_same_loss_curve(fsdp2):
    for rank in fsdp2:
        run = rank["prodigy"]
        assert run["resumed"] == run["reference"][-3:]
        # DCP loads only the param_group keys a fresh optimizer has: Prodigy's d_denom/d_hat appear at
        # its first step and are dropped; harmless, as each step writes them before reading
        assert run["dropped_keys"] == ["d_denom", "d_hat"]
    assert fsdp2[0]["prodigy"]["saved"]["d_numerator"] != fsdp2[1]["prodigy"]["saved"]["d_numerator"]  # per rank


@pytest.mark.slow
def test_fsdp2_prodigy_plus_schedule_free_cannot_step_on_dtensor_shards(fsdp2):
    # prodigy-plus-schedule-free 2.0.1 is not FSDP2-ready: its first step fails, factored or not
    for rank in fsdp2:
        assert rank["plus"]["where"] == "update_second_moment" and "aten.pow_.Scalar" in rank["plus"]["error"]
        assert rank["plus_unfactored"]["where"] == "update_prodigy"


@pytest.mark.slow
def test_fsdp2_prodigy_keeps_each_ranks_d_statistics(fsdp2):
    # DCP saves each param_group entry once; shardkit keeps the entries the ranks disagree on per
    # rank in the manifest and hands each rank its own back (the keys the fresh optimizer has)
    for rank in fsdp2:
        run = rank["prodigy"]
        assert {k: run["loaded"][k] for k in ("d", "d_numerator", "k")} == {
            k: run["saved"][k] for k in ("d", "d_numerator", "k")}
        assert run["save_warnings"] == []  # numbers: nothing lost, nothing to warn about
    # which statistics differ depends on the steps taken (d can still agree early); d_numerator is a
    # sum over each rank's own elements, so it always differs; hyperparameters never do
    kept = set(fsdp2[0]["prodigy"]["per_rank_keys"])
    assert "0.d_numerator" in kept and kept <= {"0.d", "0.d_denom", "0.d_hat", "0.d_numerator"}, kept


@pytest.mark.slow
def test_fsdp2_save_names_param_group_values_that_differ_between_ranks_and_cannot_be_kept(fsdp2):
    warned = fsdp2[0]["lost"]["save_warnings"]
    assert len(warned) == 1 and "param_groups[0].note" in warned[0] and "param_groups[0].lr" not in warned[0]
    assert "every rank but one loses its value" in warned[0] and "register_extra_state" in warned[0]
    assert fsdp2[1]["lost"]["save_warnings"] == []  # said once, by rank 0


def test_fsdp2_per_rank_values_at_another_world_size_are_named_and_dcps_value_kept(monkeypatch):
    from shardkit.checkpoint.ops import fsdp_checkpoint as fc

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    opt.param_groups[0]["d_numerator"] = 0.5
    saved = {"0.d_numerator": {"kind": "float", "dtype": None, "values": [(0.25).hex(), (0.75).hex()]}}
    monkeypatch.setattr(fc, "rank_world", lambda: (1, 2))
    fc.restore_per_rank_param_group_values(opt, saved, saved_world_size=2, where="ckpt/step6")
    assert opt.param_groups[0]["d_numerator"] == 0.75  # the saved world size: this rank's own

    monkeypatch.setattr(fc, "rank_world", lambda: (0, 1))
    with pytest.warns(fc.PerRankParamGroupWarning, match=r"ckpt/step6: the 2 saved ranks kept different values of "
                      r"param_groups\[0\]\.d_numerator \(rank 0: 0\.25, rank 1: 0\.75\); loading at world size 1, "
                      r"every rank resumes with the one DCP saved.*Resume at world size 2"):
        fc.restore_per_rank_param_group_values(opt, saved, saved_world_size=2, where="ckpt/step6")
    assert opt.param_groups[0]["d_numerator"] == 0.75  # left as loaded

    tampered = {"0.d_numerator": {"kind": "float", "dtype": "save", "values": ["0x1p-2", "0x1p-1"]}}
    with pytest.raises(CheckpointError,
                       match=r"manifest extra\.per_rank_param_groups\['0\.d_numerator'\] is .*not what shardkit writes"):
        fc.restore_per_rank_param_group_values(opt, tampered, saved_world_size=2, where="ckpt/step6")


def test_zero3_ranks_differing_in_a_non_number_are_refused_at_another_world_size(monkeypatch):
    """A schedule-free optimizer's ``train_mode`` flag that differs between the saved ranks says they
    were in different states: one rank's value would be wrong for the others' elements, so a load at
    another world size is refused, naming the entry, each rank's value and the world size to use."""
    from types import SimpleNamespace

    from shardkit.checkpoint.readers import zero3_rank_values as rank_values

    ckpt = SimpleNamespace(world_size=2, tag_dir="ckpt/global_step6")
    monkeypatch.setattr(rank_values, "rank_local_values", lambda _: [
        {"param_groups[0].lr": 1.0, "param_groups[0].train_mode": True},
        {"param_groups[0].lr": 1.0, "param_groups[0].train_mode": False}])
    with pytest.raises(CheckpointError, match=r"ckpt/global_step6: the 2 saved ranks hold different optimizer values "
                       r"that are not numbers: param_groups\[0\]\.train_mode \(rank 0: True, rank 1: False\)\. At world "
                       r"size 3 every rank would take rank 0's.*Resume at the saved world size 2"):
        rank_values.check_rank_values(ckpt, 3)
    assert rank_values.check_rank_values(ckpt, 2) is None  # the saved world size: each rank reads its own file
