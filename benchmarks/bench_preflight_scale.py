"""The placement preflight's cross-rank exchange at 8 to 1,024 ranks, on one machine.

    python benchmarks/bench_preflight_scale.py --world 8 64 256 1024
    python benchmarks/bench_preflight_scale.py --world 1024 --json

A real ``torch.distributed.TCPStore`` server (in this process, as torchrun's agent hosts it);
rank 0 in its own process, so its memory is its own; every other rank a thread with its own store
client. Every rank ships a 70B-Llama-shaped ZeRO-3 report (3,615 tensors, benchmarks/_llama_reports.py)
through the project's real exchange (``shardkit.placement.preflight.exchange``), with one misplaced
optimizer state planted on rank world-3 and one parameter missing on rank world/2. Side by side, in
the same run, the exchange shardkit shipped before ranks sent summaries (every rank's full report to rank 0,
decoded and judged there), kept below as ``full_report_exchange``.

Per world it prints: rank-0 verdict seconds (from the last report written to the verdict written),
rank-0 peak memory added during the exchange, bytes a healthy rank ships, and whether both planted
faults are named in the verdict every rank raises. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _llama_reports import DROPPED, MISPLACED, llama70b_report  # noqa: E402

from shardkit.placement.preflight import _text, _Verdict, decode, encode, exchange  # noqa: E402
from shardkit.placement.records import RankReport  # noqa: E402
from shardkit.placement.verdict import judge  # noqa: E402

TIMEOUT_S = 600.0


class _Timed:
    """A store client that remembers when this rank's report went in, the verdict came out, and
    how many bytes this rank wrote."""

    def __init__(self, store: Any, rank: int) -> None:
        self._store, self._rank = store, rank
        self.wrote = 0
        self.report_at = 0.0
        self.verdict_at = 0.0

    def set(self, key: str, value: bytes | str) -> None:
        self._store.set(key, value)
        self.wrote += len(value)
        if key.endswith(f"/rank{self._rank}"):
            self.report_at = time.monotonic()

    def compare_set(self, key: str, expected: str, value: bytes) -> bytes:
        out = self._store.compare_set(key, expected, value)
        if key.endswith("/verdict") and out == value:
            self.wrote += len(value)
            self.verdict_at = time.monotonic()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def full_report_exchange(store: Any, local: RankReport, world: int, timeout: float, base: str) -> _Verdict:
    """The exchange before ranks sent summaries: every rank's full report (every record, the whole parameter
    map) to rank 0, which decodes and judges all of them and publishes the verdict."""
    keys = [f"{base}/rank{r}" for r in range(world)]
    verdict_key = f"{base}/verdict"
    store.set(keys[local.rank], encode(local))
    if local.rank == 0:
        store.wait(keys[1:], timedelta(seconds=timeout))
        report = judge([local, *(decode(b) for b in store.multi_get(keys[1:]))])
        verdict = _Verdict(report.ok, _text(report, world, timeout), [])
        store.compare_set(verdict_key, "", verdict.encode())
    else:
        store.wait([verdict_key], timedelta(seconds=timeout))
        verdict = _Verdict.decode(store.get(verdict_key))
    return verdict


def _faults(world: int) -> dict[str, int]:
    return {"misplaced": world - 3, "dropped": world // 2}


def _report(rank: int, world: int) -> RankReport:
    f = _faults(world)
    return llama70b_report(rank, world, misplaced=rank == f["misplaced"], drop=rank == f["dropped"])


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _rank0(port: int, world: int, mode: str, base: str, out: Any) -> None:
    from torch.distributed import TCPStore

    local = _report(0, world)
    store = _Timed(TCPStore("127.0.0.1", port, world + 1, False, timeout=timedelta(seconds=TIMEOUT_S)), 0)
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = _vm("VmRSS")
    if mode == "summary":
        verdict = exchange(store, local, world, TIMEOUT_S, base)[1]
    else:
        verdict = full_report_exchange(store, local, world, TIMEOUT_S, base)
    out.put({"verdict_at": store.verdict_at, "report_at": store.report_at, "added": _vm("VmHWM") - before,
             "text": verdict.text})


def run_world(world: int, mode: str) -> dict[str, Any]:
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, world + 1, True, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT_S))
    base = f"bench/{mode}/{world}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=_rank0, args=(server.port, world, mode, base, q))
    child.start()
    # Healthy ranks of one local index hold the same records: build one per index, plus the faulty ones.
    templates = {i: llama70b_report(i, world) for i in range(min(8, world))}
    reports: dict[int, RankReport] = {}
    for r in range(1, world):
        if r in _faults(world).values():
            reports[r] = _report(r, world)
        else:
            t = templates[r % 8]
            reports[r] = RankReport(r, world, f"node{r // 8:03d}", t.compute_device, t.engine, t.versions, t.config_digest,
                                    t.records, t.param_numels, t.zero3_partitions, t.zero3_partition_ranks, t.unmanaged)
    clients = {r: _Timed(TCPStore("127.0.0.1", server.port, world + 1, False, timeout=timedelta(seconds=TIMEOUT_S)), r)
               for r in reports}
    texts: dict[int, str] = {}

    def rank(r: int) -> None:
        if mode == "summary":
            texts[r] = exchange(clients[r], reports[r], world, TIMEOUT_S, base)[1].text
        else:
            texts[r] = full_report_exchange(clients[r], reports[r], world, TIMEOUT_S, base).text

    threads = [threading.Thread(target=rank, args=(r,)) for r in reports]
    for t in threads:
        t.start()
    zero = q.get(timeout=TIMEOUT_S + 60)
    for t in threads:
        t.join(TIMEOUT_S)
    child.join(60)
    texts[0] = zero["text"]
    last_report = max([zero["report_at"], *(c.report_at for c in clients.values())])
    healthy = [c.wrote for r, c in clients.items() if r not in _faults(world).values()]
    f = _faults(world)
    text = zero["text"]
    named = (MISPLACED in text and any(f"{MISPLACED}" in ln and f" {f['misplaced']} " in ln for ln in text.splitlines())
             and f"rank {f['dropped']} lacks 1 parameter(s) other ranks have: {DROPPED}" in text)
    return {
        "verdict_s": zero["verdict_at"] - last_report,
        "rank0_added_mib": zero["added"] / 2**20,
        "bytes_per_rank": int(statistics.median(healthy)) if healthy else 0,
        "faults_named": bool(named and len(set(texts.values())) == 1 and len(texts) == world),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, nargs="+", default=[8, 64, 256, 1024])
    ap.add_argument("--json", action="store_true", help="print a JSON list, one object per world")
    ap.add_argument("--no-baseline", action="store_true", help="skip the full-report exchange (slow at 1,024)")
    args = ap.parse_args(argv)
    rows = []
    for world in args.world:
        if world < 8:
            ap.error("--world: at least 8 (the faults sit on ranks world-3 and world/2)")
        row: dict[str, Any] = {"world": world, **run_world(world, "summary")}
        if not args.no_baseline:
            base = run_world(world, "full")
            row.update({"baseline_verdict_s": base["verdict_s"], "baseline_rank0_added_mib": base["rank0_added_mib"],
                        "baseline_bytes_per_rank": base["bytes_per_rank"], "baseline_faults_named": base["faults_named"]})
        rows.append(row)
        if not args.json:
            print(f"world {world:5d}: verdict {row['verdict_s']:.3f} s, rank-0 +{row['rank0_added_mib']:.1f} MiB, "
                  f"{row['bytes_per_rank']:,} B/rank, faults named: {row['faults_named']}"
                  + ("" if args.no_baseline else
                     f"  | full reports: {row['baseline_verdict_s']:.3f} s, +{row['baseline_rank0_added_mib']:.1f} MiB, "
                     f"{row['baseline_bytes_per_rank']:,} B/rank (x{row['baseline_verdict_s'] / max(row['verdict_s'], 1e-9):.0f} "
                     "slower)"), flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print("\n| world | verdict s | rank-0 added MiB | bytes/rank | faults named | full reports: verdict s | added MiB | bytes/rank |")
        print("|---:|---:|---:|---:|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['world']} | {r['verdict_s']:.3f} | {r['rank0_added_mib']:.1f} | {r['bytes_per_rank']:,} | "
                  f"{r['faults_named']} | {r.get('baseline_verdict_s', float('nan')):.2f} | "
                  f"{r.get('baseline_rank0_added_mib', float('nan')):.0f} | {r.get('baseline_bytes_per_rank', 0):,} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
