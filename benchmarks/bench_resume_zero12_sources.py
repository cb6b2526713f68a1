"""What one rank of the in-process ZeRO-1/2 resume pays for the *number of source rank files*.

``load_zero3_checkpoint`` on a ZeRO-1/2 engine (``checkpoint/ops/resume_zero12``) describes the source
through its reader (``readers.zero12.read_zero12``) on every rank: the small pickle of *every* source rank
file is parsed (``read_structure``: no tensor bytes), so each rank's planning grows with the source's
world size N, while the bytes it reads (its own partition) do not. This measures that growth on synthetic
many-rank sources: a real 2-rank ZeRO-2 save (bf16, AdamW, the tiny Llama; ``bench_reshard_zero2.small_save``)
laid out for N ranks by ``bench_reshard_zero2.scale_zero2`` (factor 1: the same model, N rank files; each
file's ``param_slice_mappings`` lists only the parameters in its partition, as DeepSpeed's do).

Per N, in this process, warm page cache, median of ``--repeat`` runs:

- ``read_zero12``: the reader's whole description (every file parsed; what each resuming rank does today);
- ``open``: ``zero12.reader.open_zero12_checkpoint``, the part of the first row that parses
  and cross-checks every file;
- ``pieces``: the rest of the first row, with the files parsed once beforehand: each parameter's pieces,
  built from the source ranks its range overlaps (it was every rank, params x N, before 2026-11-27);
- ``parse 1 file``: ``read_structure`` of one rank file (the unit the open is N of);
- ``overlap only``: parsing the model file, rank 0's file and the files whose ranges overlap one rank's new
  partition at N/2 ranks (2 or 3 files): what a rank would pay if the reader parsed only those (the
  flat ranges are arithmetic once rank 0's group sizes are known; the other files' pickles are only checked
  for agreement);
- ``in-process load``: ``load_zero3_checkpoint`` on a real 1-rank ZeRO-2 engine (spawned once; engine
  construction excluded), with the manifest's digests verified and with ``verify=False``.

    python benchmarks/bench_resume_zero12_sources.py [--ranks 2 8 32 128 512] [--repeat 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._timing import warm  # noqa: E402
from benchmarks.bench_reshard_zero2 import TAG, scale_zero2, small_save  # noqa: E402 - the repository on the path first


def _median(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _overlapping(tag: Path, new_world: int) -> list[Path]:
    """Rank 0's file and the files holding rank 0's new partition at ``new_world`` ranks (every group)."""
    from shardkit.checkpoint.zero12.reader import OPTIM_FILE, OPTIMIZER_KEY
    from shardkit.storage.torch_load import read_structure

    ranks = {int(m.group(2)): p for p in tag.iterdir() if (m := OPTIM_FILE.match(p.name))}
    files = [ranks[r] for r in sorted(ranks)]
    sd = read_structure(files[0])[OPTIMIZER_KEY]
    wanted = {0}
    for ref, pad in zip(sd["single_partition_of_fp32_groups"], sd["group_paddings"]):
        part = ref.numel + pad
        total = part * len(files)
        new_part = math.ceil(total / (2 * new_world)) * 2 * new_world // new_world
        wanted.update(range(0, min(len(files), math.ceil(new_part / part))))  # new rank 0: [0, new_part)
    return [files[r] for r in sorted(wanted)]


def _pieces_only(tag: Path, repeat: int) -> float:
    """``read_zero12`` with the rank files already parsed: the time it spends building pieces."""
    import shardkit.checkpoint.readers.zero12 as reader

    opened, real = reader.open_zero12_checkpoint(tag), reader.open_zero12_checkpoint
    reader.open_zero12_checkpoint = lambda _tag: opened  # parsed once, outside the timing
    try:
        return _median(lambda: reader.read_zero12(tag), repeat)
    finally:
        reader.open_zero12_checkpoint = real


def reader_rows(sources: dict[int, Path], repeat: int) -> list[dict[str, Any]]:
    from shardkit.checkpoint.readers.zero12 import read_zero12
    from shardkit.checkpoint.zero12.reader import MODEL_FILE, open_zero12_checkpoint
    from shardkit.storage.torch_load import read_structure

    rows = []
    for n, tag in sources.items():
        warm(tag)
        one = next(tag.glob("*zero_pp_rank_0_*optim_states.pt"))
        overlap = _overlapping(tag, max(1, n // 2))
        rows.append({
            "source_ranks": n,
            "read_zero12_s": _median(lambda: read_zero12(tag), repeat),
            "open_s": _median(lambda: open_zero12_checkpoint(tag), repeat),
            "pieces_s": _pieces_only(tag, repeat),
            "parse_one_file_s": _median(lambda: read_structure(one), repeat),
            "overlap_files": len(overlap),
            "overlap_only_s": _median(lambda: [read_structure(p) for p in [tag / MODEL_FILE, *overlap]], repeat),
            "bytes_per_file": one.stat().st_size,
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


def rank_loads(tags: list[str], repeat: int) -> list[dict[str, float]]:
    """Rank target (1 rank): ``load_zero3_checkpoint`` of each source, verified and not, median seconds."""
    import torch.distributed as dist

    from benchmarks.bench_reshard_zero2 import _config
    from shardkit import load_zero3_checkpoint
    from shardkit.engines.deepspeed import initialize
    from shardkit.engines.model_factory import tiny_llama

    engine = initialize(tiny_llama("tiny", seed=0), _config(dist.get_world_size()))
    out = []
    for tag in tags:
        row = {}
        for verify in (True, False):
            row["verified_s" if verify else "unverified_s"] = _median(
                lambda: load_zero3_checkpoint(engine, tag, verify=verify, preflight=False), repeat)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 32, 128, 512])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--no-load", action="store_true", help="skip the real 1-rank in-process loads")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_resume_zero12_"))
    small = small_save(workdir / "small")
    sources = {n: scale_zero2(small, workdir / f"ws{n}", 1, n) for n in args.ranks}
    rows = reader_rows(sources, args.repeat)
    if not args.no_load:
        from shardkit.run.spawn.process import run_ranks

        loads = run_ranks(rank_loads, 1, args=([str(p.parent / TAG) for p in sources.values()], args.repeat),
                          timeout=1800, device="cpu")[0].value
        for row, load in zip(rows, loads):
            row.update(load)
    print("\n| source ranks | read_zero12 (every file) | of it: open | pieces | 1 file | overlap only (files) | "
          "in-process load verified / not |\n|---|---|---|---|---|---|---|")
    for r in rows:
        load = (f"{r['verified_s'] * 1e3:.0f} / {r['unverified_s'] * 1e3:.0f} ms" if "verified_s" in r else "-")
        print(f"| {r['source_ranks']} | {r['read_zero12_s'] * 1e3:.1f} ms | {r['open_s'] * 1e3:.1f} ms | "
              f"{r['pieces_s'] * 1e3:.1f} ms | "
              f"{r['parse_one_file_s'] * 1e3:.2f} ms | "
              f"{r['overlap_only_s'] * 1e3:.1f} ms ({r['overlap_files']}) | {load} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
