"""DeepSpeed's CPU Adam kernels keep ``beta**step`` in a C++ object outside every checkpoint
(shardkit/checkpoint/ops/cpu_adam_kernel.py). A kernel object that did not run the earlier steps (a
new process, a new DeepSpeedCPUAdam) computes the first resumed step's bias correction with
``pow`` instead of the uninterrupted run's float32 product, and the update differs in the last
bit. These tests resume at step 2, where the two disagree for beta2 = 0.999, and show the update
is bit-exact only after ``restore_cpu_adam_kernel_state`` replays the steps.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from shardkit.checkpoint.ops.cpu_adam_kernel import KernelReplay, restore_cpu_adam_kernel_state

SAVED_AT = 2
HPARAMS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
NUMEL = 4096


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def test_resume_step_is_one_where_the_kernel_product_and_pow_disagree():
    """Why SAVED_AT = 2: 0.999f * 0.999f * 0.999f (what one process accumulates) is not
    float(pow(0.999, 3)) (what a new process starts from)."""
    beta2 = _f32(0.999)
    product = beta2 * beta2 * beta2
    from_pow = (beta2.double() ** (SAVED_AT + 1)).float()
    assert product.item() != from_pow.item(), (product.item(), from_pow.item())


def _grad(step: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(step))


def _steps(opt: torch.optim.Optimizer, param: torch.nn.Parameter, steps: range) -> None:
    for k in steps:
        param.grad = _grad(k)
        opt.step()


@pytest.mark.slow
def test_deepspeed_cpu_adam_in_a_new_kernel_object_is_bit_exact_only_after_the_replay():
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param = torch.nn.Parameter(torch.randn(NUMEL, generator=torch.Generator().manual_seed(0)))
    reference = DeepSpeedCPUAdam([param], **HPARAMS)
    _steps(reference, param, range(1, SAVED_AT + 1))
    saved_param, saved_state = param.detach().clone(), copy.deepcopy(reference.state_dict())
    _steps(reference, param, range(SAVED_AT + 1, SAVED_AT + 2))
    expected = param.detach().clone()

    def resume(replay: bool) -> tuple[torch.Tensor, list[KernelReplay], int]:
        p = torch.nn.Parameter(saved_param.clone())
        opt = DeepSpeedCPUAdam([p], **HPARAMS)  # a new opt_id: a fresh C++ object, as in a new process
        opt.load_state_dict(copy.deepcopy(saved_state))
        replays = restore_cpu_adam_kernel_state(opt) if replay else []
        _steps(opt, p, range(SAVED_AT + 1, SAVED_AT + 2))
        return p.detach().clone(), replays, opt.opt_id

    naive, _, _ = resume(replay=False)
    differ = int((naive != expected).sum())
    assert differ > 0, "DeepSpeedCPUAdam resumed bit-exact without the replay: the kernel keeps no hidden step state any more"
    fixed, replays, opt_id = resume(replay=True)
    assert torch.equal(fixed, expected), f"{int((fixed != expected).sum())} of {NUMEL} elements differ after the replay"
    assert replays == [KernelReplay(kernel=f"DeepSpeedCPUAdam opt_id {opt_id}", step=SAVED_AT, calls=SAVED_AT)]


def test_torch_adamw_keeps_its_step_in_the_state_dict_and_needs_no_replay():
    p = torch.nn.Parameter(torch.zeros(NUMEL))
    opt = torch.optim.AdamW([p], **HPARAMS)
    _steps(opt, p, range(1, SAVED_AT + 1))
    assert torch.is_tensor(opt.state[p]["step"])  # torch computes the bias correction from it on every step
    assert restore_cpu_adam_kernel_state(opt) == []


# The CPU FusedAdam kernel object is one per process (csrc/cpu/adam/fused_adam.cpp), so the
# resumed side runs in a new process: first without the replay, then a second optimizer with it.
_FRESH_PROCESS = """
import copy, sys, torch
from deepspeed.ops.adam import FusedAdam
from shardkit.checkpoint.ops.cpu_adam_kernel import restore_cpu_adam_kernel_state
from tests.test_cpu_adam_kernel import HPARAMS, SAVED_AT, _steps
saved = torch.load(sys.argv[1], weights_only=True)
out = {}
for label, replay in (("naive", False), ("replayed", True)):
    p = torch.nn.Parameter(saved["param"].clone())
    opt = FusedAdam([p], **HPARAMS)
    opt.load_state_dict(copy.deepcopy(saved["state"]))
    replays = restore_cpu_adam_kernel_state(opt) if replay else []
    _steps(opt, p, range(SAVED_AT + 1, SAVED_AT + 2))
    out[label] = p.detach().clone()
    out[label + "_replays"] = [(r.kernel, r.step, r.calls) for r in replays]
torch.save(out, sys.argv[2])
"""


@pytest.mark.slow
def test_cpu_fused_adam_resumed_in_a_new_process_is_bit_exact_only_after_the_replay(tmp_path):
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import FusedAdam

    if get_accelerator().device_name() != "cpu":
        pytest.skip("FusedAdam runs the CUDA kernel here, which computes pow(beta, step) on every call")
    param = torch.nn.Parameter(torch.randn(NUMEL, generator=torch.Generator().manual_seed(0)))
    reference = FusedAdam([param], **HPARAMS)
    _steps(reference, param, range(1, SAVED_AT + 1))
    torch.save({"param": param.detach().clone(), "state": reference.state_dict()}, tmp_path / "saved.pt")
    _steps(reference, param, range(SAVED_AT + 1, SAVED_AT + 2))
    expected = param.detach().clone()

    proc = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, str(tmp_path / "saved.pt"), str(tmp_path / "out.pt")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert not torch.equal(out["naive"], expected), (
        "CPU FusedAdam resumed bit-exact in a new process without the replay: the kernel keeps no hidden step state any more"
    )
    assert torch.equal(out["replayed"], expected), f"{int((out['replayed'] != expected).sum())} elements differ after the replay"
    assert out["replayed_replays"] == [("FusedAdam CPU kernel (adamw mode)", SAVED_AT, SAVED_AT)]
