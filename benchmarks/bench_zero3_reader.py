"""What the ZeRO-3 reader (``readers.zero3``) holds and costs in one process, at 64 to 1,024 source ranks
of a 70B Llama (723 parameters, fp32 masters and two Adam moments), against what storing every
tensor's pieces as a list (the reader before ``RankPieces``) held.

The source is simulated where the reader meets it, as benchmarks/bench_reshard_plan.py does: each rank
file's ``read_structure`` result is what a real 0.19.8 save of that shape parses to (flat fp32
partitions and Adam moments as TensorRefs at file offsets), handed to ``describe_zero3`` as its
``read``. Every row runs in a fresh child process (peak RSS: the child's ``ru_maxrss`` minus that of a
child that only builds the synthetic layout) and reports:

- ``describe``: the checkpoint model built (lazy: only rank 0's optim file parsed);
- ``share``: one process's share of a split consolidate (world / 8 processes, one per node of 8
  GPUs): its contiguous 1/P of the output's fp32 bytes, every piece of it asked for
  (``SourceTensor.pieces_in``), with the rank files it had to parse;
- ``all ranks``: every rank's offsets parsed (the default, eager ``read_zero3``) and every piece of
  every tensor and moment computed once (what a single-process consolidate or a convert walks);
- ``as lists``: those pieces kept as lists, one per tensor (the old reader's shape): the ranks x
  tensors memory the lazy pieces avoid.

    python benchmarks/bench_zero3_reader.py [--worlds 64 256 1024] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_reshard_plan import GPUS_PER_NODE, synthetic_checkpoint  # noqa: E402
from shardkit.checkpoint.readers.zero3 import describe_zero3  # noqa: E402


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(world: int, step: str) -> dict[str, Any]:
    """One step at ``world`` ranks, in this process (run by ``main`` in a child per row)."""
    ckpt, optim = synthetic_checkpoint(world)
    by_path = {p: r for r, p in enumerate(ckpt.optim_files)}
    base = _rss_mib()
    t0 = time.perf_counter()
    model = describe_zero3(ckpt, lazy=True, read=lambda path: optim(by_path[path]))
    out: dict[str, Any] = {"world": world, "step": step, "tensors": len(model.weights)}
    tensors = [*model.weights.values(), *(t for states in model.optimizer.values() for t in states.values())]
    pieces = 0
    kept: list[Any] = []
    if step == "share":
        processes = max(1, world // GPUS_PER_NODE)
        total = sum(t.numel for t in model.weights.values())
        lo, hi, at = 0, total // processes, 0  # process 0's window of the output's elements
        for t in model.weights.values():
            if at < hi and at + t.numel > lo:
                pieces += sum(1 for _ in t.pieces_in(max(0, lo - at), min(t.numel, hi - at)))
            at += t.numel
        out["processes"] = processes
    elif step in ("all ranks", "as lists"):
        for t in tensors:
            if step == "as lists":
                kept.append(list(t.pieces))
                pieces += len(kept[-1])
            else:
                pieces += sum(1 for _ in t.pieces)
    seconds = time.perf_counter() - t0
    files = getattr(next(iter(model.weights.values())).pieces, "_files")
    out.update(seconds=round(seconds, 3), pieces=pieces, rank_files_parsed=len(getattr(files, "_optim")),
               rss_mib=round(_rss_mib() - base, 1))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one", nargs=2, metavar=("WORLD", "STEP"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure(int(args.one[0]), args.one[1])))
        return 0
    rows = []
    for world in args.worlds:
        for step in ("describe", "share", "all ranks", "as lists"):
            done = subprocess.run([sys.executable, __file__, "--one", str(world), step], capture_output=True,
                                  text=True, check=True)
            rows.append(json.loads(done.stdout))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("| source ranks | step | seconds | pieces computed | rank files parsed | peak RSS above the layout (MiB) |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        step = r["step"] + (f" (1 of {r['processes']} processes)" if "processes" in r else "")
        print(f"| {r['world']:,} | {step} | {r['seconds']:.3f} | {r['pieces']:,} | {r['rank_files_parsed']:,} | "
              f"{r['rss_mib']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
