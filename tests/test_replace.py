"""replace_optimizer_state with real optimizers: state left behind when the model moves after a load
(case 1), the fused/capturable rule for `step` (case 3), tensors kept in param_groups (case 4).

On a CPU-only machine the `meta` device plays the accelerator: a tensor left on the CPU is as
visible there as on a GPU. Modules are moved with swap_module_params_on_conversion so parameters
keep their identity (as `.to('cuda')` does), which is what the optimizer's state is keyed by. The
fused/capturable rule for `step` is checked against `cuda:1` targets through the planner, which
allocates nothing.
"""

import pytest
import torch

from shardkit.placement.replace import (
    Move,
    StateSlot,
    plan_optimizer_moves,
    register_extra_state,
    replace_optimizer_state,
    summarize_moves,
)

CUDA1 = torch.device("cuda:1")


@pytest.fixture
def swap_params():
    """module.to() swaps tensors in place (parameter objects survive a move to/from meta)."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _train(model, opt, steps=2):
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        model(torch.randn(5, 4, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _trained_state(opt_cls, **kw):
    m = _model()
    o = opt_cls(m.parameters(), **kw)
    _train(m, o)
    return o.state_dict()


def _meta_grads(model):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


@pytest.mark.parametrize("kw", [{}, {"foreach": False}], ids=["foreach", "for-loop"])
def test_case1_state_left_behind_when_model_moves_after_load(swap_params, kw):
    sd = _trained_state(torch.optim.AdamW, **kw)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), **kw)
    opt.load_state_dict(sd)
    model.to("meta")  # the resumed run moves the model to the accelerator *after* loading
    _meta_grads(model)
    with pytest.raises(RuntimeError, match="is not on the expected device"):
        opt.step()  # the failure users see on the first resumed step

    moves = replace_optimizer_state(opt, model=model)
    assert {m.name for m in moves} == {f"state[{n}].{k}" for n, _ in model.named_parameters() for k in ("exp_avg", "exp_avg_sq")}
    assert all((m.from_device, m.to_device) == ("cpu", "meta") for m in moves)
    assert sum(m.bytes for m in moves) == 2 * 4 * sum(p.numel() for p in model.parameters())
    for p in model.parameters():
        st = opt.state[p]
        assert st["exp_avg"].device.type == "meta" and st["exp_avg_sq"].device.type == "meta"
        assert st["step"].device.type == "cpu"  # foreach/for-loop: torch keeps step on the host
    opt.step()  # now it runs
    assert replace_optimizer_state(opt) == []  # idempotent


def test_case3_fused_step_goes_to_the_parameter_device(swap_params):
    sd = _trained_state(torch.optim.AdamW, fused=True)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    opt.load_state_dict(sd)
    model.to("meta")
    moves = replace_optimizer_state(opt, model=model)
    steps = [m for m in moves if m.name.endswith(".step")]
    assert len(steps) == 4 and all(m.to_device == "meta" and m.bytes == 4 for m in steps)
    for p in model.parameters():
        assert {k: v.device.type for k, v in opt.state[p].items()} == {"step": "meta", "exp_avg": "meta", "exp_avg_sq": "meta"}
        assert opt.state[p]["step"].dtype == torch.float32


def test_case3_fused_checkpoint_into_foreach_optimizer_brings_step_home(swap_params):
    # the checkpoint's flags win in load_state_dict: a fused run's step lands on the device ...
    model = _model().to("meta")
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    opt.load_state_dict(_trained_state(torch.optim.AdamW, fused=True))
    assert opt.state[model[0].weight]["step"].device.type == "meta"
    # ... then the user switches the group to the default path: step belongs on the CPU again
    for g in opt.param_groups:
        g["fused"] = False
    moves = plan_optimizer_moves(opt)  # (meta cannot be copied back to the host: plan only)
    assert [m.to_device for m in moves] == ["cpu"] * 4 and all(m.name.endswith(".step") for m in moves)


@pytest.mark.parametrize(
    "kw, step_to",
    [({}, None), ({"foreach": False}, None), ({"fused": True}, "cuda:1"), ({"capturable": True}, "cuda:1")],
    ids=["foreach", "for-loop", "fused", "capturable"],
)
def test_step_rule_for_cuda1_targets_without_allocating(kw, step_to):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), **kw)
    opt.load_state_dict(_trained_state(torch.optim.AdamW))  # every group now has a CPU step
    for g in opt.param_groups:  # the run's own flags (as with keep_constructor)
        g.update({"fused": kw.get("fused", False), "capturable": kw.get("capturable", False)})
    moves = plan_optimizer_moves(opt, device_for=lambda p: CUDA1, model=model)
    by_key = {}
    for m in moves:
        by_key.setdefault(m.name.rsplit(".", 1)[1], set()).add(m.to_device)
    assert by_key["exp_avg"] == by_key["exp_avg_sq"] == {"cuda:1"}
    assert by_key.get("step") == ({step_to} if step_to else None)
    assert all(v.device.type == "cpu" for st in opt.state.values() for v in st.values())  # planning moved nothing


def test_tensor_lr_in_param_groups_follows_the_step_rule():
    p = torch.nn.Parameter(torch.randn(3))
    fused = torch.optim.AdamW([p], lr=torch.tensor(1e-3), fused=True)
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))], lr=torch.tensor(1e-3), foreach=False)
    assert [(m.name, m.to_device) for m in plan_optimizer_moves(fused, device_for=lambda _: CUDA1)] == [
        ("param_groups[0].lr", "cuda:1")]
    assert plan_optimizer_moves(plain, device_for=lambda _: CUDA1) == []


def test_case4_prodigy_tensors_in_param_groups_are_moved(swap_params):
    """The real prodigy-plus-schedule-free (2.0.1) keeps running_d_numerator/_denom in param_groups."""
    prodigyplus = pytest.importorskip("prodigyplus")
    sd = _trained_state(prodigyplus.ProdigyPlusScheduleFree)
    assert isinstance(sd["param_groups"][0]["running_d_numerator"], torch.Tensor)
    model = _model().to("meta")  # model already on the device, as Accelerate prepares it
    opt = prodigyplus.ProdigyPlusScheduleFree(model.parameters())
    opt.load_state_dict(sd)
    # torch moved per-parameter state but copied param_group entries verbatim
    assert opt.state[model[0].weight]["z"].device.type == "meta"
    assert opt.param_groups[0]["running_d_numerator"].device.type == "cpu"

    moves = replace_optimizer_state(opt)
    assert sorted(m.name for m in moves) == ["param_groups[0].running_d_denom", "param_groups[0].running_d_numerator"]
    assert all(m.to_device == "meta" and m.bytes == 4 for m in moves)
    assert opt.param_groups[0]["running_d_numerator"].device.type == "meta"
    assert replace_optimizer_state(opt) == []


class _GlobalStateOpt(torch.optim.SGD):
    """Keeps a tensor outside state and param_groups: only a registration can tell shardkit."""

    def __init__(self, params):
        super().__init__(params, lr=0.1)
        self.global_state = {"ema": torch.zeros(2)}


def test_registered_and_per_call_extra_state(swap_params):
    model = _model().to("meta")
    opt = _GlobalStateOpt(model.parameters())
    opt.extra_buf = [torch.ones(3)]

    @register_extra_state(_GlobalStateOpt)
    def _slots(o):
        yield StateSlot("global_state.ema", o.global_state, "ema", o.param_groups[0]["params"][0].device)

    moves = replace_optimizer_state(
        opt, extra_state=lambda o: [StateSlot("extra_buf", o.__dict__, "extra_buf", torch.device("meta"))])
    assert [(m.name, m.to_device) for m in moves] == [("global_state.ema", "meta"), ("extra_buf[0]", "meta")]
    assert opt.global_state["ema"].device.type == "meta" and opt.extra_buf[0].device.type == "meta"


def test_values_dtypes_and_containers_survive():
    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), foreach=False, betas=(torch.tensor(0.9), torch.tensor(0.99)))
    model(torch.randn(1, 2, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    st = opt.state[model.weight]
    st["counter"] = torch.tensor([3], dtype=torch.int64)
    st["history"] = [torch.ones(2, dtype=torch.float64)]
    before = {k: v for k, v in st.items()}
    assert replace_optimizer_state(opt) == []  # everything already in place: same objects kept
    assert all(st[k] is before[k] for k in before)

    moves = replace_optimizer_state(opt, device_for=lambda p: torch.device("meta"))
    assert st["exp_avg"].dtype == torch.bfloat16 and st["counter"].dtype == torch.int64
    assert st["history"][0].dtype == torch.float64 and st["history"][0].device.type == "meta"
    assert st["step"].device.type == "cpu" and st["step"].dtype == before["step"].dtype
    betas = opt.param_groups[0]["betas"]
    assert isinstance(betas, tuple) and all(b.device.type == "cpu" for b in betas)  # hyperparameters: step rule
    assert "state[0].history[0]" in {m.name for m in moves}
    assert isinstance(moves[0], Move)
    assert summarize_moves(moves).startswith(f"re-placed optimizer state: {len(moves)} tensor(s)")
    assert summarize_moves([]) == "optimizer state already in place: nothing moved"


@pytest.mark.gpu
def test_gpu_resume_after_cpu_load_runs_fused_and_foreach():
    for kw in ({"fused": True}, {}):
        sd = _trained_state(torch.optim.AdamW, **kw)
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), **kw)
        opt.load_state_dict(sd)
        model.cuda()
        replace_optimizer_state(opt)
        model(torch.randn(5, 4, device="cuda")).sum().backward()
        opt.step()
        st = opt.state[model[0].weight]
        assert st["exp_avg"].is_cuda and st["step"].is_cuda == bool(kw.get("fused"))
