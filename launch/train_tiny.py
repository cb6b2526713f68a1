"""A small training script for the ready launch scripts in this folder (and their tests).

Plain torch + DDP under torchrun, or DeepSpeed when --deepspeed_config is given (the deepspeed
launcher). It knows nothing about shardkit: `shardkit launch` adds the placement preflight.

    torchrun --standalone --nproc_per_node 2 launch/train_tiny.py --steps 3
    deepspeed --num_gpus 2 launch/train_tiny.py --deepspeed_config ds_configs/zero3.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(256, 32), nn.Flatten(), nn.Linear(32 * 8, 64), nn.ReLU(), nn.Linear(64, 256))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 256, (4, 8), generator=g), torch.randint(0, 256, (4,), generator=g)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--deepspeed_config", default=None)
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))  # deepspeed launcher
    parser.add_argument("--save", default=None, help="DeepSpeed only: engine.save_checkpoint(SAVE) after the last step")
    args = parser.parse_args()
    model = build_model()
    if args.deepspeed_config:
        import deepspeed

        deepspeed.init_distributed()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=args.deepspeed_config)
        device = engine.device
    else:
        use_gpu = torch.cuda.is_available()
        dist.init_process_group("nccl" if use_gpu else "gloo")
        device = torch.device("cuda", args.local_rank) if use_gpu else torch.device("cpu")
        model.to(device)
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if use_gpu else None)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        engine = ddp
    for step in range(args.steps):
        x, y = (t.to(device) for t in batch(step, dist.get_rank()))
        loss = nn.functional.cross_entropy(engine(x), y)
        if args.deepspeed_config:
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    if args.save and args.deepspeed_config:
        engine.save_checkpoint(args.save)  # every rank writes its own partition files
    if dist.get_rank() == 0:
        print("training finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Everything is done and flushed; leave without interpreter finalization. On torch 2.13 CPU +
    # DeepSpeed 0.19.8 a finished rank aborted there in about 1 run of 3 under load ("terminate called
    # without an active exception", SIGABRT, after atexit): DeepSpeed keeps its gloo groups alive past
    # destroy_process_group, and a gloo worker thread freeing the last collective's tensors during
    # finalization cannot take the GIL (docs/slurm.md has the backtrace's story).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
