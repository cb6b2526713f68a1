"""A real Hugging Face Trainer run on CPU ranks (run under torchrun by the Trainer tests).

DeepSpeed ZeRO-3 through the Trainer runs on CPU ranks with DS_ACCELERATOR=cpu and gloo (checked:
transformers 5.23, accelerate 1.15, DeepSpeed 0.19.8). The Trainer writes `OUT/checkpoint-N/`
holding `global_stepN/`, `latest`, `trainer_state.json`, `rng_state_<rank>.pth`.

    torchrun --standalone --nproc_per_node 2 tests/_ranks_trainer.py --out OUT --max-steps 4
        [--save-steps 2] [--resume OUT/checkpoint-2] [--engine zero3|fsdp2] [--result FILE]
        [--callback] [--dump-loaded DIR] [--fault unmanaged] [--fp16] [--gpu]

Prints nothing special; rank 0 writes --result (JSON: global_step, losses, world_size) when given.
--dump-loaded DIR: every rank writes DIR/rank<r>.pt with what the resumed engine holds right after
the Trainer loaded the checkpoint (its fp32 partitions and Adam state, ZeRO-3 only) and its torch
CPU RNG state at the first step (after the Trainer restored rng_state_<r>.pth, if it had one).
--perturb-rng: rank r draws r+1 numbers when training begins, so the rng_state_<r>.pth files it saves
differ by rank (this model has no dropout: otherwise every rank's torch RNG stays identical).
--fault unmanaged: a callback given to Trainer(callbacks=...) adds `fault_head` (an nn.Linear) to the
model at on_train_begin, after deepspeed.initialize: ZeRO-3 never partitions it (the fault the
preflight must name). --fp16: fp16=True with `"fp16": {"enabled": "auto"}` (the Trainer fills it).
--gpu: train on the GPUs (use_cpu=False; the default is CPU ranks).
Every run sees the same synthetic data (row i is seeded by i), so runs are repeatable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
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
        save_steps=ns.save_steps, logging_steps=1, report_to=[], use_cpu=not ns.gpu, bf16=False,
        learning_rate=1e-3, weight_decay=0.01, seed=0, data_seed=0,
    )
    if ns.fp16:
        kw["fp16"] = True
    if ns.engine == "zero3":
        kw["deepspeed"] = zero3_config()
        if ns.fp16:
            kw["deepspeed"]["fp16"] = {"enabled": "auto"}
    else:
        kw["fsdp"] = "full_shard"
        kw["fsdp_config"] = {"version": 2}
    return TrainingArguments(**kw)


def dump_loaded_callback(trainer: Any, out: str) -> Any:
    """A TrainerCallback writing what this rank's engine loaded (see --dump-loaded)."""
    from transformers import TrainerCallback

    class DumpLoaded(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.loaded: dict[str, Any] | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            # after _prepare_for_training: deepspeed_load_checkpoint has run
            opt = trainer.model_wrapped.optimizer  # DeepSpeedZeroOptimizer_Stage3
            flats = opt.fp32_partitioned_groups_flat
            self.loaded = {
                "global_step": state.global_step,
                "fp32": [f.detach().clone() for f in flats],
                "state": [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.optimizer.state[f].items()}
                          for f in flats],
            }

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.loaded is None or "rng_cpu" in self.loaded:
                return
            # the Trainer restores rng_state_<rank>.pth just before the first step of a resumed epoch
            self.loaded["rng_cpu"] = torch.random.get_rng_state()
            os.makedirs(out, exist_ok=True)
            torch.save(self.loaded, os.path.join(out, f"rank{os.environ.get('RANK', '0')}.pt"))

    return DumpLoaded()


def add_module_after_engine() -> Any:
    """A TrainerCallback that adds `fault_head` to the model once the engine exists (--fault)."""
    from transformers import TrainerCallback

    class AddModuleAfterEngine(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            # trainer.model is the engine's module: the new Linear is created outside zero.Init
            model.fault_head = torch.nn.Linear(32, 8)

    return AddModuleAfterEngine()


def perturb_rng_callback() -> Any:
    """A TrainerCallback giving each rank its own torch RNG state (see --perturb-rng)."""
    from transformers import TrainerCallback

    class PerturbRng(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            torch.rand(int(os.environ.get("RANK", "0")) + 1)

    return PerturbRng()


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
    p.add_argument("--dump-loaded", default=None, metavar="DIR", help="write what each rank loaded on resume")
    p.add_argument("--perturb-rng", action="store_true", help="make each rank's saved RNG state differ")
    p.add_argument("--fault", choices=["unmanaged"], default=None, help="add a module after the engine is built")
    p.add_argument("--fp16", action="store_true", help='fp16=True, DeepSpeed "fp16": {"enabled": "auto"}')
    p.add_argument("--gpu", action="store_true", help="use_cpu=False: train on the GPUs")
    ns = p.parse_args()

    # callbacks given here run before any added later (and before the one `shardkit launch` adds)
    callbacks = [add_module_after_engine()] if ns.fault else None
    trainer = Trainer(model=tiny_llama(), args=training_args(ns), train_dataset=SyntheticTokens(), callbacks=callbacks)
    if ns.callback:
        from shardkit.integrations.hf import PreflightCallback

        trainer.add_callback(PreflightCallback())
    if ns.dump_loaded:
        trainer.add_callback(dump_loaded_callback(trainer, ns.dump_loaded))
    if ns.perturb_rng:
        trainer.add_callback(perturb_rng_callback())
    trainer.train(resume_from_checkpoint=ns.resume)
    if ns.result and int(os.environ.get("RANK", "0")) == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        with open(ns.result, "w") as f:
            json.dump({"global_step": trainer.state.global_step, "losses": losses,
                       "world_size": int(os.environ.get("WORLD_SIZE", "1"))}, f)


if __name__ == "__main__":
    main()
    # Done and flushed: leave without interpreter finalization, where torch 2.13 CPU ranks abort now
    # and then ("terminate called without an active exception", SIGABRT after atexit), failing a
    # finished run (launch/train_tiny.py, docs/slurm.md)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
