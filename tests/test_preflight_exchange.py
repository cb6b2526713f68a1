"""The preflight's store exchange at many ranks in one process: a real TCPStore server, one client
per simulated rank (threads), 70B-Llama-shaped ZeRO-3 reports (benchmarks/_llama_reports.py).

What a user would notice: every rank gets the same verdict; a misplaced tensor and a missing
parameter are named with their rank; a healthy rank ships a few hundred bytes, not its records;
a rank that never arrives is named within the timeout; no store key is left behind.
"""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from _llama_reports import DROPPED, MISPLACED, llama70b_report  # noqa: E402

from shardkit.placement.preflight import exchange  # noqa: E402
from shardkit.placement.summary import summarize  # noqa: E402


def _run(world: int, reports: dict[int, Any], timeout: float = 30.0, show: Any = None) -> tuple[dict[int, Any], int]:
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, world + 1, True, wait_for_workers=False)
    clients = {r: TCPStore("127.0.0.1", server.port, world + 1, False) for r in reports}
    before = server.num_keys()  # the store's own bookkeeping keys
    out: dict[int, Any] = {}

    def rank(r: int) -> None:
        try:
            out[r] = exchange(clients[r], reports[r], world, timeout, "shardkit/preflight/0",
                              show=(lambda rep, v: show(clients[r], rep, v)) if show and r == 0 else None)
        except Exception as exc:  # recorded, asserted by the caller
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in reports]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 90)
    return out, server.num_keys() - before


def test_faults_are_named_the_same_on_every_rank_and_no_key_is_left():
    world = 16
    reports = {r: llama70b_report(r, world, misplaced=r == world - 3, drop=r == world // 2) for r in range(world)}
    out, left = _run(world, reports)
    texts = {r: v.text for r, (_, v) in out.items()}
    assert len(set(texts.values())) == 1, "ranks got different verdicts"
    text = texts[0]
    assert not out[0][1].ok
    # the table row: what, actual, expected, rank (rank 13 computes on cuda:5 of its node)
    assert re.search(rf"{re.escape(MISPLACED)}\s+cuda:5\s+cpu\s+{world - 3}\s+[\d,]+", text), text
    assert f"rank {world // 2} lacks 1 parameter(s) other ranks have: {DROPPED}." in text
    report0 = out[0][0]
    assert [s.rank for s in report0.summaries] == list(range(world))
    assert [rep.rank for rep in report0.ranks] == [0]  # rank 0 never holds a peer's records
    assert left == 0, f"{left} store key(s) left behind"


def test_rank_0_shows_a_failed_table_before_any_other_rank_can_read_the_verdict():
    """The other ranks exit the moment they read a failed verdict and their launcher (torchrun's
    agent) then SIGTERMs rank 0: a table printed after publishing was lost on two Slurm nodes."""
    world = 4
    reports = {r: llama70b_report(r, world, misplaced=r == 3) for r in range(world)}
    shown: list[tuple[bool, bool]] = []

    def show(store: Any, report: Any, verdict: Any) -> None:
        shown.append((verdict.ok, store.check(["shardkit/preflight/0/verdict"])))

    out, left = _run(world, reports, show=show)
    assert shown == [(False, False)], shown  # shown once, while the verdict was not yet readable
    assert all(not v.ok for _, v in out.values()) and left == 0


def test_healthy_ranks_ship_a_summary_and_pass():
    world = 8
    reports = {r: llama70b_report(r, world) for r in range(world)}
    out, left = _run(world, reports)
    assert all(v.ok for _, v in out.values())
    assert len(summarize(reports[1]).encode()) < 4096
    assert "deepspeed-zero3, 8 rank(s), 28920 tensors): ok" in out[0][0].render()
    assert left == 0, f"{left} store key(s) left behind"


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_rank_that_never_arrives_is_named_within_the_timeout():
    world = 4
    reports = {r: llama70b_report(r, world) for r in range(world) if r != 2}
    out, _ = _run(world, reports, timeout=3.0)
    texts = {v.text for _, v in out.values()}
    assert len(texts) == 1
    assert next(iter(texts)).startswith("ranks [2] of 4 did not reach the placement preflight within 3s")
