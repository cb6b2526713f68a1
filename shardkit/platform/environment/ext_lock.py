"""Build locks left in the torch extensions cache: the ``lock`` file of a DeepSpeed JIT op build that
was killed midway, which makes every later process loading that op wait forever, printing nothing.

torch's ``cpp_extension.load`` (what DeepSpeed's ``OpBuilder.jit_load`` calls) serialises builds
with a ``FileBaton`` (torch/utils/file_baton.py): the builder creates ``<root>/<op>/lock`` with
O_CREAT|O_EXCL, keeps that descriptor open while ninja runs, and removes the file when done. Every
other process polls ``os.path.exists(lock)`` every 0.1 s, with no timeout and no output. A builder
ended by Ctrl-C at the wrong moment, a job time limit or the OOM killer never removes it
(pytorch#189245; the py-spy trace in DeepSpeedExamples#302 is every rank in ``FileBaton.wait``).

The lock holds no pid, so whether its builder is alive is decided from what this host can see
(:func:`inspect_locks`, the reasons are in :attr:`ExtensionLock.evidence`):

1. a process here holds the lock file open (the builder keeps its O_EXCL descriptor for the whole
   build), or has a file or its working directory in the op's build folder (ninja, the compiler):
   a build in progress;
2. none, and the folder is on a local filesystem: no other machine can be building there: stale;
3. none, but the folder is on a network filesystem (another node may be building in it, and its
   processes are not in this host's /proc), or the lock belongs to another user whose processes
   this one cannot inspect: stale once neither the lock nor anything in the folder has changed
   for :data:`DEFAULT_STALE_S` (``SHARDKIT_STALE_LOCK_S``), until then "cannot tell".

Nothing here imports torch: the cache folder is derived the way ``_get_build_directory`` does it.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Literal, Mapping

from shardkit.core.env_settings import read_seconds
from shardkit.core.findings import Finding, Severity

#: Seconds with no change to a lock and its build folder after which a lock nobody here holds is
#: called stale where this host cannot see every possible builder (network filesystem, another
#: user's lock). An op build writes an object file every few minutes at the slowest (one large
#: CUDA source); ten quiet minutes is not a build.
DEFAULT_STALE_S = 600.0
ENV_STALE_S = "SHARDKIT_STALE_LOCK_S"

# Filesystems another machine can write to: their builders are invisible in this host's /proc.
# fuse.* is counted as shared too (sshfs, ceph-fuse, gcsfuse ...): it cannot be told apart here.
_NETWORK_FS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "afs", "panfs",
    "wekafs", "pvfs2", "orangefs", "ocfs2", "gfs2", "9p", "virtiofs", "davfs", "ncpfs",
})

Verdict = Literal["building", "stale", "unknown"]


@dataclass(frozen=True)
class ExtensionLock:
    """One ``lock`` file found in the torch extensions cache, and what is known about its builder."""

    path: Path
    """The lock file (``<root>/<op>/lock``)."""
    op: str
    """The op (extension) whose build folder holds it: cpu_adam, fused_adam, ..."""
    verdict: Verdict
    """building: a process here is building it; stale: no builder anywhere; unknown: cannot tell yet."""
    age_s: float
    """Seconds since the lock was created (how long a live build has been running)."""
    quiet_s: float
    """Seconds since anything in the build folder (the lock included) last changed."""
    holders: tuple[str, ...] = ()
    """The processes here holding the lock or the build folder, as ``pid N (name)``."""
    evidence: str = ""
    """What the verdict rests on, in words (printed with it)."""

    @property
    def fix(self) -> str:
        return f"rm {shlex.quote(str(self.path))}"


def stale_after_s(environ: Mapping[str, str] | None = None, *, during_run: bool = False) -> float:
    """The quiet time after which an unseen builder counts as gone (``SHARDKIT_STALE_LOCK_S``). A value
    that is not seconds is refused naming it, or, ``during_run`` (a rank's watchdog), warned about once
    and the default used."""
    return read_seconds(ENV_STALE_S, DEFAULT_STALE_S, environ, during_run=during_run)


def _torch_build_tag() -> str | None:
    """torch.version.hip / torch.version.cuda read from torch/version.py without importing torch,
    as torch's ``_get_build_directory`` turns them into the folder tag (rocmXY > cuXY > cpu)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text("utf-8")
    except OSError:
        return None

    def field_of(name: str) -> str | None:
        m = re.search(rf"^{name}\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
        return m.group(1) if m else None

    hip, cuda = field_of("hip"), field_of("cuda")
    if hip:
        return f"rocm{hip.replace('.', '')}"
    return f"cu{cuda.replace('.', '')}" if cuda else "cpu"


def extension_root(environ: Mapping[str, str] | None = None) -> Path | None:
    """The folder whose ``<op>/lock`` files a process with ``environ`` would wait on:
    ``TORCH_EXTENSIONS_DIR`` as given, else ``realpath($XDG_CACHE_HOME or ~/.cache)/torch_extensions/
    py<major><minor><abiflags>_<cpu|cuXY|rocmXY>`` (torch's ``get_default_build_root``). None when
    torch is not installed and no TORCH_EXTENSIONS_DIR is set."""
    env = os.environ if environ is None else environ
    given = env.get("TORCH_EXTENSIONS_DIR")
    if given:
        return Path(given).expanduser()
    tag = _torch_build_tag()
    if tag is None:
        return None
    home = env.get("HOME") or os.path.expanduser("~")
    cache = env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(os.path.realpath(os.path.join(cache, "torch_extensions"))) / f"{py}_{tag}"


@dataclass
class _Processes:
    """What /proc shows about the processes that touch a set of build folders."""

    touching: dict[str, list[str]] = field(default_factory=dict)
    """build folder -> 'pid N (name)' of processes with the lock, a file or their cwd in it."""
    hidden_uids: set[int] = field(default_factory=set)
    """Owners of processes whose open files could not be read (another user's, without root)."""


def _proc_name(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _scan_processes(folders: Iterable[str], proc: Path = Path("/proc")) -> _Processes:
    """One pass over /proc: for each build folder, the live processes with a descriptor on a file
    in it (the builder's lock descriptor, ninja's and the compiler's files) or their working
    directory in it (torch runs ninja with cwd = the build folder). This process is left out."""
    wanted = {f.rstrip("/") for f in folders}
    out = _Processes()
    me = str(os.getpid())
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit() and p != me]
    except OSError:
        return out
    for pid in pids:
        paths: list[str] = []
        try:
            paths.append(os.readlink(proc / pid / "cwd"))
            for fd in os.listdir(proc / pid / "fd"):
                try:
                    paths.append(os.readlink(proc / pid / "fd" / fd))
                except OSError:
                    continue
        except PermissionError:
            try:
                out.hidden_uids.add((proc / pid).stat().st_uid)
            except OSError:
                pass
            continue
        except OSError:
            continue  # the process ended while being read
        for folder in wanted:
            if any(p == folder or p.startswith(folder + "/") for p in paths):
                out.touching.setdefault(folder, []).append(f"pid {pid} ({_proc_name(pid)})")
    return out


def _filesystem_of(path: Path, mounts: Path = Path("/proc/mounts")) -> str:
    """The filesystem type of the mount holding ``path`` (the longest mount point prefix)."""
    best, fstype = "", "unknown"
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        return fstype
    target = str(path)
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[1])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, parts[2]
    return fstype


def _is_shared(fstype: str) -> bool:
    return fstype in _NETWORK_FS or fstype.startswith("fuse") or fstype == "unknown"


def _newest_change(folder: Path, lock_mtime: float) -> float:
    """The latest mtime of the lock and of anything directly in the build folder (ninja writes its
    objects and .ninja_log there)."""
    newest = lock_mtime
    try:
        for entry in os.scandir(folder):
            try:
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
            except OSError:
                continue
    except OSError:
        pass
    return newest


def inspect_locks(
    environ: Mapping[str, str] | None = None,
    *,
    root: Path | None = None,
    now: float | None = None,
    stale_s: float | None = None,
    proc: Path = Path("/proc"),
    mounts: Path = Path("/proc/mounts"),
    during_run: bool = False,
) -> list[ExtensionLock]:
    """Every ``<op>/lock`` under the extensions root a process with ``environ`` uses (``root``
    overrides it), each with a verdict. No lock: no /proc scan (the common case costs one listdir).
    ``during_run``: called while a run goes on (a watchdog), so a bad SHARDKIT_STALE_LOCK_S warns."""
    root = root or extension_root(environ)
    if root is None or not root.is_dir():
        return []
    try:
        candidates = sorted(d / "lock" for d in root.iterdir() if d.is_dir() and (d / "lock").exists())
    except OSError:
        return []
    if not candidates:
        return []
    now = time.time() if now is None else now
    stale_s = stale_after_s(environ, during_run=during_run) if stale_s is None else stale_s
    folders = {str(c.parent.resolve()): c for c in candidates}
    seen = _scan_processes(folders, proc)
    my_uid = os.geteuid() if hasattr(os, "geteuid") else 0
    found: list[ExtensionLock] = []
    for folder, lock in folders.items():
        try:
            st = lock.stat()
        except OSError:
            continue  # released while we looked: the build finished
        age = max(0.0, now - st.st_mtime)
        quiet = max(0.0, now - _newest_change(lock.parent, st.st_mtime))
        holders = tuple(seen.touching.get(folder, ()))
        fstype = _filesystem_of(Path(folder), mounts)
        blind = st.st_uid != my_uid and st.st_uid in seen.hidden_uids
        common = dict(path=lock, op=lock.parent.name, age_s=age, quiet_s=quiet, holders=holders)
        if holders:
            found.append(ExtensionLock(
                verdict="building", **common,  # type: ignore[arg-type]
                evidence=f"{', '.join(holders)} on this host has the lock or the build folder open"))
            continue
        if not _is_shared(fstype) and not blind:
            found.append(ExtensionLock(
                verdict="stale", **common,  # type: ignore[arg-type]
                evidence=(f"no process on this host has the lock or the build folder open (checked /proc), and the "
                          f"folder is on a local filesystem ({fstype}), so no other machine can be building there")))
            continue
        where = (f"another user's lock (uid {st.st_uid}) whose processes this user cannot inspect" if blind else
                 f"a {fstype} filesystem another node may be building on")
        if quiet >= stale_s:
            found.append(ExtensionLock(
                verdict="stale", **common,  # type: ignore[arg-type]
                evidence=(f"no process on this host has it open, it is on {where}, and nothing in the build folder has "
                          f"changed for {quiet:.0f} s (>= {stale_s:.0f} s, {ENV_STALE_S})")))
        else:
            found.append(ExtensionLock(
                verdict="unknown", **common,  # type: ignore[arg-type]
                evidence=(f"no process on this host has it open, but it is on {where}, and the build folder changed "
                          f"{quiet:.0f} s ago (called stale after {stale_s:.0f} s quiet, {ENV_STALE_S})")))
    return found


def describe(lock: ExtensionLock) -> str:
    """One line: the lock, the verdict and what it rests on, and the fix."""
    if lock.verdict == "building":
        return (f"DeepSpeed/torch op {lock.op!r} is being built (lock {lock.path}, {lock.age_s:.0f} s old): {lock.evidence}. "
                "Ranks loading this op wait for that build to finish; nothing to do unless it never ends "
                f"(then stop that process and `{lock.fix}`)")
    if lock.verdict == "stale":
        return (f"stale build lock {lock.path} (op {lock.op!r}, {lock.age_s:.0f} s old), left by a build that was killed "
                f"midway: {lock.evidence}. Every process that loads {lock.op!r} would wait for it forever with no output. "
                f"Fix: `{lock.fix}` (safe: no build is running; the next run rebuilds the op)")
    return (f"build lock {lock.path} (op {lock.op!r}, {lock.age_s:.0f} s old) may be stale: {lock.evidence}. Ranks that "
            f"load {lock.op!r} wait while it exists. Fix: if no node is building {lock.op!r}, `{lock.fix}`")


def lock_findings(locks: Iterable[ExtensionLock]) -> list[Finding]:
    """Findings for `shardkit versions`: stale is an error (the run would hang), the others warnings."""
    out = []
    for lock in locks:
        severity = Severity.ERROR if lock.verdict == "stale" else Severity.WARNING
        message, _, fix = describe(lock).partition(" Fix: ")
        out.append(Finding(severity, "env:torch_extensions", str(lock.path), message,
                           fix or "none needed: the build in progress removes it when done", f"ext-lock:{lock.verdict}"))
    return out


def extension_lock_findings(environ: Mapping[str, str] | None = None) -> list[Finding]:
    """:func:`lock_findings` of this machine's extensions cache, as a process with ``environ`` sees it."""
    return lock_findings(inspect_locks(environ))
