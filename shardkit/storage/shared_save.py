"""One output written by several processes (on one node or many) without a process group: the
staging folder is claimed by one writer, every process writes its share of the files into it and
reports them in a part file, and process 0 seals: one manifest, then the usual publish (rename,
``latest`` last).

Coordination goes through the output's filesystem only (it must be shared between the nodes
anyway), so ``shardkit reshard`` under ``srun``/``torchrun`` needs neither torch.distributed nor a
rendezvous port. The files, all inside ``root/.shardkit-tmp-<tag>/``:

- ``.shardkit-owner.json``: the claim (job id, host, pid, and what the run was asked to do:
  ``storage.request``), made by process 0: the folder is built with it under a private name and renamed
  to the staging name, and it stays until the folder is renamed into place, so no run ever sees a
  live staging folder without it; another run finds it and refuses while the owner is alive, or
  removes it when the owner is gone (same host: its pid no longer exists; another host: no
  heartbeat for ``SHARDKIT_STALE_S``), and removes a folder with files but no owner file at once.
- ``.shardkit-joined-<rank>.json``, ``.shardkit-verdict.json``: the first contact, where the
  processes agree on the request before anything is written (``storage.shared_meet``).
- ``.shardkit-alive-<rank>``: touched every ``HEARTBEAT_S`` by each process while it writes.
- ``.shardkit-part-<rank>.json``: written last by each process: its files' sizes and digests, or
  the error that stopped it. Process 0 waits for every part; a process that never joins, stops
  its heartbeat or reports an error fails the run, named, and the staging folder is removed.

These bookkeeping files are removed before the folder is published, the owner file right after.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from shardkit.core import progress
from shardkit.core.env_settings import read_seconds
from shardkit.core.errors import CheckpointError, UsageError
from shardkit.platform.versions import SHARDKIT_VERSION
from shardkit.storage.atomic import atomic_write_text, publish_tag, remove_stale_saves, signals_deferred, staging_dir
from shardkit.storage.manifest import FileEntry, Manifest, write_manifest
from shardkit.storage.tags import LATEST_NAME

OWNER_NAME = ".shardkit-owner.json"
_PART = ".shardkit-part-{rank}.json"
_ALIVE = ".shardkit-alive-{rank}"
#: An *empty* staging folder younger than this without an owner file may be an older release's claim
#: under way (it made the folder, then the owner file); one holding files, or older, is a leftover.
CLAIM_GRACE_S = 30.0
#: ``<staging name>.claim-<pid>@<host>-<nonce>``: a claim being made (``_claim_folder``), judged by its
#: name until its owner file is written
_PRIVATE_CLAIM = re.compile(r"\.claim-(\d+)@(.+)-[0-9a-f]{8}$")
#: Seconds between heartbeats of a writing process.
HEARTBEAT_S = 5.0

#: Bookkeeping files of a staging folder, removed before it is published.
_BOOKKEEPING = (".shardkit-part-", ".shardkit-alive-", ".shardkit-joined-", ".shardkit-verdict", ".shardkit-seen-")


def stale_s() -> float:
    """``SHARDKIT_STALE_S`` (default 60): a claim or a heartbeat older than this belongs to a process
    that is gone (another host's process cannot be asked directly)."""
    return read_seconds("SHARDKIT_STALE_S", 60.0, during_run=True)


def join_timeout_s() -> float:
    """``SHARDKIT_JOIN_TIMEOUT_S`` (default 120): how long the processes of a split run wait for each
    other at first contact, before anything is written. Not shorter: the processes of a big ``srun``
    step or of pods that pull their image start tens of seconds apart, and a timeout that fails such
    a run costs a rerun; a process waiting longer than a moment says so at once (``shared_meet``)."""
    return read_seconds("SHARDKIT_JOIN_TIMEOUT_S", 120.0, during_run=True)


@dataclass(frozen=True)
class Launch:
    """Which share of the work this process does: process ``rank`` of ``world`` in job ``job``."""

    rank: int
    world: int
    job: str
    """The same on every process of one run, different for another run (staging folder ownership)."""
    launcher: str
    """Where rank and world came from, for messages ('srun', 'torchrun', 'single process')."""
    host: str
    variables: tuple[tuple[str, str], ...] = ()
    """The environment variables that made this process rank ``rank`` of ``world``, as set (messages
    name them: a shell that holds a pod's RANK/WORLD_SIZE is not a launcher)."""

    @property
    def distributed(self) -> bool:
        return self.world > 1


def launch_from_env(env: Mapping[str, str] | None = None, *, single: bool = False) -> Launch:
    """This process's share from the launcher's variables: an ``srun`` step (``SLURM_PROCID``,
    ``SLURM_STEP_NUM_TASKS``), ``torchrun`` or any launcher setting ``RANK``/``WORLD_SIZE``; else
    one process doing everything.

    An ``sbatch`` script itself (outside ``srun``) has ``SLURM_NTASKS`` but is one process: only
    a step's own task count is used, so the batch script never waits for processes it did not start.
    ``single=True``: this process does everything whatever the variables say.
    """
    env = os.environ if env is None else env
    host = socket.gethostname()
    if single:
        return Launch(0, 1, f"pid-{host}-{os.getpid()}-{time.time_ns()}", "single process", host)

    def ints(rank_key: str, world_key: str) -> tuple[int, int] | None:
        if rank_key not in env or world_key not in env:
            return None
        try:
            rank, world = int(env[rank_key]), int(env[world_key])
        except ValueError:
            raise UsageError(f"{rank_key}={env[rank_key]!r} / {world_key}={env[world_key]!r}: not integers; the "
                             "launcher's variables say which share of the files this process writes. Unset them "
                             "to run as a single process") from None
        if world < 1 or not 0 <= rank < world:
            raise UsageError(f"{rank_key}={rank} with {world_key}={world}: the rank must be in 0..{world - 1}. Fix the "
                             "launcher's variables, or unset them to run as a single process")
        return rank, world

    slurm = ints("SLURM_PROCID", "SLURM_STEP_NUM_TASKS")
    if slurm is not None and slurm[1] > 1:
        job = f"slurm-{env.get('SLURM_JOB_ID', '?')}.{env.get('SLURM_STEP_ID', '?')}"
        return Launch(slurm[0], slurm[1], job, "srun", host, _set(env, "SLURM_PROCID", "SLURM_STEP_NUM_TASKS",
                                                                 "SLURM_JOB_ID", "SLURM_STEP_ID"))
    torchrun = ints("RANK", "WORLD_SIZE")
    if torchrun is not None and torchrun[1] > 1:
        parts = [env.get("TORCHELASTIC_RUN_ID"), env.get("MASTER_ADDR"), env.get("MASTER_PORT"),
                 env.get("TORCHELASTIC_RESTART_COUNT")]
        if not any(parts[:3]):
            raise UsageError(f"RANK={torchrun[0]} WORLD_SIZE={torchrun[1]} without MASTER_ADDR/MASTER_PORT or "
                             "TORCHELASTIC_RUN_ID: the processes of one run cannot be told from another run's. Launch "
                             "with torchrun or srun, or unset RANK/WORLD_SIZE to run as a single process")
        return Launch(torchrun[0], torchrun[1], "torchrun-" + "-".join(p or "" for p in parts), "torchrun", host,
                      _set(env, "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"))
    return Launch(0, 1, f"pid-{host}-{os.getpid()}-{time.time_ns()}", "single process", host)


def _set(env: Mapping[str, str], *names: str) -> tuple[tuple[str, str], ...]:
    return tuple((n, env[n]) for n in names if n in env)


# --- the claim -------------------------------------------------------------------------------------

def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when it is missing, being replaced, or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return float("inf")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_alive(staged: Path, grace: float = 0.0) -> tuple[bool, str]:
    """Whether the run that made ``staged`` may still be writing into it, and who that is.

    A folder without an owner file is a killed save's leftover (older shardkit saves wrote none),
    unless one appears within ``grace`` seconds (an older release's claim wrote it right after its
    ``mkdir``; this release's claim appears with it), or it is a claim being made under its private
    name (``_claim_folder``), judged by the pid that name carries.
    """
    owner = read_json(staged / OWNER_NAME)
    deadline = time.monotonic() + grace
    while owner is None and time.monotonic() < deadline:
        time.sleep(0.02)
        owner = read_json(staged / OWNER_NAME)
    newest = min(_age(staged), _age(staged / OWNER_NAME))
    if owner is None:
        private = _PRIVATE_CLAIM.search(staged.name)
        if private is not None:  # a claim being made, before its owner file: its name says whose
            pid, host = int(private.group(1)), private.group(2)
            who = f"a claim being made by pid {pid} on host {host!r}"
            return (_pid_alive(pid) if host == socket.gethostname() else _age(staged) < stale_s()), who
        return False, f"a killed save (no {OWNER_NAME})"
    who = f"job {owner.get('job')!r}, pid {owner.get('pid')} on host {owner.get('host')!r}"
    if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int):
        return _pid_alive(owner["pid"]) and newest < 10 * stale_s(), who
    return newest < stale_s(), who


def claim(root: Path, tag: str, launch: Launch, *, sweep: bool = True, request: dict[str, Any] | None = None,
          request_digest: str | None = None) -> Path:
    """Process 0: create ``root`` and an empty staging folder for ``tag`` that this run owns.

    A staging folder left by a run that is gone is removed first (with the other leftovers of
    killed saves, ``atomic.remove_stale_saves``); one whose owner is alive is another writer of
    the same output: refused, naming it, and nothing of its files is touched. ``sweep=False``:
    leave the rest of ``root`` alone (a user's folder, not a checkpoint root: consolidate's output
    folder, where another consolidate's live temporary file must not be taken for a leftover).
    ``request``/``request_digest``: what this run was asked to do (``storage.request``), for the other
    processes to compare with theirs (``storage.shared_meet``).
    """
    root.mkdir(parents=True, exist_ok=True)
    staged = staging_dir(root, tag)
    owner = json.dumps({"job": launch.job, "host": launch.host, "pid": os.getpid(), "world": launch.world,
                        "started": time.time(), "shardkit": SHARDKIT_VERSION, "request": request,
                        "request_digest": request_digest})
    for _ in range(3):
        try:
            # the folder appears under the staging name with its owner file already in it (made under a
            # private name, then renamed), and a Ctrl-C or SIGTERM waits for the step: whatever stops this
            # run afterwards finds its claim by the owner file and removes it (remove_own_claim), and no
            # run ever sees a live claim without one. A mask on the main thread held nothing back here:
            # the kernel hands a process's SIGINT to a thread that does not block it (the progress
            # thread), and the main thread then raised between the mkdir and the owner file, leaving an
            # empty staging folder that the next run took for a claim under way
            with signals_deferred():
                made = _claim_folder(staged, owner)
            if not made:
                alive, who = owner_alive(staged, grace=1.0)
                if not alive and _claim_under_way(staged):
                    alive, who = True, f"a run claiming it right now ({OWNER_NAME} not written yet)"
                if alive:
                    raise CheckpointError(
                        f"{root / tag}: another shardkit run ({who}) is writing this output right now (its staging "
                        f"folder {staged} is live). One writer per output: wait for it to finish, or write to another "
                        f"-o/--tag. If no such run exists (it was killed on another host), remove {staged}")
                shutil.rmtree(staged, ignore_errors=True)
                continue
            if sweep:
                remove_stale_saves(root, keep=staged.name, is_live=lambda d: owner_alive(d)[0])
        except BaseException:
            with signals_deferred():  # a second signal must not cut the removal short
                remove_own_claim(staged, launch)  # an interrupt or error after the claim leaves nothing either
            raise
        return staged
    raise CheckpointError(f"{staged}: could not be claimed (it kept coming back); is another run writing {root / tag}?")


def _claim_folder(staged: Path, owner: str) -> bool:
    """Make ``staged`` holding the owner file ``owner`` from its first moment; False if it exists.

    Built under a private name beside it (``<staging name>.claim-<pid>@<host>-<nonce>``: a sweep
    tells a live one from a killed one's by that pid, ``owner_alive``), then renamed. ``rename`` puts a folder
    over an *empty* one, so the name is looked up first; the one folder it could still replace is
    an older release's claim in the instant between its ``mkdir`` and its owner file."""
    if os.path.lexists(staged):
        return False
    private = staged.with_name(f"{staged.name}.claim-{os.getpid()}@{socket.gethostname()}-{uuid.uuid4().hex[:8]}")
    private.mkdir()
    try:
        atomic_write_text(private / OWNER_NAME, owner)
        try:
            os.rename(private, staged)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):  # another claim won the name meanwhile
                shutil.rmtree(private, ignore_errors=True)
                return False
            raise
    except BaseException:
        shutil.rmtree(private, ignore_errors=True)
        raise
    return True


def _claim_under_way(staged: Path) -> bool:
    """Whether ``staged``, which has no owner file, may still be a claim being made.

    Never by this release: its claims appear with their owner file (``_claim_folder``) and keep it
    until the folder is renamed into place (``seal``, ``staged_save``), so a folder without one has
    no live owner. An older release made the folder first and wrote the owner file right after,
    before any content; for such a claim paused between the two on a loaded machine, an *empty*
    folder younger than ``CLAIM_GRACE_S`` is left alone. A folder holding anything (a rank file a
    killed run wrote) is a leftover at any age: it was refused for ``CLAIM_GRACE_S`` before."""
    try:
        with os.scandir(staged) as entries:
            if any(True for _ in entries):
                return False
    except OSError:
        return False
    return _age(staged) < CLAIM_GRACE_S


def remove_own_claim(staged: Path, launch: Launch) -> None:
    """Remove the staging folder ``staged`` if this run claimed it (its owner file names this job):
    the clean-up after any failure or interrupt, which need not know how far the claim got."""
    owner = read_json(staged / OWNER_NAME)
    if owner is not None and owner.get("job") == launch.job and owner.get("pid") == os.getpid():
        shutil.rmtree(staged, ignore_errors=True)


# --- heartbeats and parts --------------------------------------------------------------------------

@contextlib.contextmanager
def heartbeat(staged: Path, rank: int, *, alive_file: bool = True) -> Iterator[None]:
    """Touch this process's alive file (and, for rank 0, the claim) every ``HEARTBEAT_S`` while the
    block runs. ``alive_file=False``: the claim only (a save whose ranks meet in a process group).

    The alive file holds this process's bytes written and expected (``core.progress.counts``), so
    rank 0's progress line adds up the whole job (``progress.watch_peers``) without a message."""
    own = staged / _ALIVE.format(rank=rank) if alive_file else None
    paths = ([own] if own is not None else []) + ([staged / OWNER_NAME] if rank == 0 else [])
    stop = threading.Event()
    # at least three beats per SHARDKIT_STALE_S, so a short one (tests set 3 s) never sees a live process as gone
    interval = min(HEARTBEAT_S, stale_s() / 3)

    def beat() -> None:
        while True:
            for p in paths:
                with contextlib.suppress(OSError):
                    if p == own:
                        p.write_text("%d %d\n" % progress.counts())
                    else:
                        os.utime(p)  # not touch(): an owner file removed meanwhile is not made again, empty
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, name="shardkit-heartbeat", daemon=True)
    try:
        # started inside the try: an interrupt landing before it left the thread beating on, writing
        # its alive file into the staging folder while the clean-up removed it; and with signals held:
        # start waits for the new thread, and an interrupt in that wait, before the thread had its
        # ident, skipped the join below (a reshard stopped so left .shardkit-alive-0 behind)
        with signals_deferred():
            thread.start()
        if rank == 0 and own is not None:
            progress.watch_peers(lambda: _peer_counts(staged, own))
        yield
    finally:
        stop.set()
        if thread.ident is not None:  # started
            with signals_deferred():  # a second Ctrl-C must not leave it writing while the folder is removed
                thread.join()
        if own is not None and rank != 0:
            with contextlib.suppress(OSError):
                own.write_text("%d %d\n" % progress.counts())  # the final count, for rank 0's closing line
        if rank == 0 and own is not None:
            final = _peer_counts(staged, own)
            progress.watch_peers(lambda: final)  # the staging folder is sealed next: keep what it last said


def _peer_counts(staged: Path, own: Path) -> list[tuple[int, int]]:
    """(bytes written, expected) from every other process's alive file that holds them yet."""
    found = []
    for path in staged.glob(_ALIVE.format(rank="*")):
        if path == own:
            continue
        try:
            done, expected = (int(x) for x in path.read_text().split())
        except (OSError, ValueError):  # not written yet, or caught mid-write: next time
            continue
        if expected > 0:  # a process that has not planned its share yet says nothing about the job
            found.append((done, expected))
    return found


def write_part(staged: Path, launch: Launch, files: list[FileEntry], error: str | None) -> None:
    """Report this process's share: the files it wrote, or the error that stopped it."""
    body = {"rank": launch.rank, "host": launch.host, "pid": os.getpid(), "error": error,
            "files": [[e.path, e.size, e.algorithm, e.digest] for e in files]}
    atomic_write_text(staged / _PART.format(rank=launch.rank), json.dumps(body))


def gather_parts(staged: Path, launch: Launch, started: float) -> list[FileEntry]:
    """Process 0: every process's files, once all have reported; CheckpointError naming the first
    process that failed, stopped its heartbeat, or never joined."""
    got: dict[int, list[FileEntry]] = {}
    while len(got) < launch.world:
        for rank in range(launch.world):
            if rank in got:
                continue
            part = read_json(staged / _PART.format(rank=rank))
            if part is not None:
                if part.get("error"):
                    raise CheckpointError(f"rank {rank} of {launch.world} (host {part.get('host')!r}, pid {part.get('pid')}) "
                                          f"failed writing its share: {part['error']}")
                got[rank] = [FileEntry.of(str(f[0]), int(f[1]), str(f[2]), str(f[3])) for f in part.get("files") or []]
                continue
            alive = staged / _ALIVE.format(rank=rank)
            if alive.exists() and _age(alive) > stale_s():
                raise CheckpointError(
                    f"rank {rank} of {launch.world} stopped while writing its share: no heartbeat for {_age(alive):.0f} s "
                    f"(killed, or its node went down). Its files are incomplete; run the whole command again")
            if not alive.exists() and time.monotonic() - started > join_timeout_s():
                raise CheckpointError(
                    f"rank {rank} of {launch.world} never joined within {join_timeout_s():.0f} s ({launch.launcher} job "
                    f"{launch.job!r}): it did not start, or its node does not see {staged.parent} (-o must be on storage "
                    "every node shares). Run the whole command again")
        if len(got) < launch.world:
            time.sleep(0.1)
    return [e for rank in sorted(got) for e in got[rank]]


def seal(staged: Path, root: Path, tag: str, manifest: Manifest | None) -> Path:
    """Process 0: remove the bookkeeping files, write the manifest (the completion marker) and
    publish the tag (rename into place, ``latest`` last); the owner file is removed once renamed."""
    for p in staged.iterdir():
        if p.name.startswith(_BOOKKEEPING):
            p.unlink()
    if manifest is not None:
        write_manifest(staged, manifest)
    # the owner file goes last, from the published folder: a staging folder without one is never live
    return publish_tag(root, staged, tag, drop=(OWNER_NAME,))


def outcome_unchanged(root: Path) -> str:
    return f"nothing written: the staging folder was removed, {root / LATEST_NAME} is unchanged"


def split_by_bytes(sizes: list[int], shares: int) -> list[list[int]]:
    """Indices of ``sizes`` dealt into ``shares`` lists of about equal total (largest first, each
    to the lightest share so far); every process computes the same split from the same plan."""
    out: list[list[int]] = [[] for _ in range(shares)]
    load = [0] * shares
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        k = min(range(shares), key=lambda k: (load[k], k))
        out[k].append(i)
        load[k] += sizes[i] + 1  # +1: empty files still spread
    return out
