"""Count the listings of one folder a piece of code makes, with the shardkit functions that asked: a resume at
1,024 ranks on a shared filesystem pays each listing of a folder of 2,048 rank files once per rank."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator


@contextlib.contextmanager
def listings_of(folder: str | os.PathLike[str]) -> Iterator[list[str]]:
    """The calls of ``os.listdir`` and ``os.scandir`` (``Path.iterdir``, ``glob`` and ``os.walk`` use them) on
    ``folder`` while the block runs, each as its three nearest shardkit callers ("inner<outer<...")."""
    target = os.path.realpath(folder)
    listed: list[str] = []

    def counted(real: Any) -> Any:
        def listing(path: Any = ".") -> Any:
            if isinstance(path, (str, os.PathLike)) and os.path.realpath(path) == target:
                frame, callers = sys._getframe(1), []
                while frame is not None and len(callers) < 3:
                    if f"{os.sep}shardkit{os.sep}" in frame.f_code.co_filename:
                        callers.append(frame.f_code.co_name)
                    frame = frame.f_back
                listed.append("<".join(callers))
            return real(path)
        return listing

    real_listdir, real_scandir = os.listdir, os.scandir
    os.listdir, os.scandir = counted(real_listdir), counted(real_scandir)
    try:
        yield listed
    finally:
        os.listdir, os.scandir = real_listdir, real_scandir
