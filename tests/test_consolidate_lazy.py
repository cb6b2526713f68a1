"""A split consolidate reads its ZeRO-3 source lazily (ops/consolidate.py: ``read_zero3(lazy=True)`` under
srun/torchrun): a process parses a rank file only when its window asks for one of the file's pieces, its
copier threads parse each file once between them, and a damaged rank file is still named, with nothing
published. benchmarks/bench_zero3_reader.py --split measures the files each process parses."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench_reshard_plan import synthetic_checkpoint
from shardkit.checkpoint.readers.zero3 import describe_zero3
from tests import test_reshard_parallel as reshard_tests
from tests._ports import job_port
from tests.test_consolidate_parallel import NAME, _finish, _start
from tests.test_reshard_parallel import _nothing_published

sources = reshard_tests.sources


def _counted_reader(world: int, pause_s: float = 0.0) -> tuple[Any, Any, dict[int, int]]:
    """A synthetic ``world``-rank 70B ZeRO-3 layout and a reader that counts each rank file's parses."""
    ckpt, optim = synthetic_checkpoint(world)
    by_path = {p: r for r, p in enumerate(ckpt.optim_files)}
    parses: dict[int, int] = {}
    lock = threading.Lock()

    def read(path: Path) -> Any:
        rank = by_path[path]
        with lock:
            parses[rank] = parses.get(rank, 0) + 1
        time.sleep(pause_s)  # a parse long enough for every thread to ask for the file while it runs
        return optim(rank)

    return ckpt, read, parses


def test_a_lazy_read_parses_only_the_rank_files_a_window_asks_for():
    ckpt, read, parses = _counted_reader(64)
    model = describe_zero3(ckpt, lazy=True, read=read)
    assert parses == {0: 1}  # rank 0's optim file describes the layout
    embed = max(model.weights.values(), key=lambda t: t.numel)
    got = list(embed.pieces_in(0, embed.numel // 8))  # one eighth of the largest tensor: the first 8 ranks' pieces
    assert [p.file for p in got] == ckpt.optim_files[:8]
    assert parses == dict.fromkeys(range(8), 1)


def test_copier_threads_of_a_lazy_read_parse_each_rank_file_once():
    """Without RankFiles' per-rank lock, threads asking for the same rank at once each parsed its file."""
    ckpt, read, parses = _counted_reader(8, pause_s=0.05)
    model = describe_zero3(ckpt, lazy=True, read=read)
    tensor = max(model.weights.values(), key=lambda t: t.numel)
    start = threading.Barrier(6)
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            start.wait(timeout=30)
            assert len(list(tensor.pieces_in(0, tensor.numel))) == 8
        except BaseException as exc:  # noqa: BLE001 - raised in the test below
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert parses == dict.fromkeys(range(8), 1)


@pytest.mark.slow
def test_a_damaged_rank_file_is_named_by_a_split_run_and_nothing_is_published(sources, tmp_path):
    """A plain save (no manifest: nothing hashed before reading): rank 1's optim file cut short is found
    while the processes copy, not before, and the run fails naming it; the staged output is removed."""
    src = tmp_path / "src"
    shutil.copytree(sources["fp32"], src)
    victim = next((src / (src / "latest").read_text().strip()).glob("*rank_1_*optim_states.pt"))
    with open(victim, "r+b") as fh:
        fh.truncate(victim.stat().st_size // 2)
    out, port = tmp_path / "out", job_port()
    results = _finish([_start(r, 2, src, out, port) for r in range(2)])
    assert results[0][0] == 1, results
    assert str(victim) in results[0][2], results[0][2]  # rank 0's own finding, or rank 1's report of it
    _nothing_published(out)
    assert not (out / NAME).exists()
