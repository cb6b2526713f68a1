"""Accelerate ``save_state``/``load_state`` with DeepSpeed ZeRO-2 on gloo CPU ranks, for
tests/test_reshard_carries_files.py (a rank target: spawned processes import it by module name).

A GPT-2 from config with dropout 0.2, so the RNG a resume restores decides the losses; each process's
batches come from a generator seeded by (step, process), so only dropout draws from the global RNG.
Accelerate 1.15 counts processes on a CPU-only machine only with ``cpu=True``, which also turns
DeepSpeed off (``AcceleratorState``: DeepSpeed only ``if not cpu``); without it every process calls
itself process 0 of 1 and writes ``random_states_0.pkl``. ``PartialState(cpu=True)`` is therefore
made first (process index and count from the gloo group), and ``Accelerator(deepspeed_plugin=...)``
then selects DeepSpeed on that state, as ``accelerate launch`` does on GPUs.
"""

from __future__ import annotations

import os
from typing import Any

#: Optimizer steps before save_state, and steps run after it (or after load_state).
STEPS = 2
AFTER = 2
VOCAB = 96


class Counter:
    """A registered object (``register_for_checkpointing``): Accelerate saves it as custom_checkpoint_0.pkl."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


def _setup() -> tuple[Any, ...]:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin
    from transformers import GPT2Config, GPT2LMHeadModel

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
                                       resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2,
                                       bos_token_id=0, eos_token_id=0))
    model.train()
    plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                           "zero_optimization": {"stage": 2}, "steps_per_print": 10_000})
    PartialState(cpu=True)
    acc = Accelerator(deepspeed_plugin=plugin)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = acc.prepare(model, opt, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return acc, model, opt, sched, counter


def _steps(acc: Any, model: Any, opt: Any, sched: Any, counter: Counter, start: int, n: int) -> list[float]:
    import torch

    losses = []
    for step in range(start, start + n):
        ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1000 * step + acc.process_index))
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.seen += 1
        losses.append(loss.item())
    return losses


def save_run(folder: str) -> list[float]:
    """STEPS steps, ``save_state(folder)``, AFTER more: this process's losses, the ones after the save last."""
    acc, model, opt, sched, counter = _setup()
    losses = _steps(acc, model, opt, sched, counter, 0, STEPS)
    acc.save_state(folder)
    return losses + _steps(acc, model, opt, sched, counter, STEPS, AFTER)


def resume_run(folder: str) -> dict[str, Any]:
    """``load_state(folder)`` and AFTER steps: this process's losses and what the registered object restored."""
    acc, model, opt, sched, counter = _setup()
    acc.load_state(folder)
    seen = counter.seen
    return {"losses": _steps(acc, model, opt, sched, counter, STEPS, AFTER), "seen": seen,
            "lr": sched.get_last_lr()[0]}
