"""Reading a regular file with a size cap: never a device, FIFO or socket, never more bytes than asked.

Config files, manifests, ``latest`` pointers and recorded snapshots are all read through here, so a
hostile path (a FIFO that blocks forever, /dev/zero that streams without end) gets one clear error
wherever it is given.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from shardkit.core.errors import ConfigError

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


def read_regular_file(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of ``path``, at most ``limit`` of them, read only from a regular file, or FileReadError.

    O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever; the type is
    then checked on the open descriptor, so nothing swapped in between a stat and the open (a
    FIFO, a device) is ever read. The bytes actually read are capped: ``st_size`` is 0 for
    devices and /proc files whatever they stream."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileReadError(p, "missing", f"{p}: no such file") from None
    except IsADirectoryError:
        raise FileReadError(p, "folder", f"{p}: is a folder, not a regular file") from None
    except OSError as exc:
        raise FileReadError(p, "unreadable", f"{p}: cannot be read ({exc.strerror or exc})") from exc
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise FileReadError(p, "folder", f"{p}: is a folder, not a regular file")
        if not stat.S_ISREG(mode):
            raise FileReadError(p, "not_regular", f"{p}: is {file_kind(mode)}, not a regular file (a device or "
                                "pipe can stream without end, so shardkit never reads one)")
        os.set_blocking(fd, True)  # a regular file: reads are plain reads again
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(limit + 1)  # bytes actually read, never trusting st_size
    except OSError as exc:
        raise FileReadError(p, "unreadable", f"{p}: cannot be read ({exc.strerror or exc})") from exc
    finally:
        os.close(fd)
    if len(raw) > limit:
        raise FileReadError(p, "too_large", f"{p}: more than {limit} bytes")
    return raw
