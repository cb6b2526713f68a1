"""Damage a checkpoint file the way a bad disk or copy does, for tests of what verification catches."""

from __future__ import annotations

from pathlib import Path


def flip_a_byte(f: Path) -> None:
    """Same size, one bit different (the middle byte): only the content digest can tell."""
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.seek(size // 2)
        b = fh.read(1)
        fh.seek(size // 2)
        fh.write(bytes([b[0] ^ 0x01]))
    assert f.stat().st_size == size


def fifo_swapped_in_after_a_check(monkeypatch, target: Path) -> None:
    """A writer that replaces ``target`` by a FIFO right after a reader's ``Path.is_file()`` says it
    is a regular file: the check-then-open race of a reader that trusts a stat."""
    import os

    real_is_file = Path.is_file

    def is_file(self: Path, *args, **kwargs) -> bool:
        ok = real_is_file(self, *args, **kwargs)
        if ok and self == target:
            target.unlink()
            os.mkfifo(target)
        return ok

    monkeypatch.setattr(Path, "is_file", is_file)


def call_without_blocking(fn, fifo: Path, timeout: float = 10.0):
    """``fn()``'s result (or its exception), failing the test when it blocks on ``fifo`` (a reader
    that opened a FIFO waits for a writer forever: one is opened and closed here to release it)."""
    import os
    import threading

    import pytest

    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # EOF for the blocked reader
        t.join(5)
        pytest.fail(f"the reader blocked on the FIFO {fifo} for {timeout} s")
    if "error" in out:
        raise out["error"]
    return out["value"]
