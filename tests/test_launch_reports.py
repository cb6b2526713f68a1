"""The launch's report listener and its closing line, with real sockets and the ranks' own sender
(shardkit.autopreflight.launch_link.send_report), no launcher: what each rank said becomes one line
that says on how many ranks the preflight passed, or which never ran it and why."""

from __future__ import annotations

import json
import socket

import pytest

from shardkit.autopreflight.launch_link import PACKED_ENV, REPORT_ENV, send_report
from shardkit.core.errors import UsageError
from shardkit.run.launch_ranks import ExpectedRanks
from shardkit.run.launch_reports import RankReports, listen_address, outcome_line


def _rank_env(reports: RankReports, rank: int, world: int = 2) -> dict[str, str]:
    return {REPORT_ENV: reports.address, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}


def test_reports_from_ranks_are_heard_and_a_stranger_is_ignored():
    reports = RankReports("127.0.0.1")
    try:
        assert send_report("armed", environ=_rank_env(reports, 0))
        assert send_report("passed", "8 tensors", environ=_rank_env(reports, 0))
        assert send_report("armed", environ=_rank_env(reports, 1))
        assert send_report("failed", "placement preflight (torch, 2 rank(s)): 1 problem(s)", environ=_rank_env(reports, 1))
        # another launch's rank (wrong token) and a line that is not JSON change nothing
        stranger = {**_rank_env(reports, 3), REPORT_ENV: reports.address.rsplit("/", 1)[0] + "/0000"}
        assert send_report("failed", "not ours", environ=stranger)
        with socket.create_connection((reports.host, reports.port), timeout=5) as conn:
            conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
    finally:
        seen = reports.close()
    assert sorted(seen) == [0, 1]
    assert seen[0].events == {"armed", "passed"} and seen[0].world == 2 and seen[0].host == socket.gethostname()
    assert seen[1].line == "placement preflight (torch, 2 rank(s)): 1 problem(s)"


def test_a_rank_that_cannot_reach_the_launch_says_so_once_and_goes_on(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    env = {REPORT_ENV: f"127.0.0.1:{port}/abc", "RANK": "1", "WORLD_SIZE": "2"}
    assert not send_report("armed", environ=env) and not send_report("passed", environ=env)
    err = capsys.readouterr().err
    assert err.count("cannot report to the launch") == 1
    assert f"rank 1 on {socket.gethostname()}: cannot report to the launch at 127.0.0.1:{port}" in err
    assert "set SHARDKIT_LAUNCH_ADDR" in err
    assert not send_report("armed", environ={"RANK": "0"})  # not launched by shardkit: nothing to tell


def _seen(**ranks: set[str]):
    reports = RankReports("127.0.0.1")
    try:
        for rank, events in ranks.items():
            for event in sorted(events, key=["armed", "passed", "skipped"].index):
                send_report(event, "preflight unavailable (No module named 'x')" if event == "skipped" else "",
                            environ=_rank_env(reports, int(rank[1:]), 4))
    finally:
        seen = reports.close()
    return seen, reports.address


def test_the_last_line_passed_on_every_rank_or_names_who_never_ran_it_and_why():
    seen, address = _seen(r0={"armed", "passed"}, r1={"armed", "passed"}, r2={"armed", "passed"}, r3={"armed", "passed"})
    host = socket.gethostname()
    assert outcome_line(seen, ExpectedRanks(4), address, None) == (
        f"shardkit launch: placement preflight passed on 4 of 4 rank(s) (hosts: {host})")
    # the command line does not say how many: the ranks' WORLD_SIZE does
    assert "passed on 4 of 4 rank(s)" in outcome_line(seen, ExpectedRanks(None), address, None)

    seen, address = _seen(r0={"armed", "passed"}, r1={"armed"}, r2={"armed", "skipped"})
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    line = outcome_line(seen, ExpectedRanks(4, hosts=hosts, remote=True), address, None)
    assert line.startswith("shardkit launch: warning: the placement preflight never ran on rank(s) [1] of 4 (hosts a): "
                           "its hooks were armed, but the rank never reached an optimizer step"), line
    assert "rank(s) [2] of 4 (hosts b): preflight unavailable (No module named 'x')" in line
    assert (f"rank(s) [3] of 4 (hosts b): no report came from them: {PACKED_ENV} did not arrive there (the rank says so "
            "on its stderr), or shardkit's sitecustomize folder ") in line
    assert f"or {address.split('/')[0]} is not reachable from it (set SHARDKIT_LAUNCH_ADDR)" in line
    # a DeepSpeed whose runner would drop the variable: that reason, found before the launch
    why = f"{PACKED_ENV} is not passed by this DeepSpeed's runner"
    line = outcome_line({}, ExpectedRanks(2, hosts={0: "a", 1: "b"}, remote=True, unreachable=why), address, None)
    assert line == f"shardkit launch: warning: the placement preflight never ran on rank(s) [0, 1] of 2 (hosts a, b): {why}"
    # the launcher failed before any rank reported: that, not a missing variable
    line = outcome_line({}, ExpectedRanks(2), address, None, launcher_code=1)
    assert line.startswith("shardkit launch: warning: the placement preflight never ran: the launcher exited with 1 "
                           "before any rank reported")


def test_one_node_of_a_bigger_job_counts_its_own_ranks():
    seen, address = _seen(r2={"armed", "passed"}, r3={"armed", "passed"})
    assert outcome_line(seen, ExpectedRanks(2, per_node=True), address, "n2") == (
        f"shardkit launch: placement preflight passed on 2 of 2 rank(s) on this node (n2) (hosts: {socket.gethostname()})")
    seen, address = _seen(r2={"armed", "passed"})
    line = outcome_line(seen, ExpectedRanks(2, per_node=True), address, "n2")
    assert line.startswith("shardkit launch: warning: the placement preflight never ran on 1 of this node's 2 rank(s) "
                           "on this node (n2): no report came from them"), line


def test_the_listen_address_loopback_routed_or_given():
    assert listen_address(ExpectedRanks(2), {}) == ("127.0.0.1", 0)
    assert listen_address(ExpectedRanks(2, remote=True, route_host="127.0.77.1"), {})[0].startswith("127.")
    assert listen_address(ExpectedRanks(2, remote=True), {"SHARDKIT_LAUNCH_ADDR": "10.1.2.3:29600"}) == ("10.1.2.3", 29600)
    assert listen_address(ExpectedRanks(2, remote=True), {"SHARDKIT_LAUNCH_ADDR": "node0"}) == ("node0", 0)
    with pytest.raises(UsageError, match=r"cannot listen for the ranks' preflight reports at 192\.0\.2\.1:0 .*set "
                                         r"SHARDKIT_LAUNCH_ADDR to an address of this host the nodes reach"):
        RankReports("192.0.2.1")  # TEST-NET-1: not an address of this host


def test_a_line_over_the_limit_or_without_a_rank_is_ignored():
    reports = RankReports("127.0.0.1")
    try:
        token = reports.address.rsplit("/", 1)[1]
        for message in ({"token": token, "event": "passed"}, {"token": token, "event": "exploded", "rank": 0}):
            with socket.create_connection((reports.host, reports.port), timeout=5) as conn:
                conn.sendall(json.dumps(message).encode() + b"\n")
    finally:
        seen = reports.close()
    assert seen == {}


# A rank that starts a Python child (as DeepSpeed's op builder does): the child inherits the rank's
# whole environment, our sitecustomize included, and must not arm or report "armed" for the rank again.
_RANK_WITH_A_CHILD = """
import os, subprocess, sys
probe = "import os; print(os.getpid(), os.environ.get('SHARDKIT_AUTOPREFLIGHT_ARMED_PID'))"
child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
print("rank", os.getpid(), "child", child.stdout.strip(), "stderr", repr(child.stderr), flush=True)
"""


@pytest.mark.timeout(180)
def test_a_child_process_of_an_armed_rank_neither_arms_nor_reports():
    import os
    import subprocess
    import sys
    import threading

    from shardkit.autopreflight import rank_env

    lines: list[dict] = []
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def collect() -> None:  # every line any process sends, not deduplicated by rank as RankReports does
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                lines.append(json.loads(conn.makefile().readline()))

    thread = threading.Thread(target=collect, daemon=True)
    thread.start()
    base = {k: v for k, v in os.environ.items() if not k.startswith("SHARDKIT_")}
    env = {**rank_env(base), REPORT_ENV: f"127.0.0.1:{server.getsockname()[1]}/tok", "RANK": "0", "WORLD_SIZE": "1"}
    try:
        r = subprocess.run([sys.executable, "-c", _RANK_WITH_A_CHILD], env=env, capture_output=True, text=True, timeout=120)
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()
    assert r.returncode == 0, r.stderr
    _, rank_pid, _, child_pid, armed_pid, _, child_err = r.stdout.split(maxsplit=6)
    assert armed_pid == rank_pid != child_pid, r.stdout  # the child saw the rank's mark
    assert "did not arrive" not in child_err and "autopreflight" not in child_err, child_err
    assert [(m["event"], m["rank"], str(m["pid"])) for m in lines] == [("armed", 0, rank_pid)], lines


def test_rank_0_reports_its_failure_from_the_verdict_before_the_other_ranks_can_read_it(monkeypatch, capfd):
    """torchrun's agent SIGTERMs rank 0 as soon as another rank exits on the failed verdict: rank 0's
    "failed" report and its stop lines must already be out when the verdict is published
    (``preflight``'s ``on_verdict``), not only by stop_rank afterwards (CI: the launch named rank(s)
    [1] of 2; the 2-rank Trainer test saw rank 1's stop line alone)."""
    import torch

    from shardkit.autopreflight.run import rank0_stops_first
    from shardkit.core.errors import PreflightError
    from shardkit.placement.preflight import preflight

    reports = RankReports("127.0.0.1")
    for key, value in _rank_env(reports, 0, 1).items():
        monkeypatch.setenv(key, value)
    model = torch.nn.Linear(4, 4)
    model.weight = torch.nn.Parameter(torch.empty(4, 4, device="meta"))  # a tensor off the model's device
    heard_before_raise: list[dict[int, str]] = []
    said_before_raise: list[str] = []

    stops_first = rank0_stops_first("0", "placement preflight failed before the first optimizer step", "skip it")

    def on_verdict(ok: bool, text: str) -> None:
        stops_first(ok, text)
        heard_before_raise.append(_wait_for_failure(reports))
        said_before_raise.append(capfd.readouterr().err)

    try:
        with pytest.raises(PreflightError) as caught:
            preflight(model=model, device="cpu", on_verdict=on_verdict)
    finally:
        seen = reports.close()
    first = str(caught.value).strip().splitlines()[0]
    assert heard_before_raise == [{0: first}]  # reported from the verdict, before preflight raised
    assert seen[0].events == {"failed"} and seen[0].line == first
    assert f"shardkit autopreflight: rank 0: placement preflight failed before the first optimizer step: {first}\n" \
        "shardkit autopreflight: rank 0: stopping (exit 3); see the table above. Fix it, or skip it." in said_before_raise[0]


def _wait_for_failure(reports: RankReports, timeout: float = 60.0) -> dict[int, str]:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not reports.failures():
        time.sleep(0.01)
    return reports.failures()
