"""shardkit.core.progress: what a progress line says, when it is printed, and that the writers' one
callback reaches it from any thread."""

from __future__ import annotations

import io
import threading
import time

import pytest

from shardkit.core import progress


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_line_says_bytes_done_of_total_rate_and_time_left():
    clock = _Clock()
    meter = progress.ByteProgress("shardkit reshard", clock=clock)
    meter.expect(4 * 2**30)
    meter.advance(2**30)
    clock.now += 4.0
    assert meter.line() == "shardkit reshard: 1.0 GiB of 4.0 GiB (25%), 256.0 MiB/s, 12 s left"


def test_without_a_total_the_line_has_no_percentage_or_time_left():
    clock = _Clock()
    meter = progress.ByteProgress("shardkit convert", clock=clock)
    meter.advance(3 * 2**20)
    clock.now += 1.0
    assert meter.line() == "shardkit convert: 3.0 MiB, 3.0 MiB/s"


def test_under_a_launcher_rank_0_reports_its_share_times_the_processes_and_says_so():
    clock = _Clock()
    meter = progress.ByteProgress("shardkit reshard", processes=4, clock=clock)
    meter.expect(2**30)
    meter.advance(2**29)
    clock.now += 2.0
    line = meter.line()
    assert line.startswith("shardkit reshard: 2.0 GiB of 4.0 GiB (50%), 1.0 GiB/s, 2 s left")
    assert "estimated for 4 processes: this process's share x 4" in line


def test_plain_lines_every_interval_then_a_closing_line_on_the_stream_given():
    out = io.StringIO()
    with progress.reporting("shardkit export", stream=out, interval=0.05, live=False):
        progress.expect(1000)
        progress.advance(100)
        # the run lasts until the reporter has printed (bounded), not a fixed 0.3 s: a loaded 2-core
        # CI box may not wake the reporter's thread within a fixed run that short
        deadline = time.monotonic() + 30
        while not out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        progress.advance(900)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 2, lines  # at least one line while it ran, and the closing one
    assert lines[-1].startswith("shardkit export: 1000 B of 1000 B (100%)") and "(done after" in lines[-1]


def test_quiet_and_other_ranks_print_nothing_but_still_count():
    for kwargs in ({"quiet": True}, {"rank": 1, "processes": 2}):
        out = io.StringIO()
        with progress.reporting("shardkit reshard", stream=out, interval=0.01, live=False, **kwargs) as meter:
            progress.advance(10)
            time.sleep(0.05)
        assert out.getvalue() == ""
        assert meter._done == 10


def test_a_failed_run_says_stopped_not_done():
    out = io.StringIO()
    try:
        with progress.reporting("shardkit reshard", stream=out, interval=10, live=False):
            progress.advance(5)
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert "(stopped after" in out.getvalue() and "done" not in out.getvalue()


def test_writer_threads_advance_one_meter_and_nothing_counts_outside_a_command():
    progress.advance(123)  # no command reporting: a no-op, not an error
    with progress.reporting("x", quiet=True) as meter:
        threads = [threading.Thread(target=lambda: [progress.advance(1) for _ in range(10_000)]) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert meter._done == 40_000
    assert progress._ACTIVE is None


def test_the_hashing_writer_reports_every_byte_it_writes(tmp_path):
    from shardkit.storage.torch_zip import HashingWriter

    with progress.reporting("x", quiet=True) as meter, open(tmp_path / "f", "wb") as fh:
        w = HashingWriter(fh)
        w.write(b"a" * 1000)
        w.write(memoryview(bytearray(24)))
    assert meter._done == 1024 == (tmp_path / "f").stat().st_size


def test_rank_0_adds_up_the_other_processes_heartbeats_or_scales_what_it_heard():
    clock = _Clock()
    meter = progress.ByteProgress("shardkit reshard", processes=3, clock=clock)
    meter.expect(100)
    meter.advance(50)
    clock.now += 1.0
    meter.peers = lambda: [(20, 100)]  # one of the two others has beaten
    assert meter.job() == (105, 300, " (estimated for 3 processes: the 2 processes heard from so far, scaled to 3)")
    meter.peers, meter._peers_read = (lambda: [(20, 100), (100, 100)]), None
    assert meter.job() == (170, 300, " (all 3 processes, from their heartbeat files)")
    assert meter.line().startswith("shardkit reshard: 170 B of 300 B (57%), 170 B/s")


def test_the_heartbeat_carries_the_counts_to_rank_0(tmp_path):
    from shardkit.storage.shared_save import heartbeat

    with progress.reporting("x", quiet=True, rank=1, processes=2):
        progress.expect(1000)
        progress.advance(400)
        with heartbeat(tmp_path, 1):
            pass
    assert (tmp_path / ".shardkit-alive-1").read_text().split() == ["400", "1000"]
    with progress.reporting("x", quiet=True, rank=0, processes=2) as meter:
        progress.expect(1000)
        progress.advance(1000)
        with heartbeat(tmp_path, 0):
            assert meter.job()[:2] == (1400, 2000)
        assert meter.job()[:2] == (1400, 2000)  # what the peers last said is kept once the heartbeat ends


# --- the contract: binary units, done never past the total, the time taken at the end -------------------

def test_bytes_no_plan_counted_grow_the_total_with_the_bytes_done():
    clock = _Clock()
    meter = progress.ByteProgress("shardkit reshard", clock=clock)
    meter.expect(3 * 2**20)  # the tensor data a writer planned
    meter.advance(3 * 2**20)
    meter.grow(2**19)  # headers and pickles around it, counted as they are written
    clock.now += 2.0
    assert meter.line() == "shardkit reshard: 3.5 MiB of 3.5 MiB (100%), 1.8 MiB/s, 0 s left"
    meter.outcome = "done"
    assert meter.line() == "shardkit reshard: 3.5 MiB of 3.5 MiB (100%), 1.8 MiB/s (done after 2 s)"


def test_a_torch_zip_counts_its_storages_as_planned_and_the_rest_as_grown(tmp_path):
    from shardkit.storage.torch_zip import write_torch_zip

    data = bytes(range(256)) * 1000
    with progress.reporting("x", quiet=True) as meter:
        progress.expect(len(data))
        write_torch_zip(tmp_path / "f.pt", b"not a real pickle", [("0", data)])
    size = (tmp_path / "f.pt").stat().st_size
    assert meter.job()[:2] == (size, size) and size > len(data)


def _closing(err: str, label: str) -> str:
    return [ln for ln in err.splitlines() if ln.startswith(f"{label}: ")][-1]


def _done_and_total(line: str) -> tuple[float, float]:
    import re

    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    m = re.match(r"[^:]+: ([\d.]+) (\w+) of ([\d.]+) (\w+) \(", line)
    assert m, line
    return float(m.group(1)) * units[m.group(2)], float(m.group(3)) * units[m.group(4)]


@pytest.mark.slow
def test_every_route_ends_at_its_total_in_binary_units(run_cli, tmp_path):
    # reshard to the same world size copies the rank files and carries zero_to_fp32.py beside them; to
    # another it writes new ones; convert writes DCP files, its small file and .metadata. Each once
    # ended past its total ("1.8 MiB of 1.7 MiB"): the carried files, zip headers, pickles and the small
    # file were counted as done and never expected
    from tests import _ranks_zero3 as R

    source = R.build_sources(tmp_path.parent.parent / "zero3")["fp32"]
    runs = [("shardkit reshard", ("reshard", source, "--world-size", "2", "-o", tmp_path / "same")),
            ("shardkit reshard", ("reshard", source, "--world-size", "3", "-o", tmp_path / "ws3")),
            ("shardkit convert", ("convert", source, "--to", "fsdp2", "-o", tmp_path / "dcp"))]
    for label, argv in runs:
        code, out, err = run_cli(*argv)
        assert code == 0, err
        line = _closing(err, label)
        done, total = _done_and_total(line)
        assert done == total, line
        assert "MiB/s (done after" in line or "KiB/s (done after" in line, line
        assert " left" not in line and "MB/s" not in line, line


def test_on_a_terminal_the_bar_speaks_binary_units_and_ends_with_the_time_taken():
    import os
    import pty
    import re

    master, replica = pty.openpty()
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    term = os.fdopen(replica, "w", buffering=1)
    try:
        assert term.isatty()
        with progress.reporting("shardkit reshard", stream=term):  # live: the stream is a terminal
            progress.expect(3 * 2**20)
            for _ in range(6):
                progress.advance(2**19)
                time.sleep(0.25)
        time.sleep(0.3)
    finally:
        term.close()
        reader.join(timeout=5)
        os.close(master)
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))
    last = [ln for ln in re.split(r"[\r\n]+", screen) if "shardkit reshard" in ln][-1]
    assert "3.0 MiB of 3.0 MiB (100%)" in last and "MiB/s (done after" in last, last
    assert "MB/s" not in screen and "0:00:00" not in screen, screen[-500:]
