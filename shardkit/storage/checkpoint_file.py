"""Opening one checkpoint file to read it, with the words a user acts on: a FIFO, device, socket or
folder refused by name before anything is read (core.files.open_regular), and a missing, empty or
unreadable file said as such, never taken for damage by the parse that would follow."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from shardkit.core.errors import CheckpointError
from shardkit.core.files import NotRegularFileError, open_regular

#: The fix a rank file that is not a regular file is refused with (core.files.open_regular).
NOT_REGULAR_FIX = "A checkpoint file is always a regular file: restore the rank file from a copy of the checkpoint"


def _permission_denied(p: Path, st: os.stat_result) -> CheckpointError:
    # said before any read, which would otherwise be taken for damage
    return CheckpointError(f"{p}: permission denied: this user (uid {os.getuid()}) cannot read it (mode "
                           f"{stat.filemode(st.st_mode)}, owner uid {st.st_uid}). The file is not damaged: fix its "
                           "permissions (chmod a+r), or run as a user who can read the checkpoint")


def open_checked(p: Path) -> BinaryIO:
    """``p`` opened through core.files.open_regular (a FIFO, device, socket or folder refused by name, nothing
    read from it), or a CheckpointError saying why it cannot be read: missing, empty, no permission."""
    try:
        fh = open_regular(p, fix=NOT_REGULAR_FIX)
    except NotRegularFileError as exc:
        if exc.reason == "folder":
            raise CheckpointError(f"{p}: is a directory, expected a checkpoint file (*.pt)") from None
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{p}: checkpoint file does not exist. Was a rank's save lost, or is the path wrong?") from None
    except PermissionError:
        raise _permission_denied(p, os.stat(p)) from None
    st = os.fstat(fh.fileno())
    if not os.access(p, os.R_OK):  # opened (root reads anything) where os.access says this user may not
        fh.close()
        raise _permission_denied(p, st)
    if st.st_size == 0:
        fh.close()
        raise CheckpointError(
            f"{p}: checkpoint file is empty (0 bytes): the save that wrote it did not finish. "
            "Resume from the previous checkpoint."
        )
    return fh
