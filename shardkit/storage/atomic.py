"""Crash-safe file operations: write under a temporary name in the same directory, fsync the file
and its directory, then ``os.replace`` (atomic on POSIX within one filesystem).

A plain ``torch.save(state, "ckpt.pt")`` over the only copy leaves a truncated file when the
process is killed mid-write; these helpers leave either the old file or the new one, never half.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import shutil
import signal
import threading
import uuid
from collections import deque
from pathlib import Path
from typing import IO, Any, Callable, Iterator, TypeVar

from shardkit.core.errors import CheckpointError
from shardkit.storage.tags import LATEST_NAME, REPLACED_MARK, STAGING_PREFIX, read_latest

F = TypeVar("F", bound=Callable[..., Any])

#: torch's zip writer (caffe2 inline_container.cc) reports a short fwrite only as a position
#: mismatch when the record or the archive is closed: "[enforce fail at inline_container.cc:672]
#: . unexpected pos 704 vs 598". No errno survives; on a local file a short write is a full disk
#: (or quota).
_TORCH_SHORT_WRITE = re.compile(r"inline_container\.cc.*(unexpected pos|file write failed)", re.S)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM off while the block runs (a clean-up), then deliver the first that came.

    Under torchrun a process that is already cleaning up after its own error is SIGTERMed as soon as
    another process exits, and the CLI turns SIGTERM into an exception: that exception cut
    ``shutil.rmtree`` of the staging folder short (CI: ``.shardkit-tmp-global_step2`` left by two
    processes given different world sizes). Outside the main thread (where Python runs signal
    handlers) the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    # the handlers are swapped with both signals blocked on this thread: one landing between the two
    # swaps ran the other's handler mid-swap, whose exception left SIGINT (or SIGTERM) ignored for the
    # rest of the run. The mask is not enough where another thread exists (the progress line's): the
    # kernel hands it the signal, and signal.signal runs the handler of a signal taken so before it
    # swaps; that handler's exception is kept, the swap finished, and it is raised after the block
    with _blocked(held):
        previous, raised = _swap({sig: lambda signum, _frame: came.append(signum) for sig in held})
    try:
        yield
    finally:
        with _blocked(held):
            _, late = _swap(previous)
        raised = raised or late
        if raised is not None:
            raise raised
        if came:
            signal.raise_signal(came[0])  # the handler the block held off now runs as it would have


def _swap(handlers: dict[int, Any]) -> tuple[dict[int, Any], BaseException | None]:
    """Install ``handlers``; (the ones they replaced, the first exception a signal's handler raised
    during the swap). Every handler is installed whatever a pending signal's handler raises: the
    exception lands as a call returns (signal.signal's, before its result is stored), so the handler
    replaced is read first (getsignal) and the whole swap is run again until it completes."""
    previous: dict[int, Any] = {}
    raised: BaseException | None = None
    while True:
        try:
            for sig, handler in handlers.items():
                if sig not in previous:
                    previous[sig] = signal.getsignal(sig)
                signal.signal(sig, handler)
            return previous, raised
        except (KeyboardInterrupt, SystemExit) as exc:
            raised = raised or exc

@contextlib.contextmanager
def _blocked(signals: tuple[signal.Signals, ...]) -> Iterator[None]:
    """``signals`` blocked by the OS for the block (main thread), then delivered: to the handlers in
    place by then, since Python looks a handler up when it runs it."""
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - Windows
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)

def is_disk_full(exc: BaseException) -> bool:
    """True for the errors a full disk (or an exhausted quota) surfaces as: OSError ENOSPC/EDQUOT,
    or torch's zip writer's short-write RuntimeError."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
    return isinstance(exc, RuntimeError) and bool(_TORCH_SHORT_WRITE.search(str(exc)))

def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes available to this user on the filesystem holding ``path`` (its nearest existing
    ancestor); None when it cannot be asked."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None

def disk_full_error(path: str | os.PathLike[str], exc: BaseException, outcome: str) -> CheckpointError:
    """The one message for a write that ran out of space: the file, the bytes left, what was kept."""
    free = free_bytes(path)
    left = f"{free:,} bytes free" if free is not None else "free space unknown"
    text = (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)).strip()
    detail = text.splitlines()[0] if text else type(exc).__name__
    return CheckpointError(
        f"disk full at {path}, {left}, {outcome} ({type(exc).__name__}: {detail}). Free space on that "
        "filesystem, or write to another disk, and run again"
    )

def os_errors_named(action: str) -> Callable[[F], F]:
    """Decorator: an OSError escaping the function (permission denied, disk full, a file vanishing
    under a reader) becomes a CheckpointError naming the path, instead of a traceback."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except OSError as exc:
                where = exc.filename if exc.filename is not None else "a checkpoint file"
                other = f" -> {exc.filename2}" if getattr(exc, "filename2", None) else ""
                raise CheckpointError(
                    f"{where}{other}: {action} failed ({type(exc).__name__}: {exc.strerror or exc}). Check that the "
                    "path exists and this user may read (and, for outputs, write) it, and that the disk has space"
                ) from exc

        return inner  # type: ignore[return-value]

    return wrap

@contextlib.contextmanager
def disk_full_named(path: str | os.PathLike[str], outcome: str) -> Iterator[None]:
    """A full disk while writing ``path`` becomes one CheckpointError naming it, the space left and
    ``outcome`` (what was kept); other errors pass through unchanged."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        if isinstance(exc, CheckpointError) or not is_disk_full(exc):
            raise
        raise disk_full_error(path, exc, outcome) from exc

# os.replace, through a name tests can interrupt to simulate a crash between two renames
_rename = os.replace

#: The outputs this process put in place, newest last (a few: only the CLI reads it). A SIGTERM or
#: Ctrl-C can land after a publish, and publish_dir/publish_tag hold one that lands during their
#: switch until it is done: the CLI's "nothing was published" would then be false (cli.py asks).
_published: deque[Path] = deque(maxlen=8)


def note_published(path: str | os.PathLike[str]) -> None:
    """Record that ``path`` is now a complete output in place (for the CLI's interrupt message)."""
    _published.append(Path(path))


def published_outputs() -> list[Path]:
    """What ``note_published`` recorded since ``forget_published``, oldest first."""
    return list(_published)


def forget_published() -> None:
    _published.clear()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory entry (a rename or new file) to disk; a no-op where dirs cannot be opened."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)

def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush one file's data to disk (it may have been written by another process or library)."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

def fsync_tree(root: str | os.PathLike[str]) -> None:
    """fsync every file, then every directory (deepest first), under ``root``."""
    dirs: list[str] = []
    for dirpath, _dirnames, filenames in os.walk(os.fspath(root)):
        dirs.append(dirpath)
        for name in filenames:
            fsync_file(os.path.join(dirpath, name))
    for d in reversed(dirs):
        fsync_dir(d)

def _temp_name(path: Path) -> Path:
    # same directory, so os.replace never crosses a filesystem; hidden, so globbing skips it
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")

@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "wb", *, output: bool = False) -> Iterator[IO[Any]]:
    """Open a temporary sibling of ``path`` for writing; on success fsync and rename it over
    ``path``; on any exception remove it and leave ``path`` untouched. ``output``: ``path`` is what
    the command publishes (recorded by ``note_published`` as soon as it is in place)."""
    if "w" not in mode:
        raise ValueError(f"atomic_open is for writing; mode {mode!r} has no 'w'")
    final = Path(path)
    tmp = _temp_name(final)
    fh: IO[Any] | None = None
    try:
        # opened inside the try: a SIGTERM (raised as an exception by the CLI) that lands as open()
        # returns, after the file exists but before ``fh`` is bound, still removes it (CI: a stopped
        # consolidate left its ``.model.safetensors.tmp-*`` behind while saying it had removed it)
        fh = open(tmp, mode)
        yield fh
        fh.flush()
        os.fsync(fh.fileno())
        fh.close()
        if output:
            with signals_deferred():  # the rename and its record as one step, for the CLI's message
                os.replace(tmp, final)
                note_published(final)
        else:
            os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        with signals_deferred():  # a second signal must not cut the removal short
            if fh is not None:
                fh.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise

def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically."""
    with atomic_open(path, "wb") as fh:
        fh.write(data)

def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))

def atomic_save(obj: Any, path: str | os.PathLike[str], save: Callable[[Any, IO[bytes]], None] | None = None) -> None:
    """``torch.save(obj, path)`` (or ``save(obj, fh)``) through a temporary file and a rename."""
    if save is None:
        import torch

        save = torch.save
    with atomic_open(path, "wb") as fh:
        save(obj, fh)

def write_latest(root: str | os.PathLike[str], tag: str, name: str = LATEST_NAME) -> None:
    """Point ``root/latest`` at ``tag`` atomically, in DeepSpeed's format (the bare tag), so
    ``engine.load_checkpoint(root)`` keeps working."""
    atomic_write_text(Path(root) / name, str(tag))

def staging_dir(root: str | os.PathLike[str], tag: str) -> Path:
    """Where a save of ``tag`` is written before it is renamed into place (same on every rank)."""
    return Path(root) / f"{STAGING_PREFIX}{tag}"

def publish_dir(staged: str | os.PathLike[str], final: str | os.PathLike[str], *, drop: tuple[str, ...] = ()) -> None:
    """fsync a fully written staging directory and rename it to ``final`` (``drop``: as ``publish_tag``'s).

    When ``final`` already exists (the same tag saved twice) it is first renamed aside and removed
    after the new one is in place, so there is no moment without a complete directory on disk under
    one of the two names.
    """
    staged, final = Path(staged), Path(final)
    fsync_tree(staged)
    old: Path | None = None
    # the swap runs with SIGINT/SIGTERM held: one landing between the two renames left ``final``
    # missing, the old output under a staging name and the new one removed by the caller's clean-up
    with signals_deferred():
        if final.exists():
            old = final.with_name(f"{STAGING_PREFIX}old-{final.name}-{uuid.uuid4().hex[:8]}")
            _rename(final, old)
        try:
            _rename(staged, final)
        except BaseException:
            if old is not None:
                _rename(old, final)  # the new folder could not be put in place: the old one goes back
            raise
        _drop(final, drop)
        note_published(final)
        fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

def _link_copy(src: Path, dst: Path) -> None:
    """A complete copy of ``src`` at ``dst`` made of hard links (no data copied); plain copies where
    the filesystem has no hard links."""

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link)
    fsync_tree(dst)

def publish_tag(root: str | os.PathLike[str], staged: str | os.PathLike[str], tag: str, *,
                drop: tuple[str, ...] = ()) -> Path:
    """Rename the fully written ``staged`` directory to ``root/<tag>`` and point ``latest`` at it.
    ``drop``: names removed from the folder right after its rename (the claim's owner file, which
    stays until then so that no run ever sees a live staging folder without it).

    Saving a tag that already exists never leaves ``latest`` naming a missing folder, nor the only
    good copy under a staging name: the old copy is first duplicated (hard links) under the
    loadable name ``<tag>.shardkit-replaced-<hex>`` and ``latest`` repointed there when it named
    the tag, then the old folder is renamed aside, the new one into place, and ``latest`` moved
    last. A crash between any two steps leaves ``latest`` naming a complete checkpoint.
    """
    root, staged = Path(root), Path(staged)
    final = root / tag
    fsync_tree(staged)
    kept: Path | None = None
    trash: Path | None = None
    switching = False
    try:
        if final.exists():
            kept = root / f"{tag}{REPLACED_MARK}{uuid.uuid4().hex[:8]}"
            _link_copy(final, kept)
            fsync_dir(root)
        # from moving ``latest`` to the copy until it names the new folder, SIGINT/SIGTERM wait: one
        # landing between the renames left the tag missing (the old folder under a staging name, the
        # new one removed by the caller's clean-up) while the CLI said the previous output was unchanged
        with signals_deferred():
            switching = True
            if kept is not None:
                if read_latest(root) == tag:
                    write_latest(root, kept.name)
                trash = root / f"{STAGING_PREFIX}old-{tag}-{uuid.uuid4().hex[:8]}"
                _rename(final, trash)
            _rename(staged, final)
            _drop(final, drop)
            fsync_dir(root)
            write_latest(root, tag)
            note_published(final)
            for d in (trash, kept):
                if d is not None:
                    shutil.rmtree(d, ignore_errors=True)
    except BaseException:
        if not switching and kept is not None:
            with signals_deferred():  # stopped while copying: the partial copy goes, nothing else changed
                shutil.rmtree(kept, ignore_errors=True)
        raise
    return final

def _drop(folder: Path, names: tuple[str, ...]) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            (folder / name).unlink()
    if names:
        fsync_dir(folder)


def remove_stale_saves(root: str | os.PathLike[str], *, keep: str | None = None,
                       is_live: Callable[[Path], bool] | None = None) -> list[str]:
    """Remove what killed saves left in ``root``: staging folders (of any tag), temporaries of
    atomic writes (``.latest.tmp-*``) and set-aside copies ``latest`` no longer names (a set-aside
    copy whose tag folder is gone is renamed back to its tag instead). Call on one rank only,
    before a save. ``keep``: the caller's own staging folder; ``is_live``: says whether a staging
    folder belongs to a writer still running (``shared_save.owner_alive``), which is left alone.
    Returns the names removed."""
    root = Path(root)
    latest = read_latest(root) if (root / LATEST_NAME).is_file() else None
    removed = []
    for entry in root.iterdir():
        name = entry.name
        if name == keep or (is_live is not None and name.startswith(STAGING_PREFIX) and entry.is_dir()
                            and is_live(entry)):
            continue
        if entry.is_dir() and REPLACED_MARK in name and name != latest:
            tag = name.split(REPLACED_MARK, 1)[0]
            if not (root / tag).exists():
                # a re-save of ``tag`` died between its two renames: this is its only complete copy
                _rename(entry, root / tag)
                continue
        stale_dir = entry.is_dir() and (name.startswith(STAGING_PREFIX) or (REPLACED_MARK in name and name != latest))
        stale_tmp = entry.is_file() and name.startswith(".") and ".tmp-" in name
        if stale_dir:
            shutil.rmtree(entry, ignore_errors=True)
        elif stale_tmp:
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
        else:
            continue
        removed.append(name)
    return removed
