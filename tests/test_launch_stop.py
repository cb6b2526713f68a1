"""`shardkit launch`'s clean-up after a signal (shardkit/run/launch_stop.py): the processes it saw
below the launcher are stopped once the launcher exits, and only those: a pid that names another
process by the time of the reap (pids wrap quickly where pid_max is 32768) is left alone."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from shardkit.run.launch_stop import LaunchStop, reap_leftovers


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_seen_process_is_stopped_and_a_reused_pid_is_not():
    mine, other = _sleeper(), _sleeper()
    try:
        stop = LaunchStop(signum=15)
        stop.seen = {mine.pid: psutil.Process(mine.pid).create_time(),
                     # as if the launch had seen an earlier process under this pid
                     other.pid: psutil.Process(other.pid).create_time() - 5.0}
        named = reap_leftovers(stop, subreaper=False, grace_s=5.0)
        assert mine.wait(timeout=10) is not None and named == [f"{mine.pid} ({sys.executable} -c import time; time.sleep(60))"]
        assert other.poll() is None, "a process the launch never started was signalled"
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()


def test_note_records_what_is_below_the_launcher_with_its_start_time():
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"])
    try:
        proc = psutil.Process(parent.pid)
        # until the parent has started its child: an interpreter's start-up, seconds on a loaded CI box
        deadline = time.monotonic() + 60
        while not proc.children() and time.monotonic() < deadline:
            time.sleep(0.05)
        (child,) = proc.children()
        stop = LaunchStop()
        stop.note(15, parent.pid)
        assert stop.signum == 15 and stop.seen == {child.pid: child.create_time()}
    finally:
        for p in psutil.Process(parent.pid).children(recursive=True):
            p.kill()
        parent.kill()
        parent.wait()
