"""A whole folder assembled beside its destination: a hidden sibling named after its writer
(pid@host), renamed into place last (``atomic.publish_dir``). Used where the output is one folder
rather than a checkpoint root with tags: a resharded Trainer ``checkpoint-N``, an exported model.

The name lets a later run tell a killed writer's leftover (SIGKILL, OOM and node loss skip the
``except`` that removes it; each is as big as the output) from a writer still running beside it.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import uuid
from pathlib import Path

from shardkit.storage.tags import STAGING_PREFIX

#: what follows ``<STAGING_PREFIX><name>-`` in a staging folder's name: the writer's pid@host and a nonce
_STAGING_OWNER = re.compile(r"^(\d+)@(.+)-[0-9a-f]{8}$")


def staging_folder(final: Path) -> Path:
    """Where ``final`` is assembled: a hidden sibling naming this process as its writer."""
    return final.parent / f"{STAGING_PREFIX}{final.name}-{os.getpid()}@{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def remove_stale_staging(final: Path) -> list[str]:
    """Remove the staging folders of ``final`` left by killed writers. ``final.parent`` is any
    folder, so only a folder whose writer process is gone goes: same host, pid no longer running.
    Folders of other hosts (a shared filesystem) or without an owner are left. Returns the names
    removed."""
    prefix = f"{STAGING_PREFIX}{final.name}-"
    if not final.parent.is_dir():
        return []
    host, removed = socket.gethostname(), []
    for e in final.parent.iterdir():
        if not e.name.startswith(prefix) or e.is_symlink() or not e.is_dir():
            continue
        m = _STAGING_OWNER.match(e.name[len(prefix):])
        if m is None or m.group(2) != host or _process_alive(int(m.group(1))):
            continue
        shutil.rmtree(e, ignore_errors=True)
        removed.append(e.name)
    return sorted(removed)
