"""First contact of a split run's processes, before any of them writes a byte: they meet in the
output's staging folder, agree on what they were asked to do (``storage.request``), and say aloud what
they wait for while they wait.

``meet`` is what ``storage.shared_tag`` and consolidate open around their writes:

1. Process 0 claims ``root/.shardkit-tmp-<tag>/`` (``shared_save.claim``); its owner file carries
   its request and the request's digest. The others wait for that claim (``join``).
2. Each other process compares the digest of its own request with rank 0's (one string: nothing
   grows with ranks or tensors) and leaves ``.shardkit-joined-<rank>.json`` saying whether they
   agree; only on a mismatch are the two requests compared field by field, to name each difference.
3. Process 0 waits until every process has joined, then leaves ``.shardkit-verdict.json``: go, or the
   error every process fails with (one difference fails them all: nothing is written, the staging
   folder is removed). The others wait for that word before they write.

Processes given another ``-o`` or ``--tag`` never meet in one staging folder. A waiting process
therefore also looks where rank 0 went instead: the staging folders of other tags in its own output
root, and a pointer rank 0 leaves in this node's temporary folder; found there, the requests are
compared field by field and every process fails naming both values. (A process on another node,
given another ``-o``, can only time out: the message says what it was given.)

No silent waits (once, a shell where a pod exported ``RANK``/``WORLD_SIZE``/``MASTER_*``
waited in silence for processes that never come): a process still waiting after
``ANNOUNCE_AFTER_S`` says which variables made it rank r of N, what it waits for, how long it will
wait and the fix, and says it again every ``SHARDKIT_SILENCE_S`` (default 120 s, env_settings.SETTINGS) until it
stops after ``SHARDKIT_JOIN_TIMEOUT_S``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from shardkit.core.env_settings import SETTINGS, read_seconds
from shardkit.core.errors import CheckpointError, UsageError
from shardkit.storage.atomic import atomic_write_text, staging_dir
from shardkit.storage.request import RELEASE, RunRequest, differences, mismatch_message, shown
from shardkit.storage.shared_save import (
    OWNER_NAME,
    Launch,
    claim,
    heartbeat,
    join_timeout_s,
    owner_alive,
    read_json,
    stale_s,
)
from shardkit.storage.tags import STAGING_PREFIX

JOINED = ".shardkit-joined-{rank}.json"
VERDICT = ".shardkit-verdict.json"
SEEN = ".shardkit-seen-{rank}"
#: A launched run's processes meet within a second or two; a process still waiting after this says so.
ANNOUNCE_AFTER_S = 2.0
#: How long process 0 keeps a refused run's staging folder for the others to read why (they ack).
LINGER_S = 5.0


@contextlib.contextmanager
def meet(root: Path, tag: str, launch: Launch, request: RunRequest, *, sweep: bool = True) -> Iterator[Path]:
    """The staging folder of ``root/tag`` this run writes into, once every process agreed on
    ``request``; the heartbeat runs for the block. Alone (not ``launch.distributed``): the claim and
    the heartbeat only. Raises (UsageError on different arguments, CheckpointError otherwise)
    before anything is written when the processes disagree or one never comes."""
    started = time.monotonic()
    say = _Reporter(request.command)
    if launch.rank == 0:
        staged = claim(root, tag, launch, sweep=sweep, request=request.to_json(), request_digest=request.digest())
    else:
        staged = join(root, tag, launch, request, say, started)
    pointer = _pointer(launch) if launch.distributed and launch.rank == 0 else None
    try:
        if pointer is not None:
            _write_pointer(pointer, staged, launch)
        with heartbeat(staged, launch.rank):
            if launch.distributed:
                if launch.rank == 0:
                    _gather_agreement(staged, launch, say, started)
                else:
                    _agree(staged, launch, request, say, started)
            if pointer is not None:
                _remove(pointer)
                pointer = None
            yield staged
    finally:
        if pointer is not None:
            _remove(pointer)


# --- the others: find rank 0's claim, compare, wait for the word --------------------------------------

def join(root: Path, tag: str, launch: Launch, request: RunRequest, say: _Reporter, started: float) -> Path:
    """Processes 1..N-1: wait until rank 0 of this run has claimed the staging folder of ``root/tag``;
    rank 0 found at another tag or output instead fails the run naming both values."""
    staged = staging_dir(root, tag)
    timeout = join_timeout_s()
    # where else rank 0 may be is looked at once a second, from the first second on: a launched run
    # finds its claim at once, and a thousand processes listing the output root together cost a
    # shared filesystem more than the second they wait
    looked_elsewhere = time.monotonic()
    while True:
        owner = read_json(staged / OWNER_NAME)
        if owner is not None and owner.get("job") == launch.job:
            return staged
        now = time.monotonic()
        if now - looked_elsewhere > 1.0:
            looked_elsewhere = now
            found = _rank0_elsewhere(root, staged, launch)
            if found is not None:
                _refuse_elsewhere(found, launch, request)
        if now - started > timeout:
            seen = f"it is owned by job {owner.get('job')!r}" if owner else "it does not exist"
            raise CheckpointError(
                f"rank {launch.rank} of {launch.world} ({launch.launcher}, host {launch.host}): rank 0 did not claim the "
                f"staging folder {staged} within {timeout:.0f} s ({seen}; this run is job {launch.job!r}). Rank 0 "
                f"failed or never started (see its output), was given another -o or --tag (this process: -o "
                f"{request.output}, --tag {shown('--tag', request.tag)}), or the nodes do not share the output "
                f"filesystem: -o must be on storage every node sees.{_sentence(_by_hand(launch))} Nothing was written")
        say.tick(now - started, timeout, lambda left, first: (
            f"rank {launch.rank} of {launch.world}{_why_split(launch) if first else ''}: "
            f"{'' if first else 'still '}waiting for rank 0 of this run to claim the staging folder {staged} (its "
            f"{OWNER_NAME}); nothing is written before it does; giving up in {left:.0f} s (SHARDKIT_JOIN_TIMEOUT_S). "
            f"{_by_hand(launch, first)}{'; else start rank 0 with the same command line' if first else ''}"))
        time.sleep(0.2)


def _agree(staged: Path, launch: Launch, request: RunRequest, say: _Reporter, started: float) -> None:
    """Compare this process's request with rank 0's (the digests; field by field only when they
    differ), tell rank 0, and wait for its word that every process agreed."""
    owner = read_json(staged / OWNER_NAME) or {}
    error, kind = _compare(request, owner, launch, with_output=False)
    _write_joined(staged, launch, request, error, kind)
    if error is not None:
        raise (UsageError if kind == "usage" else CheckpointError)(error)
    timeout = join_timeout_s()
    joined_at = time.monotonic()  # rank 0 started its own count when it claimed: at most this long ago
    while True:
        verdict = read_json(staged / VERDICT)
        if verdict is not None:
            break
        if not staged.is_dir() or read_json(staged / OWNER_NAME) is None:
            raise CheckpointError(
                f"rank {launch.rank} of {launch.world} ({launch.launcher}, host {launch.host}): rank 0 removed the "
                f"staging folder {staged} before the run started: it failed (see its output). Nothing was written; "
                "run the whole command again")
        quiet = _age(staged / OWNER_NAME)
        if quiet > stale_s():
            raise CheckpointError(
                f"rank {launch.rank} of {launch.world} ({launch.launcher}, host {launch.host}): rank 0 stopped its "
                f"heartbeat {quiet:.0f} s ago before the run started (killed, or its node went down). Nothing was "
                "written; run the whole command again")
        now = time.monotonic()
        if now - joined_at > timeout + stale_s():
            raise CheckpointError(
                f"rank {launch.rank} of {launch.world} ({launch.launcher}, host {launch.host}): rank 0 gave no word to "
                f"start within {now - joined_at:.0f} s of this process joining although its heartbeat goes on (it "
                "gives it once every process joined, or stops the run after SHARDKIT_JOIN_TIMEOUT_S): it is stuck "
                "(see its output). Nothing was written; run the whole command again")
        say.tick(now - started, timeout, lambda left, first: (
            f"rank {launch.rank} of {launch.world}{_why_split(launch) if first else ''}: agreed with rank 0 on what to "
            f"write; {'' if first else 'still '}waiting for its word, given once all {launch.world} processes have "
            f"joined in {staged} (rank 0 stops the run if they have not in about {left:.0f} s: SHARDKIT_JOIN_TIMEOUT_S)"))
        time.sleep(0.2)
    if verdict.get("error"):
        with contextlib.suppress(OSError):
            (staged / SEEN.format(rank=launch.rank)).touch()
        raise (UsageError if verdict.get("kind") == "usage" else CheckpointError)(str(verdict["error"]))


def _compare(request: RunRequest, owner: dict[str, Any], launch: Launch, *,
             with_output: bool) -> tuple[str | None, str]:
    """(The error naming every difference, 'usage' or 'checkpoint'), or (None, '') when ``request``
    is rank 0's. ``with_output=False`` (met in one staging folder): the digests first, and the
    fields only when they differ."""
    theirs = RunRequest.from_json(owner.get("request"))
    if theirs is None:  # rank 0 runs a release from before requests were compared: the releases differ
        theirs = RunRequest("?", "?", "?", None, {}, str(owner.get("shardkit") or "(an older release)"))
    elif not with_output and owner.get("request_digest") == request.digest():
        return None, ""
    diffs = differences(request, theirs, with_output=with_output)
    if not diffs:
        return None, ""
    kind = "checkpoint" if diffs[0].field == RELEASE else "usage"
    return mismatch_message(launch.rank, launch.world, launch.host, str(owner.get("host")), diffs), kind


def _write_joined(staged: Path, launch: Launch, request: RunRequest, error: str | None, kind: str) -> None:
    atomic_write_text(staged / JOINED.format(rank=launch.rank), json.dumps(
        {"rank": launch.rank, "host": launch.host, "pid": os.getpid(), "digest": request.digest(), "error": error,
         "kind": kind}))


def _rank0_elsewhere(root: Path, staged: Path, launch: Launch) -> tuple[Path, dict[str, Any]] | None:
    """Rank 0's claim of this run at another tag of ``root``, or at another output on this node."""
    candidates: list[Path] = []
    pointer = read_json(_pointer(launch)) if _owned_by_me(_pointer(launch)) else None
    if pointer is not None and isinstance(pointer.get("staged"), str):
        candidates.append(Path(pointer["staged"]))
    with contextlib.suppress(OSError):
        candidates += [p for p in root.iterdir() if p.name.startswith(STAGING_PREFIX)]
    for other in candidates:
        if other == staged:
            continue
        owner = read_json(other / OWNER_NAME)
        # a killed earlier run of the same job id (the same variables in the same shell) is no rank 0
        if owner is not None and owner.get("job") == launch.job and owner_alive(other)[0]:
            return other, owner
    return None


def _refuse_elsewhere(found: tuple[Path, dict[str, Any]], launch: Launch, request: RunRequest) -> None:
    other, owner = found
    error, kind = _compare(request, owner, launch, with_output=True)
    if error is None:  # one folder under two paths on this node: rank 0's claim will show up here
        return
    with contextlib.suppress(OSError):
        _write_joined(other, launch, request, error, kind)  # rank 0 names it at once instead of timing out
    raise (UsageError if kind == "usage" else CheckpointError)(error)


# --- rank 0: wait for every process, give the word -----------------------------------------------------

def _gather_agreement(staged: Path, launch: Launch, say: _Reporter, started: float) -> None:
    """Process 0: wait until every process has joined (or one disagreed, or the join timeout
    passed), then leave the verdict; a refused run waits briefly for the others to read it."""
    timeout = join_timeout_s()
    joined: set[int] = set()
    failed: set[int] = set()  # joined with an error: they stop on their own, no ack to wait for
    error: tuple[str, str] | None = None
    while error is None and len(joined) < launch.world - 1:
        for name in _listing(staged):
            if not name.startswith(".shardkit-joined-"):
                continue
            digits = name[len(".shardkit-joined-"):-len(".json")]
            rank = int(digits) if digits.isdigit() else -1
            if rank in joined or not 0 < rank < launch.world:
                continue
            body = read_json(staged / name)
            if body is None:
                continue  # being written
            joined.add(rank)
            if body.get("error"):
                failed.add(rank)
                error = error or (str(body["error"]), str(body.get("kind") or "checkpoint"))
        if error is not None or len(joined) == launch.world - 1:
            break
        waited = time.monotonic() - started
        missing = [r for r in range(1, launch.world) if r not in joined]
        gone = [r for r in missing if _age(staged / f".shardkit-alive-{r}") < float("inf")
                and _age(staged / f".shardkit-alive-{r}") > stale_s()]
        if gone:
            error = (f"rank {gone[0]} of {launch.world} stopped before the run started: no heartbeat for "
                     f"{_age(staged / f'.shardkit-alive-{gone[0]}'):.0f} s (killed, or its node went down). Nothing "
                     "was written; run the whole command again", "checkpoint")
            break
        if waited > timeout:
            also = f" (also missing: ranks {_ranks(missing[1:])})" if len(missing) > 1 else ""
            error = (f"rank {missing[0]} of {launch.world} never joined within {timeout:.0f} s ({launch.launcher} job "
                     f"{launch.job!r}){also}: it did not start, or its node does not see {staged.parent} (-o must be on "
                     f"storage every node shares), or it was given another -o or --tag.{_sentence(_by_hand(launch))} "
                     "Nothing was written", "checkpoint")
            break
        say.tick(waited, timeout, lambda left, first: (
            f"rank 0 of {launch.world}{_why_split(launch) if first else ''}: "
            f"{'' if first else 'still '}waiting for the other {launch.world - 1} process(es) of this run to join in "
            f"the staging folder {staged}" + (" (each leaves its .shardkit-joined-<rank>.json there; MASTER_ADDR and "
                                              "MASTER_PORT only name the run, nothing listens there)" if first else "")
            + f"; {len(joined)} of {launch.world - 1} joined (missing: ranks {_ranks(missing)}); nothing is written "
            f"before they all do; giving up in {left:.0f} s (SHARDKIT_JOIN_TIMEOUT_S). {_by_hand(launch, first)}"
            + ("; else start the missing processes with the same command line" if first else "")))
        time.sleep(0.1)
    atomic_write_text(staged / VERDICT, json.dumps({"error": None if error is None else error[0],
                                                    "kind": None if error is None else error[1]}))
    if error is None:
        return
    # the processes that joined read why before the folder goes (an ack each, or LINGER_S)
    deadline = time.monotonic() + LINGER_S
    while time.monotonic() < deadline:
        acked = {n for n in _listing(staged) if n.startswith(".shardkit-seen-")}
        if all(SEEN.format(rank=r) in acked for r in joined - failed):
            break
        time.sleep(0.05)
    raise (UsageError if error[1] == "usage" else CheckpointError)(error[0])


# --- what a waiting process says --------------------------------------------------------------------

class _Reporter:
    """Says a waiting process's line once it has waited ``ANNOUNCE_AFTER_S``, then every interval."""

    def __init__(self, command: str) -> None:
        self.command = command
        # the seconds between two reports: SHARDKIT_SILENCE_S, with the one default every silent rank uses
        silence = read_seconds("SHARDKIT_SILENCE_S", float(SETTINGS["SHARDKIT_SILENCE_S"].default), during_run=True)
        self.interval = silence if silence > 0 else float("inf")  # 0: never report
        self.next_at = min(ANNOUNCE_AFTER_S, self.interval)
        self.spoken = False

    def tick(self, waited: float, limit: float, line: Callable[[float, bool], str]) -> None:
        """``line(seconds left of limit, first)``: the first line in full, the repeats shorter."""
        if waited < self.next_at:
            return
        print(f"shardkit {self.command}: {line(max(0.0, limit - waited), not self.spoken)}", file=sys.stderr,
              flush=True)
        self.spoken = True
        self.next_at = waited + self.interval


def _why_split(launch: Launch) -> str:
    """Which variables made this process rank r of N, as set."""
    shown_vars = " ".join(f"{k}={v}" for k, v in launch.variables)
    return f" (made so by {shown_vars})" if shown_vars else f" ({launch.launcher})"


def _by_hand(launch: Launch, first: bool = True) -> str:
    names = " ".join(k for k, _ in launch.variables)
    if not names:
        return ""
    if not first:
        return f"Started by hand? `unset {names}`"
    return (f"Started by hand in a shell that holds these variables (a pod's, a batch job's)? `unset {names}` and run "
            "it again as one process")


def _sentence(text: str) -> str:
    return f" {text}." if text else ""


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


# --- small file helpers ---------------------------------------------------------------------------------

def _pointer(launch: Launch) -> Path:
    """Where rank 0 says, on its node, which staging folder it claimed (processes given another -o find it)."""
    return Path(tempfile.gettempdir()) / f"shardkit-meet-{hashlib.sha256(launch.job.encode()).hexdigest()[:20]}.json"


def _write_pointer(pointer: Path, staged: Path, launch: Launch) -> None:
    with contextlib.suppress(OSError):
        atomic_write_text(pointer, json.dumps({"job": launch.job, "staged": str(staged.resolve()), "pid": os.getpid()}))


def _owned_by_me(path: Path) -> bool:
    """A pointer another user left in the shared temporary folder is never followed."""
    try:
        return path.stat().st_uid == os.getuid()
    except OSError:
        return False


def _listing(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return float("inf")


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
