"""A node of a multi-node `shardkit launch` whose ranks failed their preflight keeps exit 3 when the
scheduler stops it, even when the ranks' "failed" reports were still being read as the launcher exited.

Under Slurm (srun --kill-on-bad-exit) the first node to end with exit 3 gets every other node's step
SIGTERMed. A node that has decided (its ranks failed) ignores that SIGTERM, so the job's ExitCode stays
3:0. The decision was taken before the report listener had finished reading: a rank reports just
before it exits, so the launcher's exit could end the wait while the listener thread was still in the
middle of the "failed" line; the node then looked undecided, SIGTERM got its default action back, and
the loaded two-node Slurm test saw ExitCode 143:0 after the node had printed its failure line. With
that fixed it saw 143:0 again: the CLI's last act put SIGTERM's previous handler (the default) back after
the launch returned 3, and the SIGTERM landed in the interpreter's exit.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time

from shardkit.autopreflight.launch_link import REPORT_ENV
from shardkit.cli import _close
from shardkit.commands._result import Ending, command_of, json_request
from shardkit.run import launch_run
from shardkit.run.launch_plan import LaunchPlan
from shardkit.run.launch_reports import RankReports
from shardkit.run.rendezvous_diagnosis import rendezvous_of

# the launcher stand-in: one rank's "failed" report, sent in full, then the launcher's own exit 1
# (torchrun's, for a rank that ended with exit 3)
REPORT_AND_EXIT = textwrap.dedent(
    """
    import sys
    from shardkit.autopreflight.launch_link import send_report
    sent = send_report("failed", "placement preflight (torch, 2 rank(s)): 1 problem(s); exit 3")
    sys.exit(1 if sent else 9)
    """
)


def test_a_failed_report_still_being_read_when_the_launcher_exits_decides_the_node(monkeypatch):
    real_read = RankReports._read

    def read_late(self: RankReports, conn: object) -> None:
        time.sleep(0.5)  # the listener is still reading the line when the launcher's exit ends the wait
        real_read(self, conn)  # type: ignore[arg-type]

    monkeypatch.setattr(RankReports, "_read", read_late)
    reports = RankReports("127.0.0.1", 0)
    plan = LaunchPlan(
        launcher="torchrun", argv=[sys.executable, "-c", REPORT_AND_EXIT], env={}, script="train.py", script_args=[],
        config_path=None, world_size=4, preflight=True,
        rendezvous=rendezvous_of(["--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:29400"]),
    )
    env = {**os.environ, REPORT_ENV: reports.address, "RANK": "1", "WORLD_SIZE": "2"}
    before = signal.getsignal(signal.SIGTERM)
    try:
        code = launch_run._run_and_reap(plan, env, False, reports)
        term_after = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, before)
        reports.close()
    assert code == 1, "the launcher's own exit status"
    assert reports.failures() == {1: "placement preflight (torch, 2 rank(s)): 1 problem(s); exit 3"}
    assert term_after == signal.SIG_IGN, (
        "the node's ranks failed, yet a SIGTERM from the scheduler would still kill it (exit 143 instead of 3): "
        f"SIGTERM's handler after the launch is {term_after!r}")


def test_the_cli_leaves_a_decided_node_deaf_to_sigterm_until_the_process_ends():
    words = ["launch", "--launcher", "torchrun", "train.py"]
    ending = Ending(command_of(words), json_request(words))
    ending.code = 3
    before = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # what the node set once its ranks' failure was read
        _close(ending, signal.SIG_DFL)  # main()'s last act, the handler before the run being the default
        after = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert after == signal.SIG_IGN, (
        "main() put SIGTERM's default back after a decided launch: a SIGTERM during the interpreter's exit "
        f"turns the node's exit 3 into 143 (handler after main: {after!r})")
