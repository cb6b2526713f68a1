"""`shardkit estimate` against measured memory, side by side with DeepSpeed's and accelerate's estimators.

Runs real DeepSpeed ZeRO-3 (CPU offload of optimizer and parameters; and no offload) and FSDP2 training
steps at 2 gloo ranks on this CPU-only machine, on llama-shaped models (``SHARDKIT_BENCH_MODELS``, default
``40m,160m`` from shardkit.engines.model_factory), and measures each rank's memory: its peak RSS (VmHWM,
the kernel's own high-water mark) minus its RSS just before the model is built (torch, DeepSpeed, the CPU
Adam op and the process group already loaded), and what it holds between steps: RSS after the steps, once
glibc has handed its free heap back (``malloc_trim``), minus the same baseline. The per-host figure is the
sum over the 2 ranks.

Beside it, for the same model and config:
- shardkit: ``estimate_memory`` with ``whole_model_init`` (each rank builds the whole fp32 model before the
  engine shards it, as here). On a CPU-only run the accelerator is the CPU: the "GPU" items live in the same
  RAM, so the figure is held (GPU + host) + the larger of what a step adds (GPU + host) and what initialize
  adds on the host (the 16-bit copy DeepSpeed moves "to the device" is the host model itself here);
- DeepSpeed: ``estimate_zero3_model_states_mem_needs`` (the function ``..._all_cold``/``..._all_live`` print),
  per host: its CPU figure + 2 x its GPU figure, with ``zero_init=False`` (the model is built whole) and the
  run's offload flags (FSDP2: the no-offload row, the nearest it has);
- accelerate: ``accelerate estimate-memory``'s "Training using Adam" figure (``calculate_maximum_sizes`` +
  ``estimate_training_usage`` on the same meta-device model: the command itself needs the hub), per rank, x2.

Before the baseline each rank trains the tiny Llama once with the same engine, so the code, ops and runtime
buffers the engine loads on first use are not counted as the model's memory. Each error is
(estimate - measured) / measured. Every engine runs in its own spawned process group, one at a
time, with a hard timeout.

    python benchmarks/bench_estimate.py [--models 40m,160m] [--json out.json] [--reuse out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORLD = 2
MICRO, SEQ = 2, 64
ENGINES = ("zero3_offload_cpu", "zero3", "fsdp2")
TIMEOUT_S = 900


def ds_config(engine: str) -> dict[str, Any]:
    from shardkit.config.generate import deepspeed_config

    off = "cpu" if engine == "zero3_offload_cpu" else "none"
    return deepspeed_config(3, offload_optimizer=off, offload_param=off, precision="bf16", micro_batch=MICRO,
                            world_size=WORLD, pin_memory=False)


def fsdp_cfg() -> dict[str, Any]:
    from shardkit.config.generate import fsdp_config

    return fsdp_config(mixed_precision="bf16", micro_batch=MICRO)


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _trim() -> None:
    """Hand the C heap's free memory back to the OS (glibc malloc_trim), so RSS counts memory in use: glibc
    keeps freed chunks below its mmap threshold (up to 32 MiB) resident, as the CUDA caching allocator keeps
    freed blocks reserved."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_hwm() -> None:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs), so the peak starts at the baseline."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _train(engine: str, size: str) -> tuple[int, int]:
    """Build the model whole on this rank, hand it to the engine, train 2 steps; (RSS after the engine is
    built, RSS after the steps)."""
    import torch.distributed as dist

    from shardkit.engines.model_factory import synthetic_batch, tiny_llama

    model = tiny_llama(size, seed=0)
    vocab = model.config.vocab_size
    if engine.startswith("zero3"):
        from shardkit.engines.deepspeed import initialize, train_step

        eng = initialize(model, ds_config(engine))
        _trim()
        after_init = _rss()
        for step in range(2):
            train_step(eng, synthetic_batch(vocab, MICRO, SEQ, step, dist.get_rank()))
    else:
        from shardkit.config.fsdp import fsdp_config_from_dict
        from shardkit.engines.fsdp import apply_fsdp, build_optimizer

        cfg = fsdp_config_from_dict(fsdp_cfg())
        model = apply_fsdp(model, cfg)
        opt = build_optimizer(model, cfg)
        _trim()
        after_init = _rss()
        for step in range(2):
            ids = synthetic_batch(vocab, MICRO, SEQ, step, dist.get_rank())
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    dist.barrier()
    _trim()
    return after_init, _rss()


def rank_run(engine: str, size: str) -> dict[str, Any]:
    """One rank: a warm-up run of the tiny model (loads every module, op and runtime buffer the real run needs,
    so none of that counts as the model's), the baseline, then the real run."""
    import gc

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _train(engine, "tiny")
    gc.collect()
    _trim()
    dist.barrier()
    _reset_hwm()
    base = _rss()
    after_init, after_steps = _train(engine, size)
    return {"base": base, "init": after_init - base, "held": after_steps - base, "peak": _hwm() - base}


def measure(engine: str, size: str) -> dict[str, int]:
    """Sums over the ranks of RSS - baseline: after the engine is built, after the steps (held), and the peak."""
    from shardkit.run.spawn.process import run_ranks

    results = run_ranks(rank_run, WORLD, args=(engine, size), timeout=TIMEOUT_S, device="cpu")
    return {k: sum(int(r.value[k]) for r in results) for k in ("init", "held", "peak")}


def model_config(size: str) -> dict[str, Any]:
    from shardkit.engines.model_factory import LLAMA_SIZES

    kw = dict(LLAMA_SIZES[size])
    return {"model_type": "llama", "num_key_value_heads": kw["num_attention_heads"], "max_position_embeddings": 256,
            **kw}


def shardkit_figure(engine: str, size: str) -> tuple[dict[str, int], Any]:
    """Per host (2 ranks): held between steps and peak, as a CPU-only run holds them (see the docstring)."""
    from shardkit.estimate.compute import estimate_memory
    from shardkit.estimate.meta_model import shape_from_config_dict
    from shardkit.estimate.report import RunShape
    from shardkit.estimate.settings import settings_from_config

    model = shape_from_config_dict(model_config(size), f"llama {size}")
    cfg = fsdp_cfg() if engine == "fsdp2" else ds_config(engine)
    settings = settings_from_config(cfg, model.hidden_size)
    run = RunShape(world_size=WORLD, gpus_per_node=WORLD, micro_batch=MICRO, seq_len=SEQ, whole_model_init=True)
    est = estimate_memory(model, settings, run)

    # torch.empty on the CPU maps pages it never touches: of the reduce bucket only what the gradients fill
    # is resident (on a GPU, cudaMalloc reserves it all, as the estimate says)
    untouched = sum(i.bytes - min(i.bytes, model.total_params * settings.lp_bytes)  # type: ignore[union-attr]
                    for i in est.items if i.id == "z3.reduce_bucket")
    both = ("gpu", "host")
    held = sum(i.bytes for i in est.items if i.lifetime == "held") - untouched
    # the 16-bit copy DeepSpeed moves "to the device" (and FSDP2's model moved to it) is the host model itself
    peak = est.phase_peak(both, exclude=("z3.init_gpu", "fsdp.init_gpu")) - untouched
    return {"held": held * WORLD, "peak": peak * WORLD}, model


def deepspeed_figure(engine: str, model: Any) -> int:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    off = engine == "zero3_offload_cpu"
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(model.total_params, model.largest_layer_params,
                                                        num_gpus_per_node=WORLD, num_nodes=1, cpu_offload=off,
                                                        cpu_offload_params=off, zero_init=False)
    return int(cpu + WORLD * gpu)


def accelerate_figure(size: str, dtype: str) -> int:
    import torch
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = model_config(size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    total, _ = calculate_maximum_sizes(model)
    return int(max(estimate_training_usage(total, dtype).values())) * WORLD


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=os.environ.get("SHARDKIT_BENCH_MODELS", "40m,160m"))
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--json", default=None, metavar="FILE")
    parser.add_argument("--reuse", default=None, metavar="FILE",
                        help="take the measured figures from an earlier --json file; recompute the estimates")
    args = parser.parse_args()
    earlier = {(r["model"], r["engine"]): r["measured"] for r in json.loads(Path(args.reuse).read_text())} \
        if args.reuse else {}
    rows = []
    for size in args.models.split(","):
        for engine in args.engines.split(","):
            ours, model = shardkit_figure(engine, size)
            measured = earlier.get((size, engine)) or measure(engine, size)
            row = {"model": size, "params": model.total_params, "engine": engine, "measured": measured,
                   "shardkit": ours, "deepspeed": deepspeed_figure(engine, model),
                   "accelerate": accelerate_figure(size, "bfloat16")}
            rows.append(row)
            print(json.dumps(row), flush=True)
    mib = 2**20

    def cell(value: int, measured: int) -> str:
        return f"{value / mib:>7,.0f} {100 * (value - measured) / measured:>+5.0f}%"

    print(f"\nMiB per host ({WORLD} ranks); error = (estimate - measured) / measured")
    print(f"{'model':>5} {'engine':>17} | {'held':>6} {'shardkit':>13} | {'peak':>6} {'shardkit':>13} "
          f"{'DeepSpeed':>13} {'accelerate':>13}")
    for r in rows:
        m = r["measured"]
        print(f"{r['model']:>5} {r['engine']:>17} | {m['held'] / mib:>6,.0f} {cell(r['shardkit']['held'], m['held'])} | "
              f"{m['peak'] / mib:>6,.0f} {cell(r['shardkit']['peak'], m['peak'])} {cell(r['deepspeed'], m['peak'])} "
              f"{cell(r['accelerate'], m['peak'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
