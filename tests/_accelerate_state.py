"""A real plain ``Accelerator.save_state`` folder (one CPU process, no FSDP or DeepSpeed): the tiny Llama after one
AdamW step, saved as ``model.safetensors``, ``optimizer.bin`` and ``random_states_0.pkl``, without ``config.json``.
Written by a child process, so accelerate's process-wide state never reaches the test process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_SAVE = """
import sys, torch
from accelerate import Accelerator
from shardkit.engines.model_factory import tiny_llama
accelerator = Accelerator(cpu=True)
model = tiny_llama("tiny", seed=0)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
accelerator.backward(model(input_ids=ids, labels=ids).loss)
optimizer.step()
accelerator.save_state(sys.argv[1])
"""


def save_state_folder(dest: Path) -> Path:
    """``dest`` written by ``Accelerator.save_state`` (see the module doc)."""
    subprocess.run([sys.executable, "-c", _SAVE, str(dest)], check=True, capture_output=True, timeout=300)
    return dest
