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

``--split``: a split consolidate (``ops.consolidate`` under srun/torchrun) at 8, 32 and 128 processes over
1,024 source ranks, eager (every process parses every rank file, the reader's default) against lazy
(``read_zero3(lazy=True)``, what split runs use), and lazy with the work cut by source rank instead of by
output bytes (``rank blocks``: not what consolidate does; each process would copy every tensor's elements
held by world / processes source ranks, one output range per tensor instead of one contiguous range): the
rank files each process parses (min / median / max
over the processes; its window of the output's fp32 bytes in safetensors' name order, the ranks whose
pieces it asks for: ``RankPieces.overlapping``), and the time of the busiest process (reader built, its
pieces computed). The synthetic parse costs next to nothing; ``--parse-ms`` adds what parsing one real
rank file's pickle costs (``read_structure``: measure it with ``--time-parse FILE``).

    python benchmarks/bench_zero3_reader.py [--worlds 64 256 1024] [--json]
    python benchmarks/bench_zero3_reader.py --split [--processes 8 32 128] [--parse-ms 2] [--json]
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
from shardkit.checkpoint.zero3.layout import partition_numel  # noqa: E402


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


def measure_split(world: int, processes: int, mode: str, parse_ms: float) -> dict[str, Any]:
    """A split consolidate over ``world`` source ranks at ``processes`` processes, ``mode`` eager or lazy."""
    ckpt, optim = synthetic_checkpoint(world)
    by_path = {p: r for r, p in enumerate(ckpt.optim_files)}

    def read(path: Path) -> Any:
        if parse_ms:
            time.sleep(parse_ms / 1000)  # what read_structure of one real rank file costs (--time-parse)
        return optim(by_path[path])

    t0 = time.perf_counter()
    model = describe_zero3(ckpt, lazy=mode == "lazy", read=read)
    describe = time.perf_counter() - t0
    tensors = [model.weights[n] for n in sorted(model.weights)]  # safetensors' order: one dtype, by name
    total = sum(t.numel for t in tensors)

    def window(p: int) -> list[tuple[Any, int, int]]:
        if mode == "rank blocks":  # every tensor's elements held by source ranks [r0, r1): one range per tensor
            r0, r1 = p * world // processes, (p + 1) * world // processes
            parts = [(t, partition_numel(t.numel, world)) for t in tensors]  # ZeRO-3's rule, no file parsed
            return [(t, r0 * n, min(t.numel, r1 * n)) for t, n in parts if r0 * n < t.numel]
        lo, hi, at, out = p * total // processes, (p + 1) * total // processes, 0, []
        for t in tensors:
            if at < hi and at + t.numel > lo:
                out.append((t, max(0, lo - at), min(t.numel, hi - at)))
            at += t.numel
        return out

    # the rank files a lazy process parses: rank 0's (read to describe) and every rank holding a piece of its window
    parsed = [len({0}.union(*(t.pieces.overlapping(a, b) for t, a, b in window(p)))) if mode != "eager" else world
              for p in range(processes)]
    busiest = max(range(processes), key=lambda p: parsed[p])
    t0 = time.perf_counter()
    pieces = sum(1 for t, a, b in window(busiest) for _ in t.pieces_in(a, b))
    share = time.perf_counter() - t0
    parsed.sort()
    return {"world": world, "processes": processes, "mode": mode, "parse_ms": parse_ms,
            "files_min": parsed[0], "files_median": parsed[len(parsed) // 2], "files_max": parsed[-1],
            "busiest_pieces": pieces, "busiest_seconds": round(describe + share, 3), "describe_seconds": round(describe, 3),
            "output_ranges": len(window(busiest)) if mode == "rank blocks" else 1}


def time_parse(path: Path, repeat: int = 20) -> float:
    """Milliseconds ``read_structure`` takes to parse ``path`` (the median of ``repeat`` parses, page cache warm)."""
    from shardkit.storage.torch_load import read_structure

    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        read_structure(path)
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeat // 2] * 1000


def _split_rows(args: argparse.Namespace) -> int:
    rows = []
    for processes in args.processes:
        for mode in ("eager", "lazy", "rank blocks"):
            done = subprocess.run([sys.executable, __file__, "--one-split", str(args.world), str(processes), mode.replace(" ", "_"),
                                   str(args.parse_ms)], capture_output=True, text=True, check=True, timeout=3600)
            rows.append(json.loads(done.stdout))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"| processes | read | rank files parsed per process (min / median / max of {args.world:,}) | "
          f"busiest process: pieces, output ranges written | seconds (parse {args.parse_ms:g} ms a file) |")
    print("|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['processes']} | {r['mode']} | {r['files_min']:,} / {r['files_median']:,} / {r['files_max']:,} | "
              f"{r['busiest_pieces']:,}, {r['output_ranges']:,} | {r['busiest_seconds']:.2f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one", nargs=2, metavar=("WORLD", "STEP"), help=argparse.SUPPRESS)
    ap.add_argument("--split", action="store_true", help="a split consolidate's rank files parsed, eager and lazy")
    ap.add_argument("--world", type=int, default=1024, help="--split: source ranks")
    ap.add_argument("--processes", type=int, nargs="+", default=[8, 32, 128], help="--split: processes")
    ap.add_argument("--parse-ms", type=float, default=0.0, help="--split: cost of parsing one rank file, added")
    ap.add_argument("--time-parse", type=Path, metavar="FILE", help="ms read_structure takes to parse FILE")
    ap.add_argument("--one-split", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.time_parse:
        print(f"{time_parse(args.time_parse):.3f} ms to parse {args.time_parse}")
        return 0
    if args.one_split:
        world, processes, mode, parse_ms = args.one_split
        print(json.dumps(measure_split(int(world), int(processes), mode.replace("_", " "), float(parse_ms))))
        return 0
    if args.split:
        return _split_rows(args)
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
