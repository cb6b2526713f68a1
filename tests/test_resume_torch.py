"""save_training / resume_training for plain torch loops: exact continuation, the checkpoint's
fused/lr silently overriding the constructor's, GradScaler restored, clear
errors for damaged or unsafe files."""

import os
import random

import pytest
import torch

from shardkit.checkpoint.ops.torch_training import ResumeOverrideWarning, resume_training, save_training
from shardkit.core.errors import CheckpointError
from shardkit.placement.replace import replace_optimizer_state
from shardkit.storage.manifest import seal


def _build(fused=True, lr=1e-2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=fused)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    return model, opt, sched, scaler


def _steps(model, opt, sched, scaler, n):
    losses = []
    for _ in range(n):
        x = torch.randn(4, 8)  # drawn from the global RNG: a resumed run must draw the same
        noise = random.random()
        loss = (model(x).squeeze(-1) - noise).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def test_resume_continues_bit_exactly_with_scaler_scheduler_and_rng(tmp_path):
    model, opt, sched, scaler = _build()
    _steps(model, opt, sched, scaler, 3)
    save_training(tmp_path, model=model, optimizer=opt, scaler=scaler, lr_scheduler=sched, step=3,
                  extra={"epoch": 1}, config={"lr": 1e-2})
    expected = _steps(model, opt, sched, scaler, 4)
    scale_at_save = scaler.get_scale()

    torch.manual_seed(123)
    random.seed(123)  # the resumed process starts with other RNG streams
    model2, opt2, sched2, scaler2 = _build()
    res = resume_training(tmp_path, model=model2, optimizer=opt2, scaler=scaler2, lr_scheduler=sched2)
    assert res.step == 3 and res.extra == {"epoch": 1} and res.tag_dir == str(tmp_path / "step3")
    assert res.moves == [] and res.notes == []  # same flags, same device: nothing to say
    assert sched2.last_epoch == 3
    assert _steps(model2, opt2, sched2, scaler2, 4) == expected
    assert scaler2.get_scale() == scale_at_save
    assert (tmp_path / "latest").read_text() == "step3"
    assert sorted(os.listdir(tmp_path / "step3")) == [
        "extra.pt", "lr_scheduler.pt", "model.pt", "optimizer.pt", "rng_state_0.pt", "scaler.pt",
        "shardkit_manifest.json"]


def test_checkpoint_flags_override_constructor_and_are_reported(tmp_path):
    model, opt, sched, scaler = _build(fused=False, lr=1e-2)
    _steps(model, opt, sched, scaler, 1)
    save_training(tmp_path, model=model, optimizer=opt, lr_scheduler=sched, step=1)

    model2, opt2, sched2, _ = _build(fused=True, lr=5e-3)
    with pytest.warns(ResumeOverrideWarning) as rec:
        res = resume_training(tmp_path, model=model2, optimizer=opt2, lr_scheduler=sched2)
    msgs = [str(w.message) for w in rec]
    assert any("param_groups[0].fused: the checkpoint's False replaced the constructor's True" in m for m in msgs)
    assert any("param_groups[0].initial_lr: the checkpoint's 0.01 replaced the constructor's 0.005" in m for m in msgs)
    assert opt2.param_groups[0]["fused"] is False and res.notes[:2] == msgs[:2]

    model3, opt3, sched3, _ = _build(fused=True, lr=5e-3)
    res = resume_training(tmp_path, model=model3, optimizer=opt3, lr_scheduler=sched3,
                          keep_constructor=("fused", "lr"))
    assert opt3.param_groups[0]["fused"] is True and opt3.param_groups[0]["initial_lr"] == 5e-3
    assert any("kept the constructor's True" in n for n in res.notes)


@pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter")
def test_resume_onto_device_model_places_everything(tmp_path):
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        prodigyplus = pytest.importorskip("prodigyplus")
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        opt = prodigyplus.ProdigyPlusScheduleFree(model.parameters())
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        save_training(tmp_path, model=model, optimizer=opt, step=1)

        model2 = torch.nn.Linear(4, 4).to("meta")  # the "accelerator"
        opt2 = prodigyplus.ProdigyPlusScheduleFree(model2.parameters())
        res = resume_training(tmp_path, model=model2, optimizer=opt2)
        assert sorted(m.name for m in res.moves) == ["param_groups[0].running_d_denom",
                                                     "param_groups[0].running_d_numerator"]
        assert res.notes[-1].startswith("re-placed optimizer state: 2 tensor(s)")
        tensors = [v for st in opt2.state.values() for v in st.values() if torch.is_tensor(v)]
        tensors += [opt2.param_groups[0]["running_d_numerator"], opt2.param_groups[0]["running_d_denom"]]
        assert all(t.device.type == "meta" for t in tensors)

        # case 1 after a resume: the model moved later; one call fixes it
        model3 = torch.nn.Linear(4, 4)
        opt3 = torch.optim.AdamW(model3.parameters())
        model3(torch.randn(2, 4)).sum().backward()
        opt3.step()
        model3.to("meta")
        assert len(replace_optimizer_state(opt3)) == 4
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def test_damaged_unsafe_or_mismatched_checkpoints_are_refused_clearly(tmp_path):
    model, opt, sched, scaler = _build()
    _steps(model, opt, sched, scaler, 1)
    save_training(tmp_path, model=model, optimizer=opt, step=1)
    with pytest.raises(CheckpointError, match=r"scaler\.pt: the checkpoint has no scaler \(GradScaler\) state"):
        resume_training(tmp_path, model=_build()[0], optimizer=_build()[1], scaler=_build()[3])
    f = tmp_path / "step1" / "optimizer.pt"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"\[optimizer\.pt\] .*optimizer\.pt: 100 bytes on disk.*truncated"):
        resume_training(tmp_path, model=_build()[0], optimizer=_build()[1])

    # a checkpoint carrying a pickle that would run code: refused, the code never runs
    evil = tmp_path / "evil" / "step1"
    evil.mkdir(parents=True)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"weight": Payload()}, evil / "model.pt")
    seal(evil, engine="torch", step=1)
    with pytest.raises(CheckpointError, match=r"model\.pt: refused to load: the pickle references global "
                       r"'posix\.system'.*nothing from the file was run"):
        resume_training(evil, model=torch.nn.Linear(8, 16))
    assert not marker.exists()

    with pytest.raises(CheckpointError, match=r"\[engine\] checkpoint was written by engine 'torch'"):
        from shardkit.storage.verify import check_resumable

        check_resumable(evil, engine="deepspeed")


@pytest.mark.slow
def test_ddp_ranks_save_and_resume_their_own_rng(tmp_path):
    """Accelerate-style DDP loop on 2 gloo ranks: each rank saves and restores its own RNG (dropout,
    data), so every rank's loss curve continues exactly."""
    from shardkit.run.spawn.process import run_ranks
    from tests import _ranks_ckpt as targets

    ref = run_ranks(targets.ddp_save_continue, 2, args=(str(tmp_path),), timeout=120, backend="gloo")
    assert sorted(p.name for p in (tmp_path / "step2").iterdir() if p.name.startswith("rng")) == [
        "rng_state_0.pt", "rng_state_1.pt"]
    got = run_ranks(targets.ddp_resume_continue, 2, args=(str(tmp_path),), timeout=120, backend="gloo")
    assert [g.value["losses"] for g in got] == [r.value for r in ref]
    assert all(g.value["notes"] == [] and g.value["step"] == 2 for g in got)
