"""Running a `shardkit launch`: the real launcher started from the plan's argv (a list, never a
shell string), signals passed on to it, ranks it leaves behind reaped (:mod:`shardkit.run.launch_stop`),
a rendezvous failure named (:mod:`shardkit.run.rendezvous_diagnosis`), and the ranks' preflight
reports turned into the launch's closing line (:mod:`shardkit.run.launch_reports`)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading

from shardkit.autopreflight import EXIT_CODE
from shardkit.autopreflight.launch_link import PACKED_ENV, REPORT_ENV, pack
from shardkit.autopreflight.rank_env import ENV_RANK_FROM
from shardkit.core.errors import UsageError
from shardkit.run.launch_plan import LaunchPlan
from shardkit.run.launch_ranks import ExpectedRanks, expected_ranks
from shardkit.run.launch_reports import RankReports, listen_address, outcome_line, preflight_summary
from shardkit.run.launch_stop import LaunchStop, reap_leftovers, set_subreaper, stop_message
from shardkit.run.rendezvous_diagnosis import StderrTail, diagnose
from shardkit.run.spawn.silence import LockWatch, silence_s


def run_launch(plan: LaunchPlan, expected: ExpectedRanks | None = None) -> int:
    """Start the plan's argv and return its exit status; SIGINT/SIGTERM are passed on to it so the
    launcher can stop its ranks cleanly (as it would under Slurm or Ctrl-C).

    With the preflight on, the ranks report to this process (:mod:`shardkit.run.launch_reports`) and
    the launch ends with one line saying what holds, after everything the launcher printed (torchrun
    turns a rank's exit 3 into 1 and prints a ChildFailedError traceback last): ranks that failed
    their preflight, named, and exit 3; or the preflight passed on N of N ranks; or a warning naming
    the ranks where it never ran and why, the exit status left as the launcher's.
    """
    if not plan.preflight:
        return _run_argv(plan, plan.env, None)
    expected = expected or expected_ranks(plan)
    host, port = listen_address(expected, plan.env)
    reports = RankReports(host, port)
    env = {**plan.env, REPORT_ENV: reports.address}
    if expected.rank_from:
        env[ENV_RANK_FROM] = expected.rank_from
    env[PACKED_ENV] = pack(env)
    try:
        code = _run_argv(plan, env, reports)
    finally:
        seen = reports.close()
    # across nodes each node's launch hears only its own ranks: say whose they are
    node = socket.gethostname() if plan.rendezvous is not None or expected.per_node else None
    failures = {r: seen[r].line for r in sorted(seen) if "failed" in seen[r].events}
    if failures:
        world = plan.world_size or expected.world or expected.count
        print(preflight_summary(failures, world, node), file=sys.stderr, flush=True)
        return EXIT_CODE
    print(outcome_line(seen, expected, reports.address, node, code), file=sys.stderr, flush=True)
    return code


def _run_argv(plan: LaunchPlan, env: dict[str, str], reports: RankReports | None) -> int:
    # ranks whose launcher dies are re-parented here, so none outlives the launch (launch_stop)
    subreaper = set_subreaper(True)
    try:
        return _run_and_reap(plan, env, subreaper, reports)
    finally:
        if subreaper:
            set_subreaper(False)


def _run_and_reap(plan: LaunchPlan, env: dict[str, str], subreaper: bool, reports: RankReports | None) -> int:
    stop = LaunchStop.starting_now()
    try:
        # across nodes, torchrun's stderr is copied through so a rendezvous failure can be named
        stderr = subprocess.PIPE if plan.rendezvous is not None else None
        proc = subprocess.Popen(plan.argv, env=env, stderr=stderr)
    except FileNotFoundError as exc:
        raise UsageError(f"cannot start {plan.argv[0]!r}: {exc}. Is {plan.launcher} installed in this environment?") from exc
    tail = StderrTail(proc.stderr) if proc.stderr is not None else None
    # a build lock whose builder dies during the run leaves every other rank waiting in silence
    lock_watch = LockWatch(env, silence_s(env)).start()
    waiting = True

    def forward(signum: int, _frame: object) -> None:
        proc.send_signal(signum)
        if waiting:
            stop.note(signum, proc.pid)
        # Stopped by the scheduler (srun --kill-on-bad-exit) because another node's launch failed:
        # when this node's ranks already failed their preflight, the outcome is known, so end now
        # with exit 3 rather than be killed (SIGKILL after KillWait) while torchrun winds down.
        if waiting and signum == signal.SIGTERM and reports is not None and reports.failures():
            raise _PreflightAlreadyFailed

    on_main = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} if on_main else {}
    try:
        try:
            code = proc.wait()
        except _PreflightAlreadyFailed:
            return EXIT_CODE
        waiting = False  # a signal from here on is passed on (to nothing) and the exit status kept
        if tail is not None and plan.rendezvous is not None:
            text = tail.text()  # also lets the last of torchrun's output through before our line
            message = diagnose(plan.rendezvous, text) if code != 0 else None
            if message:
                print(message, file=sys.stderr, flush=True)
        leftovers = reap_leftovers(stop, subreaper)
        if stop.signum is not None or leftovers:
            print(stop_message(plan.launcher, stop, leftovers), file=sys.stderr, flush=True)
        if stop.exit_code is not None and code != 0:
            return stop.exit_code  # 130 / 143: what stopped the run, not the launcher's own 1
        return 128 - code if code < 0 else code  # the launcher killed by a signal: as a shell reports it
    finally:
        lock_watch.stop()
        if reports is not None:
            # Read the reports still in flight first: a rank reports just before it exits, and the
            # listener thread can still be reading its "failed" when the launcher's exit ends the wait.
            # Judged before that, this node looked undecided, SIGTERM got its default action back, and
            # the scheduler's stop of the step turned the node's exit 3 into 143 (seen on a loaded run
            # of the two-node Slurm test: the failure line printed, then the job's ExitCode 143:0).
            reports.close()
        decided = plan.rendezvous is not None and reports is not None and bool(reports.failures())
        for s, handler in previous.items():
            # Across nodes the scheduler stops every node's step once one node's launch has ended
            # (srun --kill-on-bad-exit). When this node's ranks failed their preflight its outcome
            # is decided and it is only exiting: a SIGTERM now must not turn its exit 3 into 143
            # (the job's ExitCode is the highest of its tasks').
            signal.signal(s, signal.SIG_IGN if decided and s == signal.SIGTERM else handler)


class _PreflightAlreadyFailed(Exception):
    """Raised out of the launch's wait by a SIGTERM that came after this node's ranks failed their preflight."""
