"""A shardkit CLI whose fsyncs each take seconds, for the tests that interrupt a write: on an idle machine
the whole write of their 250 MB source took under a second, and the signal the test sent once the staging
folder appeared came after the run had finished (CI: exit 0, not 130). Only the time changes (and SIGINT
is Python's own handler, below): each file is written, then fsynced, exactly as without it."""

from __future__ import annotations

import sys

FSYNC_DELAY_S = 3.0

# SIGINT as a terminal gives it: a shell's background job (`cmd &` without job control: CI scripts, nohup)
# starts its children with SIGINT ignored, and Python then installs no KeyboardInterrupt handler, so the
# tests' SIGINT would be lost (exit 0 after the whole write, not 130).
_CODE = f"""
import os, runpy, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
_fsync = os.fsync
def _slow_fsync(fd):
    time.sleep({FSYNC_DELAY_S})
    _fsync(fd)
os.fsync = _slow_fsync
sys.argv = ["shardkit", *sys.argv[1:]]
runpy.run_module("shardkit", run_name="__main__", alter_sys=True)
"""


def slow_fsync_cli(*args: object) -> list[str]:
    """``python -m shardkit ARGS`` with every ``os.fsync`` delayed by FSYNC_DELAY_S."""
    return [sys.executable, "-c", _CODE, *map(str, args)]
