"""A Ctrl-C landing as a write's staging folder appears, or as its writer threads start, leaves no
``.shardkit-tmp-<tag>/`` behind, and a staging folder that provably has no live owner never holds up
the next run.

Measured on a loaded 2-core machine before the fix (a loop of real ``shardkit reshard`` of a 2-rank
ZeRO-3 save to 3 ranks, SIGINT sent as the staging folder appeared): 4 of 20 tries left an empty
staging folder without an owner file, and each rerun was refused as "a run claiming it right now".
The claim held SIGINT with a signal mask on the main thread only, so the kernel handed the signal to
the progress thread and the main thread raised KeyboardInterrupt between the ``mkdir`` and the owner
file. Separately, an interrupt landing while the thread pool started a writer thread left a thread
the pool never joins, which wrote a whole rank file after the clean-up had emptied the folder.

Each test makes the signal arrive at one exact step from a stand-in (as tests/test_signal_windows.py
does), through the real ``shardkit reshard`` command on a real DeepSpeed save.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from shardkit.storage.tags import STAGING_PREFIX

STAGED = f"{STAGING_PREFIX}global_step2"


class _OtherThread:
    """A thread started before the command (as the progress thread is) that raises SIGINT on request:
    the kernel hands a process's SIGINT to such a thread while the main thread blocks it; the C handler
    runs there, the Python handler at the main thread's next bytecode. (A thread started inside a block
    that masks SIGINT would inherit the mask, so it is started first.)"""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        self.signum = signum
        self.asked, self.done = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, name="stand-in-progress", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.asked.wait()
        signal.raise_signal(self.signum)
        self.done.set()

    def send(self) -> None:
        self.asked.set()
        self.done.wait(10)


def _reshard(sweep_sources, run_cli, out: Path) -> tuple[int, str]:
    code, _, err = run_cli("reshard", sweep_sources.root("zero3"), "--world-size", "3", "-o", out, "--workers", "2")
    return code, err


@pytest.mark.slow
def test_ctrl_c_as_the_staging_folder_appears_leaves_nothing_and_the_rerun_runs(sweep_sources, tmp_path, run_cli,
                                                                                monkeypatch):
    out = tmp_path / "out"
    real_mkdir, real_rename, real_replace = os.mkdir, os.rename, os.replace
    fired: list[str] = []
    other = _OtherThread()

    def then_sigint(name: str) -> None:
        if name == STAGED and not fired:
            fired.append(name)
            other.send()

    def mkdir(path, *args, **kwargs):
        real_mkdir(path, *args, **kwargs)
        then_sigint(Path(path).name)

    def rename(src, dst, *args, **kwargs):
        real_rename(src, dst, *args, **kwargs)
        then_sigint(Path(dst).name)

    def replace(src, dst, *args, **kwargs):
        real_replace(src, dst, *args, **kwargs)
        then_sigint(Path(dst).name)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    code, err = _reshard(sweep_sources, run_cli, out)
    monkeypatch.undo()
    assert fired and code == 130, err
    assert "shardkit reshard: interrupted" in err
    assert (sorted(os.listdir(out)) if out.exists() else []) == []
    code, err = _reshard(sweep_sources, run_cli, out)
    assert code == 0, err
    assert {"global_step2", "latest"} <= set(os.listdir(out))
    assert [n for n in os.listdir(out) if n.startswith(STAGING_PREFIX)] == []


@pytest.mark.slow
def test_ctrl_c_as_a_writer_thread_starts_leaves_no_thread_writing_after_the_clean_up(sweep_sources, tmp_path, run_cli,
                                                                                      monkeypatch):
    # the interrupt lands in Thread.start (it waits for the new thread to run) before the pool records the
    # thread: the pool's shutdown never joined it, and it wrote its rank file while the clean-up removed the
    # folder; the removal's last step (rmdir) waits here for any such write, so the old code leaves the
    # folder with a whole rank file and no owner file, every time
    import shardkit.checkpoint.ops.reshard as reshard

    out = tmp_path / "out"
    real_start, real_write, real_rmdir = threading.Thread.start, reshard.write_torch_zip, os.rmdir
    fired: list[str] = []
    writing = threading.Semaphore(0)
    running: list[int] = [0]
    lock = threading.Lock()

    def start(self):
        real_start(self)
        if self.name.startswith("shardkit-reshard") and not fired:
            fired.append(self.name)
            signal.raise_signal(signal.SIGINT)

    def write(path, *args, **kwargs):
        with lock:
            running[0] += 1
        try:
            time.sleep(0.2)  # long enough for the clean-up to begin, where a writer outlives the interrupt
            return real_write(path, *args, **kwargs)
        finally:
            with lock:
                running[0] -= 1
            writing.release()

    def rmdir(path, *args, **kwargs):
        if Path(path).name == STAGED:
            deadline = time.monotonic() + 5
            while running[0] and time.monotonic() < deadline:
                writing.acquire(timeout=0.1)
        real_rmdir(path, *args, **kwargs)

    monkeypatch.setattr(threading.Thread, "start", start)
    monkeypatch.setattr(reshard, "write_torch_zip", write)
    monkeypatch.setattr(os, "rmdir", rmdir)
    before = set(threading.enumerate())
    code, err = _reshard(sweep_sources, run_cli, out)
    stragglers = [t for t in set(threading.enumerate()) - before if t.name.startswith("shardkit-reshard")]
    for t in stragglers:
        t.join(10)
    monkeypatch.undo()
    assert fired and code == 130, err
    assert (sorted(os.listdir(out)) if out.exists() else []) == []
    assert stragglers == [], "writer threads still running after the command returned"


def test_a_staging_folder_with_files_and_no_owner_is_removed_at_once(tmp_path):
    # what the old code left (a rank file, no owner file): since a claim's folder holds its owner file from
    # the moment it appears under the staging name until it is renamed into place, such a folder has no live
    # owner, however young; it was refused as "a run claiming it right now" for CLAIM_GRACE_S
    from shardkit.storage.atomic import staging_dir
    from shardkit.storage.shared_save import OWNER_NAME, Launch, claim

    staged = staging_dir(tmp_path, "global_step2")
    staged.mkdir()
    (staged / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * 100)
    started = time.monotonic()
    assert claim(tmp_path, "global_step2", Launch(0, 1, "job-a", "single process", "host")) == staged
    assert time.monotonic() - started < 5
    assert sorted(p.name for p in staged.iterdir()) == [OWNER_NAME]


def test_a_claim_never_shows_its_staging_folder_without_its_owner_file(tmp_path, monkeypatch):
    # the owner record is written before the folder takes the staging name: an observer (another run
    # judging it) that sees the folder sees its owner
    from shardkit.storage.atomic import staging_dir
    from shardkit.storage.shared_save import OWNER_NAME, Launch, claim, read_json

    staged = staging_dir(tmp_path, "global_step2")
    seen: list[object] = []
    real_mkdir, real_rename = os.mkdir, os.rename

    def look(path) -> None:
        if staged.exists():
            seen.append(read_json(staged / OWNER_NAME))

    def mkdir(path, *args, **kwargs):
        real_mkdir(path, *args, **kwargs)
        look(path)

    def rename(src, dst, *args, **kwargs):
        real_rename(src, dst, *args, **kwargs)
        look(dst)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "rename", rename)
    claim(tmp_path, "global_step2", Launch(0, 1, "job-a", "single process", "host"))
    monkeypatch.undo()
    assert seen and all(isinstance(s, dict) and s["job"] == "job-a" for s in seen), seen
    shutil.rmtree(staged)


def test_ctrl_c_while_the_heartbeat_thread_starts_stops_the_heartbeat(tmp_path, monkeypatch):
    # Thread.start waits for the new thread; an interrupt in that wait, before the thread had its ident,
    # skipped the heartbeat's join: it wrote .shardkit-alive-0 after the clean-up (2 of 20 real reshards
    # stopped as the staging folder appeared left a folder holding only that file)
    import shardkit.storage.shared_save as shared_save

    real_start_new = threading._start_new_thread  # type: ignore[attr-defined]
    fired: list[str] = []

    def start_new(fn, args, *rest):
        owner = getattr(fn, "__self__", None)
        if not isinstance(owner, threading.Thread) or owner.name != "shardkit-heartbeat" or fired:
            return real_start_new(fn, args, *rest)
        fired.append(owner.name)
        gate = threading.Event()

        def late(*a):
            gate.wait(0.5)  # not yet running when the interrupt lands in start's wait
            fn(*a)

        ident = real_start_new(late, args, *rest)
        signal.raise_signal(signal.SIGINT)
        return ident

    staged = tmp_path / STAGED
    staged.mkdir()
    monkeypatch.setattr(threading, "_start_new_thread", start_new)
    before = set(threading.enumerate())
    with pytest.raises(KeyboardInterrupt):
        with shared_save.heartbeat(staged, 0):
            pass
    monkeypatch.undo()
    left = [t for t in set(threading.enumerate()) - before if t.name == "shardkit-heartbeat"]
    for t in left:
        t.join(5)
    assert fired and left == []


def test_a_universal_write_in_progress_is_refused_by_name_not_removed_by_another_writer(tmp_path, monkeypatch):
    # write_universal staged without an owner file: a claim-based writer of the same output (convert --to
    # universal) would take its folder, files and all, for a killed run's leftover and remove it
    import shardkit.checkpoint.writers.universal as universal
    from shardkit.core.errors import CheckpointError
    from shardkit.storage.shared_save import Launch, claim

    refused: list[str] = []

    def write_while_another_run_claims(ckpt, staged, *args):
        (staged / "zero" / "w").mkdir(parents=True)
        (staged / "zero" / "w" / "fp32.pt").write_bytes(b"written")
        with pytest.raises(CheckpointError, match=r"another shardkit run \(job 'pid-.*\) is writing this output right "
                                                  r"now") as e:
            claim(tmp_path / "universal", "global_step2", Launch(0, 1, "job-b", "single process", "host"))
        refused.append(str(e.value))
        assert (staged / "zero" / "w" / "fp32.pt").read_bytes() == b"written"

    class Model:
        trainable: list[str] = []

    monkeypatch.setattr(universal, "universal_state_keys", lambda ckpt: [])
    monkeypatch.setattr(universal, "_write", write_while_another_run_claims)
    final = universal.write_universal(Model(), tmp_path / "universal", "global_step2")
    assert refused and sorted(os.listdir(final)) == ["zero"]


def test_a_signal_another_thread_takes_while_the_handlers_are_swapped_waits_for_the_clean_up(monkeypatch):
    # signals_deferred swaps SIGINT's handler, then SIGTERM's, with both masked on the main thread; a
    # SIGTERM the kernel hands to another thread meanwhile ran the CLI's handler at the second swap: its
    # exception skipped the clean-up the block holds and left SIGINT's handler recording for the rest of the run
    from shardkit.cli import Terminated
    from shardkit.storage.atomic import signals_deferred

    def terminated(signum, frame):
        raise Terminated()

    previous_term = signal.signal(signal.SIGTERM, terminated)
    int_before = signal.getsignal(signal.SIGINT)
    other = _OtherThread(signal.SIGTERM)
    real_signal, swaps, steps = signal.signal, [], []

    def swap_then_sigterm_elsewhere(sig, handler):
        previous = real_signal(sig, handler)
        swaps.append(sig)
        if len(swaps) == 1:
            other.send()
        return previous

    monkeypatch.setattr(signal, "signal", swap_then_sigterm_elsewhere)
    try:
        with pytest.raises(Terminated):
            with signals_deferred():
                monkeypatch.setattr(signal, "signal", real_signal)
                steps.append("clean-up finished")
    finally:
        monkeypatch.undo()
        int_after, term_after = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous_term)
        signal.signal(signal.SIGINT, int_before)
    assert steps == ["clean-up finished"]
    assert int_after is int_before and term_after is terminated
