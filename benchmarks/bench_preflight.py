"""How much the placement preflight costs next to deepspeed.initialize (ZeRO-3, 2 CPU ranks, gloo).

    python benchmarks/bench_preflight.py                 # small, 40m, 160m Llama
    python benchmarks/bench_preflight.py --sizes 160m --repeats 5

For each size, fresh ranks build the model, time ``deepspeed.initialize`` (ZeRO-3, no offload),
then time ``shardkit.preflight(engine)`` ``--repeats`` times (each a full collective: collect
records, one store exchange, verdict) and report the median. The preflight reads tensor metadata
only - no copies, no per-tensor collective - so its cost should follow the number of tensors, not
their bytes. Prints a markdown table. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {"stage": 3},
}


def bench_rank(size: str, repeats: int) -> dict[str, Any]:
    import torch.distributed as dist

    import shardkit
    from shardkit.engines.deepspeed import initialize
    from shardkit.engines.model_factory import tiny_llama
    from shardkit.placement import collect_records

    model = tiny_llama(size)
    n_params = sum(p.numel() for p in model.parameters())
    dist.barrier()
    t0 = time.perf_counter()
    engine = initialize(model, CONFIG)
    dist.barrier()
    init_s = time.perf_counter() - t0
    times, collect_times = [], []
    report = None
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        report = shardkit.preflight(engine, timeout=120)
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        collect_records(engine)
        collect_times.append(time.perf_counter() - t0)
    assert report is not None
    (mine,) = report.ranks  # every rank holds its own full report (rank 0 also every summary)
    return {
        "size": size,
        "params": n_params,
        "tensors": len(mine.records),
        "bytes": sum(r.bytes for r in mine.records),
        "init_s": init_s,
        "preflight_s": statistics.median(times),
        "collect_s": statistics.median(collect_times),
    }


def main(argv: list[str] | None = None) -> int:
    from shardkit.run.spawn.process import run_ranks

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["small", "40m", "160m"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for size in args.sizes:
        results = run_ranks(bench_rank, args.nproc, args=(size, args.repeats), timeout=1800, backend="gloo")
        # the slowest rank decides when training can start
        rows.append({**results[0].value, **{k: max(r.value[k] for r in results) for k in ("init_s", "preflight_s", "collect_s")}})
        print(f"done {size}", file=sys.stderr, flush=True)
    print(f"\nZeRO-3, {args.nproc} CPU ranks (gloo), median of {args.repeats} preflights, slowest rank\n")
    print("| model | parameters | tensors checked per rank | bytes checked per rank | deepspeed.initialize | preflight | collect (local part) | preflight / initialize | preflight per tensor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| llama:{r['size']} | {r['params'] / 1e6:.1f}M | {r['tensors']} | {r['bytes'] / 2**20:.0f} MiB "
            f"| {r['init_s']:.2f} s | {r['preflight_s'] * 1e3:.1f} ms | {r['collect_s'] * 1e3:.1f} ms "
            f"| {100 * r['preflight_s'] / r['init_s']:.2f}% | {r['preflight_s'] / r['tensors'] * 1e6:.0f} us |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
