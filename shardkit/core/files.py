"""The one way shardkit opens a file to read it: only a regular file, never a device, FIFO, socket or folder.

Every read of a user's file goes through here: rank files, ``.metadata`` and ``.distcp`` files, the
Trainer's JSON, config files, manifests, ``latest`` pointers, recorded snapshots. A hostile or careless
path (a FIFO in place of a rank file, which blocks a reader forever; a link to /dev/zero, which streams
without end) then gets one clear error, naming the file and what it is, wherever it is met.

How: ``os.open(O_RDONLY | O_NONBLOCK)`` (opening a FIFO for reading would otherwise wait for a writer
forever), then ``fstat`` of the open descriptor: what is checked is what was opened, so nothing swapped
in between a ``stat`` and the open is ever read. ``regular_fd`` and ``open_regular`` are that open;
``read_regular_file`` / ``read_regular_text`` read a small file whole with a size cap; ``fd_path`` names
an open file for an API that takes only a path (``torch.load(mmap=True)``); ``copy_regular`` copies one.
tests/test_one_way_to_open.py walks the package and fails on any other open of a file for reading.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import stat
from pathlib import Path
from typing import BinaryIO

from shardkit.core.errors import CheckpointError, ConfigError

#: How messages name a file that is not a regular file (``stat.S_IFMT`` of its mode).
_KINDS = {
    stat.S_IFDIR: "a folder",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFLNK: "a symlink",
    stat.S_IFREG: "a regular file",
}


def file_kind(mode: int) -> str:
    """What a file of stat mode ``mode`` is, as messages say it: 'a FIFO (named pipe)', 'a folder'..."""
    return _KINDS.get(stat.S_IFMT(mode), "a special file")


class FileReadError(ConfigError):
    """``read_regular_file`` refused or could not read a file; the message names the path and why.

    ``reason`` lets a caller put its own fix after the message: 'missing', 'folder', 'not_regular'
    (a device, FIFO or socket), 'too_large' or 'unreadable' (permissions, I/O error)."""

    def __init__(self, path: Path, reason: str, message: str):
        super().__init__(message)
        self.path = path
        self.reason = reason


#: Why each kind of file is never read, as messages say it.
_WHY_NOT = {
    stat.S_IFIFO: "reading a FIFO waits for a writer, for ever if there is none",
    stat.S_IFCHR: "a device can stream without end",
    stat.S_IFBLK: "a device can stream without end",
    stat.S_IFSOCK: "a socket holds no file contents",
    stat.S_IFDIR: "a folder has no bytes of its own to read",
}

#: The fix a refusal ends with when the caller names none.
DEFAULT_FIX = "Put the regular file that belongs there in its place (copy it from where it was saved), or pass another path"


class NotRegularFileError(CheckpointError):
    """A file shardkit was about to read is not a regular file (a FIFO, device, socket or folder): nothing
    was read from it. ``kind`` says what it is ('a FIFO (named pipe)'); the message names the path, the
    kind, why it is never read and the fix. A CheckpointError (exit 1), so a command's own handling of a
    bad checkpoint file applies; never an OSError or ValueError, so no ``except`` meant for a missing or
    malformed file takes it for one."""

    def __init__(self, path: Path, mode: int, fix: str):
        kind = file_kind(mode)
        link = f" (a symlink to {os.path.realpath(path)})" if os.path.islink(path) else ""
        why = _WHY_NOT.get(stat.S_IFMT(mode), "only a regular file holds a file's bytes")
        super().__init__(f"{path}{link}: is {kind}, not a regular file, so it is not read ({why})" + (f". {fix}" if fix else ""))
        self.path = path
        self.kind = kind
        self.reason = "folder" if stat.S_ISDIR(mode) else "not_regular"


def not_regular(path: str | os.PathLike[str], *, fix: str = DEFAULT_FIX) -> NotRegularFileError | None:
    """The refusal ``regular_fd`` would raise for ``path`` (a FIFO, device, socket or folder there), found by a
    ``stat`` and never an open; None for a regular file or nothing there. For a check that names every such
    entry of a folder up front (a verify, a reader's list of rank files) without opening a device."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else NotRegularFileError(Path(path), mode, fix)


def regular_fd(path: str | os.PathLike[str], *, fix: str = DEFAULT_FIX, follow_links: bool = True) -> int:
    """A read-only descriptor of the regular file ``path`` (the caller closes it), or NotRegularFileError
    naming what it is instead; a missing or unreadable file raises the OSError ``open`` would.

    Opened with O_NONBLOCK (a FIFO never blocks the open), checked with ``fstat`` of the descriptor (no
    race with a ``stat`` before), then set blocking again: reads of a regular file are plain reads.
    ``follow_links=False``: O_NOFOLLOW, a link is refused by the kernel (ELOOP)."""
    p = Path(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(p, flags)
    except OSError as exc:
        # a socket cannot be opened at all (ENXIO): name it as what it is, not as 'No such device'
        if exc.errno == errno.ENXIO:
            try:
                mode = os.stat(p).st_mode
            except OSError:
                raise exc from None
            if not stat.S_ISREG(mode):
                raise NotRegularFileError(p, mode, fix) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(p, mode, fix)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str | os.PathLike[str], *, fix: str = DEFAULT_FIX, buffering: int = -1,
                 follow_links: bool = True) -> BinaryIO:
    """``open(path, "rb")`` of a regular file only (``regular_fd``): NotRegularFileError for a FIFO, device,
    socket or folder, the OSError ``open`` raises for a missing or unreadable file."""
    fd = regular_fd(path, fix=fix, follow_links=follow_links)
    try:
        fh = os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise
    raw = fh if isinstance(fh, io.FileIO) else fh.raw  # type: ignore[attr-defined]
    raw.name = os.fspath(path)  # what messages name: the path, not the descriptor's number
    return fh  # type: ignore[return-value]


def fd_path(fh: BinaryIO, path: str | os.PathLike[str]) -> str:
    """A path naming exactly the file ``fh`` (opened by ``open_regular``) has open, for an API that takes
    only a path (``torch.load(mmap=True)`` opens and maps by name): ``/proc/self/fd/N`` reopens that very
    file, so nothing swapped in at ``path`` since the check is read. ``path`` where there is no /proc."""
    proc = f"/proc/self/fd/{fh.fileno()}"
    return proc if os.path.exists(proc) else os.fspath(path)


def copy_regular(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, fix: str = DEFAULT_FIX) -> Path:
    """``shutil.copy2`` of a regular file only: NotRegularFileError for anything else (copy2 refuses a FIFO
    but reads a character device without end). ``dst`` is created or replaced; mode and times follow."""
    with open_regular(src, fix=fix) as fin, open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout)
    shutil.copystat(src, dst)
    return Path(dst)


def read_regular_file(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of ``path``, at most ``limit`` of them, read only from a regular file, or FileReadError.

    Opened by ``regular_fd``. The bytes actually read are capped: ``st_size`` is 0 for /proc files
    whatever they hold."""
    p = Path(path)
    try:
        fd = regular_fd(p, fix="")
    except FileNotFoundError:
        raise FileReadError(p, "missing", f"{p}: no such file") from None
    except IsADirectoryError:
        raise FileReadError(p, "folder", f"{p}: is a folder, not a regular file") from None
    except NotRegularFileError as exc:
        raise FileReadError(p, exc.reason, str(exc)) from None
    except OSError as exc:
        raise FileReadError(p, "unreadable", f"{p}: cannot be read ({exc.strerror or exc})") from exc
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(limit + 1)  # bytes actually read, never trusting st_size
    except OSError as exc:
        raise FileReadError(p, "unreadable", f"{p}: cannot be read ({exc.strerror or exc})") from exc
    finally:
        os.close(fd)
    if len(raw) > limit:
        raise FileReadError(p, "too_large", f"{p}: more than {limit} bytes")
    return raw


#: A cap for the small text files read whole (JSON and YAML configs, trainer_state.json, pointers).
MAX_TEXT_BYTES = 256 * 1024 * 1024


def read_regular_text(path: str | os.PathLike[str], *, limit: int = MAX_TEXT_BYTES, encoding: str = "utf-8",
                      errors: str = "strict", fix: str = DEFAULT_FIX) -> str:
    """``Path(path).read_text()`` of a regular file only: NotRegularFileError for a FIFO, device, socket or
    folder, the OSError ``open`` raises for a missing or unreadable one, UnicodeDecodeError as read_text's;
    more than ``limit`` bytes is a CheckpointError naming the file."""
    with open_regular(path, fix=fix) as fh:
        raw = fh.read(limit + 1)
    if len(raw) > limit:
        raise CheckpointError(f"{path}: more than {limit:,} bytes, too large for the small text file expected there")
    return raw.decode(encoding, errors)
