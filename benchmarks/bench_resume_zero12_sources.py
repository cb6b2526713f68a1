"""What one rank of the in-process ZeRO-1/2 resume pays for the *number of source rank files*.

``load_checkpoint_resharded`` on a ZeRO-1/2 engine (``checkpoint/ops/resume_zero12``) describes the source
through its reader (``readers.zero12.read_zero12``) on every rank. Until 2026-11-27 the small pickle of
*every* source rank file was parsed there (``read_structure``: no tensor bytes), so each rank's planning grew
with the source's world size N while the bytes it reads (its own partition) did not; now a rank parses the
model-states file, rank 0's optimizer file (the layout) and the files its partition overlaps
(``read_zero12(tag, ranks=...)``). This measures both on synthetic
many-rank sources: a real 2-rank ZeRO-2 save (bf16, AdamW, the tiny Llama; ``bench_reshard_zero2.small_save``)
laid out for N ranks by ``bench_reshard_zero2.scale_zero2`` (factor 1: the same model, N rank files; each
file's ``param_slice_mappings`` lists only the parameters in its partition, as DeepSpeed's do).

Per N, in this process, warm page cache, median of ``--repeat`` runs:

- ``read_zero12``: the reader's whole description (every file parsed; what each resuming rank did before);
- ``open``: ``readers.zero12.open_zero12_checkpoint``, the part of the first row that parses
  and cross-checks every file;
- ``pieces``: the rest of the first row, with the files parsed once beforehand: each parameter's pieces,
  built from the source ranks its range overlaps (it was every rank, params x N, before 2026-11-27);
- ``parse 1 file``: ``read_structure`` of one rank file (the unit the open is N of);
- ``one rank``: what a resuming rank's reader does now (``resume_zero12._read_share``'s two reads), for the
  middle rank of a new world of N/2 and of N ranks: ``read_zero12(tag, ranks=())`` (model-states file and
  rank 0's), its partition placed by ``Zero12Layout.ranks_holding``, ``read_zero12(tag, ranks=needed)``;
  with the rank files it parsed;
- ``in-process load``: ``load_checkpoint_resharded`` on a real 1-rank ZeRO-2 engine (spawned once; engine
  construction excluded), with the manifest's digests verified and with ``verify=False``. One rank holds the
  whole flat buffer, so it needs every file: this row does not shrink.

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


def one_rank_read(tag: Path, new_world: int, rank: int) -> int:
    """What ``resume_zero12._read_share`` reads for ``rank`` of an engine at ``new_world`` ranks (the engine's
    partition of each group taken as DeepSpeed lays it out: the data padded to a multiple of 2 x ranks, cut into
    equal parts); returns the number of optimizer files parsed."""
    from shardkit.checkpoint.readers.zero12 import read_zero12, zero12_layout

    head = read_zero12(tag, ranks=())
    layout = zero12_layout(head)
    spans = {name: (g, at, head.weights[name].numel) for name, (g, at) in layout.offsets.items()}
    ends: dict[int, int] = {}
    for g, at, numel in spans.values():
        ends[g] = max(ends.get(g, 0), at + numel)
    needed: set[int] = set()
    for name, (g, at, numel) in spans.items():
        size = math.ceil(ends[g] / (2 * new_world)) * 2  # the engine's partition of group g
        lo, hi = max(rank * size, at), min((rank + 1) * size, at + numel)
        if lo < hi:
            needed.update(layout.ranks_holding(name, lo - at, hi - at))
    read_zero12(tag, ranks=needed)
    return len(needed | {0})


def _pieces_only(tag: Path, repeat: int) -> float:
    """``read_zero12`` with the rank files already parsed: the time it spends building pieces."""
    import shardkit.checkpoint.readers.zero12 as reader

    opened, real = reader.open_zero12_checkpoint(tag), reader.open_zero12_checkpoint
    reader.open_zero12_checkpoint = lambda _tag, _ranks=None: opened  # parsed once, outside the timing
    try:
        return _median(lambda: reader.read_zero12(tag), repeat)
    finally:
        reader.open_zero12_checkpoint = real


def reader_rows(sources: dict[int, Path], repeat: int) -> list[dict[str, Any]]:
    from shardkit.checkpoint.readers.zero12 import open_zero12_checkpoint, read_zero12
    from shardkit.storage.torch_load import read_structure

    rows = []
    for n, tag in sources.items():
        warm(tag)
        one = next(tag.glob("*zero_pp_rank_0_*optim_states.pt"))
        row: dict[str, Any] = {
            "source_ranks": n,
            "read_zero12_s": _median(lambda: read_zero12(tag), repeat),
            "open_s": _median(lambda: open_zero12_checkpoint(tag), repeat),
            "pieces_s": _pieces_only(tag, repeat),
            "parse_one_file_s": _median(lambda: read_structure(one), repeat),
        }
        for label, new in (("half", max(1, n // 2)), ("same", n)):  # the middle rank of a new world of that size
            row[f"one_rank_{label}_s"] = _median(lambda: one_rank_read(tag, new, new // 2), repeat)
            row[f"one_rank_{label}_files"] = one_rank_read(tag, new, new // 2)
        row["bytes_per_file"] = one.stat().st_size
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    return rows


def rank_loads(tags: list[str], repeat: int) -> list[dict[str, float]]:
    """Rank target (1 rank): ``load_checkpoint_resharded`` of each source, verified and not, median seconds."""
    import torch.distributed as dist

    from benchmarks.bench_reshard_zero2 import _config
    from shardkit import load_checkpoint_resharded
    from shardkit.engines.deepspeed import initialize
    from shardkit.engines.model_factory import tiny_llama

    engine = initialize(tiny_llama("tiny", seed=0), _config(dist.get_world_size()))
    out = []
    for tag in tags:
        row = {}
        for verify in (True, False):
            row["verified_s" if verify else "unverified_s"] = _median(
                lambda: load_checkpoint_resharded(engine, tag, verify=verify, preflight=False), repeat)
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
    print("\n| source ranks | before: read_zero12 (every file) | of it: open | pieces | 1 file | now, one rank at N/2: "
          "time (files parsed) | at N | in-process load (1 rank) verified / not |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        load = (f"{r['verified_s'] * 1e3:.0f} / {r['unverified_s'] * 1e3:.0f} ms" if "verified_s" in r else "-")
        print(f"| {r['source_ranks']} | {r['read_zero12_s'] * 1e3:.1f} ms | {r['open_s'] * 1e3:.1f} ms | "
              f"{r['pieces_s'] * 1e3:.1f} ms | {r['parse_one_file_s'] * 1e3:.2f} ms | "
              f"{r['one_rank_half_s'] * 1e3:.1f} ms ({r['one_rank_half_files']}) | "
              f"{r['one_rank_same_s'] * 1e3:.1f} ms ({r['one_rank_same_files']}) | {load} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
