"""A real Hugging Face Trainer run on CPU ranks (run under torchrun by the Trainer tests).

DeepSpeed ZeRO-3 through the Trainer runs on CPU ranks with DS_ACCELERATOR=cpu and gloo (checked:
transformers 5.23, accelerate 1.15, DeepSpeed 0.19.8). The Trainer writes `OUT/checkpoint-N/`
holding `global_stepN/`, `latest`, `trainer_state.json`, `rng_state_<rank>.pth`.

    torchrun --standalone --nproc_per_node 2 tests/_ranks_trainer.py --out OUT --max-steps 4
        [--save-steps 2] [--resume OUT/checkpoint-2] [--engine zero3|fsdp2] [--result FILE]
        [--callback]

Prints nothing special; rank 0 writes --result (JSON: global_step, losses, world_size) when given.
Every run sees the same synthetic data (row i is seeded by i), so runs are repeatable.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
from torch.utils.data import Dataset

VOCAB = 128
SEQ_LEN = 16


class SyntheticTokens(Dataset):
    """Row i is the same tokens in every process and every run."""

    def __init__(self, rows: int = 96) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, VOCAB, (SEQ_LEN,), generator=g)
        return {"input_ids": ids, "labels": ids}


def tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def zero3_config() -> dict[str, Any]:
    # "auto" everywhere the Trainer fills values, as users write it.
    return {
        "zero_optimization": {"stage": 3},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                   "betas": "auto", "eps": "auto"}},
        "bf16": {"enabled": "auto"},
    }


def training_args(ns: argparse.Namespace) -> Any:
    from transformers import TrainingArguments

    kw: dict[str, Any] = dict(
        output_dir=ns.out, per_device_train_batch_size=2, max_steps=ns.max_steps,
        save_steps=ns.save_steps, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
        learning_rate=1e-3, weight_decay=0.01, seed=0, data_seed=0,
    )
    if ns.engine == "zero3":
        kw["deepspeed"] = zero3_config()
    else:
        kw["fsdp"] = "full_shard"
        kw["fsdp_config"] = {"version": 2}
    return TrainingArguments(**kw)


def main() -> None:
    from transformers import Trainer

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--resume", default=None)
    p.add_argument("--engine", choices=["zero3", "fsdp2"], default="zero3")
    p.add_argument("--result", default=None)
    p.add_argument("--callback", action="store_true", help="add shardkit's PreflightCallback")
    ns = p.parse_args()

    trainer = Trainer(model=tiny_llama(), args=training_args(ns), train_dataset=SyntheticTokens())
    if ns.callback:
        from shardkit.integrations.hf import PreflightCallback

        trainer.add_callback(PreflightCallback())
    trainer.train(resume_from_checkpoint=ns.resume)
    if ns.result and int(os.environ.get("RANK", "0")) == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        with open(ns.result, "w") as f:
            json.dump({"global_step": trainer.state.global_step, "losses": losses,
                       "world_size": int(os.environ.get("WORLD_SIZE", "1"))}, f)


if __name__ == "__main__":
    main()
