"""A rank that has printed nothing for long says what it is waiting for.

The silent hangs users report are a handful of waits that never time out or time out after many
minutes, all without a word: the build lock of a DeepSpeed op (torch's ``FileBaton.wait`` polls
forever; pytorch#189245, DeepSpeedExamples#302), a rendezvous or store some rank never reaches,
and a collective another rank never calls. Each rank runs :class:`RankWatchdog`, a daemon thread
that samples the main thread's Python stack once a second; once the rank has been silent for
``SHARDKIT_SILENCE_S`` seconds (default :data:`DEFAULT_SILENCE_S`, 0 turns it off) it prints one
line naming where it waits, the likely cause and the fix (:func:`explain`), and leaves it in a
status file the parent reads (:class:`SilenceReporter`, one line naming every silent rank).

"Silent" means: nothing written to its stdout/stderr (Python writes; and where they are files,
as in `shardkit smoke`/`preflight`, their size, so C++ output counts too), and the main thread
either in a known wait or in the very same call throughout (a loop that prints nothing but moves
on is not reported). The first matching frame, innermost first, names the wait (:func:`classify`).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Mapping, TextIO

from shardkit.core.env_settings import read_seconds
from shardkit.platform.environment.ext_lock import describe, inspect_locks

ENV_SILENCE_S = "SHARDKIT_SILENCE_S"
#: Long enough that a healthy op build step, model load or first step seldom trips it, short
#: enough that a user waiting on a hang hears about it before giving up.
DEFAULT_SILENCE_S = 120.0
STATUS_SUFFIX = ".silent.json"

# torch.distributed functions whose call blocks until every rank of the group calls it too.
_COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "_all_gather_base",
    "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "broadcast_object_list",
    "barrier", "monitored_barrier", "reduce", "gather", "gather_object", "scatter", "scatter_object_list",
    "all_to_all", "all_to_all_single", "send", "recv", "batch_isend_irecv", "all_reduce_coalesced", "new_group",
})
# distributed_c10d functions that wait for the other ranks to join the group (store, mesh connect).
_RENDEZVOUS = frozenset({"init_process_group", "_new_process_group_helper", "_store_based_barrier", "init_device_mesh"})


def silence_s(environ: Mapping[str, str] | None = None, *, during_run: bool = False) -> float:
    """Seconds of silence before a rank speaks (``SHARDKIT_SILENCE_S``; 0: never). A value that is not
    seconds is refused naming it (the CLI, before work starts), or, ``during_run`` (a rank already
    running), warned about once and the default used: stopping a rank over its watchdog loses the run."""
    return read_seconds(ENV_SILENCE_S, DEFAULT_SILENCE_S, environ, during_run=during_run)


@dataclass(frozen=True)
class Wait:
    """Where a silent rank's main thread is, and what kind of wait that is."""

    kind: str
    """build-lock, building, rendezvous, collective, or unknown (no known wait: just the place)."""
    where: str
    """The innermost frame that names it: ``function (file:line)``."""
    detail: str = ""
    """The lock file, the op, the collective's name, or the rendezvous' init method."""


def _where(frame: FrameType) -> str:
    return f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"


def _path_is(frame: FrameType, *tails: str) -> bool:
    name = frame.f_code.co_filename.replace(os.sep, "/")
    return any(name.endswith(t) for t in tails)


def _called_from(frame: FrameType | None, *names: str) -> bool:
    while frame is not None:
        if frame.f_code.co_name in names and _path_is(frame, "torch/distributed/distributed_c10d.py"):
            return True
        frame = frame.f_back
    return False


def _init_method(frame: FrameType | None) -> str:
    """The init_method the group is being formed with (init_process_group's argument, outward)."""
    while frame is not None:
        if frame.f_code.co_name == "init_process_group" and frame.f_locals.get("init_method"):
            return f"init_method {frame.f_locals['init_method']}"
        frame = frame.f_back
    return ""


def classify(frame: FrameType | None) -> Wait:
    """The wait a stack is in, from its innermost frame outwards; ``unknown`` (at the innermost
    frame) when no frame is a known wait."""
    f = frame
    while f is not None:
        fn = f.f_code.co_name
        if fn == "wait" and _path_is(f, "torch/utils/file_baton.py"):
            baton = f.f_locals.get("self")
            return Wait("build-lock", _where(f), str(getattr(baton, "lock_file_path", "")))
        if fn in ("_run_ninja_build", "_write_ninja_file_and_build_library") and _path_is(f, "torch/utils/cpp_extension.py"):
            return Wait("building", _where(f), str(f.f_locals.get("build_directory") or ""))
        if _path_is(f, "torch/distributed/distributed_c10d.py"):
            if fn in _COLLECTIVES:
                return Wait("collective", _where(f), fn)
            if fn in _RENDEZVOUS:
                if _called_from(f, "new_group", "new_subgroups", "new_subgroups_by_enumeration"):
                    # a subgroup after the group exists (DeepSpeed makes several): every rank must call it
                    return Wait("collective", _where(f), "new_group")
                return Wait("rendezvous", _where(f), _init_method(f))
        if _path_is(f, "torch/distributed/rendezvous.py") or "torch/distributed/elastic/rendezvous/" in f.f_code.co_filename:
            return Wait("rendezvous", _where(f), str(f.f_locals.get("url") or ""))
        f = f.f_back
    return Wait("unknown", _where(frame) if frame is not None else "?")


def explain(rank: int, seconds: float, wait: Wait) -> str:
    """The one line a silent rank prints: where it waits, the likely cause, and the fix."""
    head = f"shardkit: rank {rank} has printed nothing for {seconds:.0f} s"
    if wait.kind == "build-lock":
        locks = [lk for lk in inspect_locks(root=Path(wait.detail).parent.parent, during_run=True)
                 if str(lk.path) == wait.detail]
        state = describe(locks[0]) if locks else f"the lock {wait.detail} is gone now: the wait should end"
        return f"{head}: waiting for the DeepSpeed/torch op build lock {wait.detail}: {state}"
    if wait.kind == "building":
        return (f"{head}: building a DeepSpeed/torch op in {wait.detail} (ninja, in {wait.where}); the other ranks "
                "wait for its lock. A first build takes minutes; later runs load it from the cache. Fix: none "
                "needed; if it never ends, the compiler may be short of memory (set MAX_JOBS=2)")
    if wait.kind == "rendezvous":
        how = f" ({wait.detail})" if wait.detail else ""
        return (f"{head}: waiting at the rendezvous{how} in {wait.where}: not every rank has joined. Likely: a rank that "
                "crashed or is still starting (building ops, loading the model), MASTER_ADDR:MASTER_PORT that another "
                "node cannot reach, or GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME naming an interface not routed between "
                "nodes. Fix: look at the other ranks' output first; check the address, port and interface from every node")
    if wait.kind == "collective":
        return (f"{head}: blocked in the collective {wait.detail} ({wait.where}): another rank has not called it. "
                "Likely: a rank that died or waits elsewhere (its own line says where), or ranks calling collectives "
                "in a different order or number (a rank-dependent branch). Fix: compare the ranks' lines; rerun with "
                "TORCH_DISTRIBUTED_DEBUG=DETAIL to have torch name mismatched collectives")
    return (f"{head} and has been in the same call all along: {wait.where}; not a known wait (build lock, rendezvous, "
            "collective). Fix: if that call should not take this long, `py-spy dump --pid "
            f"{os.getpid()}` shows every thread of this rank")


def _stack_key(frame: FrameType | None) -> tuple[tuple[str, str, int], ...]:
    """The stack as code identities and lines: unchanged only while the thread stays in one call."""
    out = []
    while frame is not None:
        out.append((frame.f_code.co_filename, frame.f_code.co_name, frame.f_lineno))
        frame = frame.f_back
    return tuple(out)


def _file_sizes() -> tuple[int, ...]:
    """Sizes of fd 1 and 2 where they are this rank's own files (its log): C++ output counts too.
    A file the parent writes too (``> job.log`` for every rank) grows with the others' lines, so
    only files the parent does not have open as its own fd 1/2 count."""
    sizes = []
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if (st.st_mode & 0o170000) != 0o100000:
            continue
        try:
            parent = [os.stat(f"/proc/{os.getppid()}/fd/{n}") for n in (1, 2)]
        except OSError:
            parent = []
        if not any((p.st_dev, p.st_ino) == (st.st_dev, st.st_ino) for p in parent):
            sizes.append(st.st_size)
    return tuple(sizes)


class RankWatchdog:
    """The per-rank daemon thread: samples the main thread's stack and output once a second and
    speaks once per silent stretch (again only after the rank has printed or moved on)."""

    def __init__(self, rank: int, status_dir: str | Path | None, after_s: float, *, interval_s: float = 1.0,
                 out: TextIO | None = None) -> None:
        self.rank = rank
        self.status = Path(status_dir) / f"rank{rank}{STATUS_SUFFIX}" if status_dir else None
        self.after_s = after_s
        self.interval_s = interval_s
        self.out = out
        self._writes = 0
        self._stop = threading.Event()

    def start(self) -> "RankWatchdog":
        if self.after_s <= 0:
            return self
        self._count_python_writes()
        threading.Thread(target=self._run, name="shardkit-silence-watchdog", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _count_python_writes(self) -> None:
        # An instance attribute shadows TextIOWrapper.write for print() and every Python caller
        # while sys.stdout stays the same object (isinstance checks, fileno, reconfigure all hold).
        for stream in (sys.stdout, sys.stderr):
            original = getattr(stream, "write", None)
            if original is None or getattr(original, "_shardkit_counted", False):
                continue

            def write(text: Any, _original: Callable[[Any], int] = original) -> int:
                self._writes += 1
                return _original(text)

            write._shardkit_counted = True  # type: ignore[attr-defined]
            try:
                stream.write = write  # type: ignore[method-assign]
            except (AttributeError, TypeError):
                pass  # a stream without an instance dict: only the file-size signal counts there

    def _run(self) -> None:
        main = threading.main_thread().ident
        last: tuple[Any, ...] | None = None
        since = time.monotonic()
        spoke = False
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(main) if main is not None else None
            if frame is None:
                return  # the main thread ended
            wait = classify(frame)
            # a known wait counts as one place however its poll loop moves; elsewhere the exact stack
            place = (wait.kind, wait.detail) if wait.kind != "unknown" else _stack_key(frame)
            del frame
            state = (place, self._writes, _file_sizes())
            now = time.monotonic()
            if state != last:
                last, since = state, now
                if spoke:
                    spoke = False
                    self._clear()
                continue
            if not spoke and now - since >= self.after_s:
                spoke = True
                self._speak(explain(self.rank, now - since, wait), wait, now - since)
                last = (place, self._writes, _file_sizes())  # our own line is not the rank speaking

    def _speak(self, line: str, wait: Wait, seconds: float) -> None:
        try:
            print(line, file=self.out or sys.stderr, flush=True)
        except (OSError, ValueError):
            pass  # stderr closed or gone (a launcher that exited): the status file still carries it
        if self.status is not None:
            tmp = self.status.with_suffix(".tmp")
            try:
                tmp.write_text(json.dumps({"rank": self.rank, "seconds": round(seconds), "line": line, **asdict(wait)}))
                os.replace(tmp, self.status)
            except OSError:
                pass

    def _clear(self) -> None:
        if self.status is not None:
            self.status.unlink(missing_ok=True)


def start_rank_watchdog(rank: int, status_dir: str | Path | None = None,
                        environ: Mapping[str, str] | None = None) -> RankWatchdog:
    """Start this rank's watchdog with ``SHARDKIT_SILENCE_S`` from ``environ`` (default os.environ)."""
    return RankWatchdog(rank, status_dir, silence_s(environ, during_run=True)).start()


def start_from_env() -> RankWatchdog | None:
    """For ranks started by a launcher (torchrun/deepspeed set RANK): start the watchdog, printing
    to the rank's stderr. Meant for interpreter start-up (shardkit's sitecustomize)."""
    rank = os.environ.get("RANK")
    if rank is None or not rank.isdigit():
        return None
    return start_rank_watchdog(int(rank))


class SilenceReporter:
    """The parent's side: reads the ranks' status files and prints one line when the set of silent
    ranks changes, naming each with its cause, and for a rendezvous which ranks are in it."""

    def __init__(self, status_dir: str | Path, world_size: int, out: TextIO | None = None) -> None:
        self.dir = Path(status_dir)
        self.world_size = world_size
        self.out = out
        self._said: frozenset[tuple[int, str]] = frozenset()
        self._next = 0.0

    def poll(self) -> str | None:
        """Check at most once a second; returns the line printed, if any."""
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + 1.0
        silent: dict[int, dict[str, Any]] = {}
        for path in self.dir.glob(f"rank*{STATUS_SUFFIX}"):
            try:
                data = json.loads(path.read_text())
                silent[int(data["rank"])] = data
            except (OSError, ValueError, KeyError, TypeError):
                continue
        key = frozenset((r, d.get("kind", "")) for r, d in silent.items())
        if not silent or key <= self._said:
            self._said = key if not silent else self._said
            return None
        self._said = key
        ranks = sorted(silent)
        parts = [silent[r]["line"].removeprefix("shardkit: ") for r in ranks]
        at_rdzv = [r for r in ranks if silent[r].get("kind") == "rendezvous"]
        if at_rdzv:
            others = [r for r in range(self.world_size) if r not in at_rdzv]
            parts.append(f"rendezvous not complete: rank(s) {at_rdzv} wait in it, rank(s) {others} have not joined")
        line = f"shardkit: silent rank(s) {ranks} of {self.world_size}: " + " | ".join(parts)
        print(line, file=self.out or sys.stderr, flush=True)
        return line


class LockWatch:
    """For `shardkit launch`, whose ranks' output goes straight to the terminal: while the launcher
    runs, look at the ranks' extensions cache every few seconds and, once the launch is
    ``after_s`` old, say once per lock when a build lock the ranks would wait on is stale (its
    builder was killed during this run: every other rank now waits forever) or a build has held it
    for longer than ``after_s``."""

    def __init__(self, environ: Mapping[str, str], after_s: float, *, interval_s: float = 5.0,
                 out: TextIO | None = None, prefix: str = "shardkit launch") -> None:
        self.environ = dict(environ)
        self.after_s = after_s
        self.interval_s = min(interval_s, max(after_s, 0.5))
        self.out = out
        self.prefix = prefix
        self._stop = threading.Event()
        self._said: set[tuple[str, str]] = set()
        self._thread: threading.Thread | None = None

    def start(self) -> "LockWatch":
        if self.after_s > 0:
            self._thread = threading.Thread(target=self._run, name="shardkit-lock-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def check(self) -> list[str]:
        """One look: the lines to say now (each lock and verdict once)."""
        lines = []
        for lock in inspect_locks(self.environ, during_run=True):  # the launch is running: warn, never stop it
            key = (str(lock.path), lock.verdict)
            if key in self._said or (lock.verdict != "stale" and lock.age_s < self.after_s):
                continue
            self._said.add(key)
            lines.append(f"{self.prefix}: ranks that load this op wait while the lock exists: {describe(lock)}")
        return lines

    def _run(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(self.interval_s):
            if time.monotonic() - started < self.after_s:
                continue
            try:
                lines = self.check()
            except OSError:
                continue
            for line in lines:
                print(line, file=self.out or sys.stderr, flush=True)
