"""Checkpoints built once per test run and shared, read-only, by every xdist worker.

Under ``pytest -n 2`` each worker is a process with a session of its own, so a session-scoped
fixture runs once per worker: the shared 2-rank DeepSpeed saves (30-60 s each on 2 loaded cores)
were paid for twice. ``built_once`` runs a build in the first worker that asks for it, under a file
lock in the folder all workers of one run share (the controller's basetemp, which holds each
worker's ``popen-gwN``); the other worker waits on the lock and reads the same folder.

Shared means read-only: a test that changes a file copies the checkpoint first
(``shutil.copytree`` into ``tmp_path``). ``built_once`` checks, each time it hands a folder out,
that no file in it changed since it was built, and names the files that did: a test that wrote into
a shared checkpoint would otherwise break another worker's tests at random.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest


def across_workers(path: Path) -> Path:
    """``path`` moved out of this xdist worker's own folder into the run's shared one.

    xdist gives worker ``gwN`` the basetemp ``<run>/popen-gwN``; ``<run>/popen-gw0/zero3`` becomes
    ``<run>/zero3``. Outside xdist, or for a path not under the worker's folder, ``path`` itself.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return path
    parts = path.parts
    own = f"popen-{worker}"
    if own not in parts:
        return path
    i = parts.index(own)
    return Path(*parts[:i], *parts[i + 1:])


def _signature(folder: Path) -> dict[str, list[int]]:
    """relative path -> [size, mtime_ns] of every entry under ``folder`` (links not followed)."""
    out: dict[str, list[int]] = {}
    if not folder.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in (*dirnames, *filenames):
            p = Path(dirpath, name)
            st = p.lstat()
            out[str(p.relative_to(folder))] = [st.st_size if not p.is_dir() else 0, st.st_mtime_ns]
    return out


def _changes(before: dict[str, list[int]], now: dict[str, list[int]]) -> list[str]:
    changed = [f"{k} (changed)" for k in sorted(before) if k in now and now[k] != before[k]]
    changed += [f"{k} (removed)" for k in sorted(before) if k not in now]
    changed += [f"{k} (added)" for k in sorted(now) if k not in before]
    return changed


def built_once(folder: Path, build: Callable[[Path], Any]) -> Any:
    """What ``build(folder)`` returned (a JSON value), the build run once per test run across workers.

    ``folder`` must lie in the run's shared folder (see ``across_workers``); ``build`` writes the
    checkpoint there. A failed build is recorded and raised again in every later caller, in either
    worker, instead of being paid for again; a skip (this machine cannot build it) is not recorded.
    """
    from filelock import FileLock

    folder.parent.mkdir(parents=True, exist_ok=True)
    done = folder.with_name(folder.name + ".built.json")
    failed = folder.with_name(folder.name + ".failed")
    with FileLock(str(folder) + ".lock"):
        if failed.is_file():
            raise RuntimeError(f"building the shared checkpoint {folder} failed earlier in this run: {failed.read_text()}")
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            try:
                value = build(folder)
            except pytest.skip.Exception:
                raise
            except BaseException as exc:
                failed.write_text(f"{type(exc).__name__}: {exc}")
                raise
            done.write_text(json.dumps({"value": value, "signature": _signature(folder)}))
    record = json.loads(done.read_text())
    changes = _changes(record["signature"], _signature(folder))
    if changes:
        raise AssertionError(
            f"the shared checkpoint {folder} changed after it was built: {', '.join(changes[:5])}"
            f"{' ...' if len(changes) > 5 else ''}. Every test of this run reads it, in both xdist "
            "workers; a test that changes files must copy it first (shutil.copytree into tmp_path)")
    return record["value"]
