"""Atomic writes: the old content survives any failure during a write; `latest` keeps DeepSpeed's format."""

import os
import re

import pytest

from shardkit.storage.atomic import (
    atomic_open,
    atomic_save,
    atomic_write_text,
    publish_dir,
    staging_dir,
    write_latest,
)
from shardkit.storage.tags import read_latest


def test_failed_write_leaves_the_old_file_and_no_temporaries(tmp_path):
    target = tmp_path / "ckpt.pt"
    atomic_write_text(target, "old")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_open(target, "wb") as fh:
            fh.write(b"half of the new")
            raise RuntimeError("disk full")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["ckpt.pt"]



def test_an_interrupt_landing_as_the_temporary_is_created_removes_it(tmp_path, monkeypatch):
    # CI: SIGTERM (the CLI raises it as an exception at the next bytecode) arrived just as open()
    # returned, before the file object was bound: the temporary stayed, though the run said removed
    import builtins

    from shardkit.storage import atomic

    def open_then_interrupted(path, mode="r", *args, **kwargs):
        builtins.open(path, mode, *args, **kwargs).close()  # the file exists, as after the syscall
        raise KeyboardInterrupt

    target = tmp_path / "model.safetensors"
    atomic_write_text(target, "old")
    monkeypatch.setattr(atomic, "open", open_then_interrupted, raising=False)
    with pytest.raises(KeyboardInterrupt):
        with atomic_open(target, "wb"):
            pass
    assert os.listdir(tmp_path) == ["model.safetensors"]
    assert target.read_text() == "old"

def test_atomic_save_round_trips_a_tensor(tmp_path):
    import torch

    atomic_save({"w": torch.arange(4)}, tmp_path / "s.pt")
    assert torch.equal(torch.load(tmp_path / "s.pt", weights_only=True)["w"], torch.arange(4))


def test_latest_is_the_bare_tag_deepspeed_reads(tmp_path):
    write_latest(tmp_path, "global_step7")
    assert (tmp_path / "latest").read_bytes() == b"global_step7"  # engine.load_checkpoint reads it verbatim
    assert read_latest(tmp_path) == "global_step7"
    assert read_latest(tmp_path / "nowhere") is None


def test_publish_dir_replaces_an_existing_tag_whole(tmp_path):
    final = tmp_path / "step1"
    final.mkdir()
    (final / "a").write_text("old")
    (final / "stale").write_text("x")
    staged = staging_dir(tmp_path, "step1")
    staged.mkdir()
    (staged / "a").write_text("new")
    publish_dir(staged, final)
    assert sorted(os.listdir(final)) == ["a"] and (final / "a").read_text() == "new"
    assert os.listdir(tmp_path) == ["step1"]


def test_sigkill_during_save_training_keeps_previous_checkpoint(tmp_path):
    """A real SIGKILL in the middle of a save (one process, no DeepSpeed): `latest` and the previous
    checkpoint are untouched and resume works; the half-written save never becomes a tag."""
    import torch

    from shardkit.checkpoint.ops.torch_training import resume_training
    from shardkit.run.spawn.process import run_ranks
    from shardkit.storage.verify import verify_checkpoint
    from tests import _ranks_ckpt as targets

    root = tmp_path / "root"
    [res] = run_ranks(targets.torch_save_then_die, 1, args=(str(root),), timeout=120, backend="gloo",
                      raise_on_error=False)
    assert res.exitcode == -9
    assert (root / "latest").read_text() == "step1" and not (root / "step2").exists()
    staged = os.listdir(root / ".shardkit-tmp-step2")
    assert "model.pt" in staged and "optimizer.pt" not in staged  # killed mid-save, before the rename
    assert verify_checkpoint(root).ok
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    assert resume_training(root, model=model, optimizer=opt).step == 1
    assert int(opt.state[model.weight]["step"]) == 1


def _linear_and_adam(seed: int):
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_leftovers_of_killed_saves_of_other_tags_are_removed_before_a_save(tmp_path):
    from shardkit.checkpoint.ops.torch_training import save_training

    root = tmp_path / "root"
    (root / ".shardkit-tmp-step7").mkdir(parents=True)
    (root / ".shardkit-tmp-step7" / "model.pt").write_bytes(b"half")
    (root / ".latest.tmp-123-abcdef01").write_text("step7")
    (root / ".shardkit_manifest.json.tmp-9-00000000").write_text("{")
    model, opt = _linear_and_adam(0)
    save_training(root, model=model, optimizer=opt, step=1)
    assert sorted(os.listdir(root)) == ["latest", "step1"]


def test_crash_between_the_two_renames_of_a_resave_leaves_latest_loadable(tmp_path, monkeypatch):
    """Re-saving the tag 'latest' names: a crash after the old folder was moved aside and before
    the new one was renamed into place leaves 'latest' naming a complete copy of the old one."""
    import torch

    import shardkit.storage.atomic as atomic
    from shardkit.checkpoint.ops.torch_training import resume_training, save_training
    from shardkit.core.errors import CheckpointError
    from shardkit.storage.verify import verify_checkpoint

    root = tmp_path / "root"
    model, opt = _linear_and_adam(0)
    save_training(root, model=model, optimizer=opt, step=1, tag="ckpt")
    saved_weight = model.weight.detach().clone()
    real_rename, calls = atomic._rename, []

    def rename_then_crash(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # old folder moved aside; the new one is not in place yet
            raise OSError(28, "No space left on device")
        real_rename(src, dst)

    monkeypatch.setattr(atomic, "_rename", rename_then_crash)
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(CheckpointError, match=r"ckpt: the save was written but could not be completed on rank 0 "
                       r"\(OSError: .*No space left on device\); 'latest' was not moved to it"):
        save_training(root, model=model, optimizer=opt, step=2, tag="ckpt")
    monkeypatch.setattr(atomic, "_rename", real_rename)
    latest = read_latest(root)
    assert latest.startswith("ckpt.shardkit-replaced-") and (root / latest).is_dir()
    assert verify_checkpoint(root).ok
    fresh = torch.nn.Linear(4, 4)
    assert resume_training(root, model=fresh).step == 1
    assert torch.equal(fresh.weight, saved_weight)
    # the next save completes and clears what the crash left behind
    save_training(root, model=model, optimizer=opt, step=2, tag="ckpt")
    assert read_latest(root) == "ckpt" and resume_training(root, model=fresh).step == 2
    save_training(root, model=model, optimizer=opt, step=3, tag="ckpt")
    assert sorted(os.listdir(root)) == ["ckpt", "latest"]


def test_resaving_the_latest_tag_replaces_it_whole(tmp_path):
    from shardkit.checkpoint.ops.torch_training import resume_training, save_training

    root = tmp_path / "root"
    model, opt = _linear_and_adam(0)
    save_training(root, model=model, optimizer=opt, step=1, tag="ckpt")
    save_training(root, model=model, step=2, tag="ckpt")  # now without optimizer
    assert sorted(os.listdir(root)) == ["ckpt", "latest"] and not (root / "ckpt" / "optimizer.pt").exists()
    assert resume_training(root, model=model).step == 2


@pytest.mark.parametrize("target, match", [
    ("torch_save_when_rank0_cannot_finish",
     r"^CheckpointError: .*step1: the save was written but could not be completed on rank 0 \(IsADirectoryError"),
    ("torch_save_when_rank1_fails_writing",
     r"(CheckpointError: saving 'step1' in .* failed on rank 1 \(RuntimeError: cannot pickle|"
     r"RuntimeError: cannot pickle)"),
], ids=["rank0-publish-fails", "rank1-write-fails"])
def test_a_save_failing_on_one_rank_raises_on_every_rank_without_hanging(tmp_path, target, match):
    from shardkit.run.spawn.process import run_ranks
    from tests import _ranks_ckpt as targets

    root = tmp_path / "root"
    (root / "latest" / "blocker").mkdir(parents=True)  # 'latest' cannot be replaced: only rank 0 notices
    if target == "torch_save_when_rank1_fails_writing":
        (root / "latest" / "blocker").rmdir()
        (root / "latest").rmdir()
    results = run_ranks(getattr(targets, target), 2, args=(str(root),), timeout=120, backend="gloo")
    msgs = [r.value for r in results]
    for m in msgs:
        assert re.match(match, m), m
    if target == "torch_save_when_rank0_cannot_finish":
        assert msgs[0] == msgs[1]  # the same error on every rank
    else:
        assert msgs[0].startswith("CheckpointError: saving 'step1'") and not (root / "step1").exists()


def test_latest_that_is_not_text_names_the_file_and_the_fix(tmp_path):
    from shardkit.core.errors import CheckpointError

    (tmp_path / "latest").write_bytes(b"\xff\xfe\x00step")
    with pytest.raises(CheckpointError, match=r"latest: not a tag name \(7 bytes, not UTF-8 text.*Write the tag of a "
                       r"complete checkpoint into it"):
        read_latest(tmp_path)


def test_crash_while_resaving_an_older_tag_keeps_it_and_the_next_save_restores_it(tmp_path, monkeypatch):
    import shardkit.storage.atomic as atomic
    from shardkit.checkpoint.ops.torch_training import resume_training, save_training
    from shardkit.core.errors import CheckpointError

    root = tmp_path / "root"
    model, opt = _linear_and_adam(0)
    save_training(root, model=model, step=1, tag="a")
    save_training(root, model=model, step=2, tag="b")
    real_rename, calls = atomic._rename, []

    def rename_then_crash(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_rename(src, dst)

    monkeypatch.setattr(atomic, "_rename", rename_then_crash)
    with pytest.raises(CheckpointError, match="could not be completed on rank 0"):
        save_training(root, model=model, step=3, tag="a")  # 'a' is not the latest
    monkeypatch.setattr(atomic, "_rename", real_rename)
    assert read_latest(root) == "b" and not (root / "a").exists()
    [kept] = [d for d in os.listdir(root) if d.startswith("a.shardkit-replaced-")]
    assert resume_training(root / kept, model=model).step == 1  # loadable under its set-aside name
    save_training(root, model=model, step=4, tag="c")
    assert sorted(os.listdir(root)) == ["a", "b", "c", "latest"]
    assert resume_training(root / "a", model=model).step == 1


@pytest.mark.parametrize("tag, why", [
    (".shardkit-tmp-step1", "staging folders, deleted by the next save"),
    ("latest", "the pointer file DeepSpeed reads the tag from"),
    ("a/b", "path separators"),
    ("..", "'.' and '..' are not folder names"),
    ("step1.shardkit-replaced-0123abcd", "set-aside copies"),
])
def test_tags_that_collide_with_internal_names_are_refused_before_anything_is_written(tmp_path, tag, why):
    """A tag named like a staging folder used to be written, then deleted by the next save."""
    from shardkit.checkpoint.ops.torch_training import save_training
    from shardkit.core.errors import UsageError

    root = tmp_path / "root"
    model, _ = _linear_and_adam(0)
    save_training(root, model=model, step=1)
    with pytest.raises(UsageError, match=rf"tag {re.escape(repr(tag))}: not a usable checkpoint tag \(.*{re.escape(why)}"):
        save_training(root, model=model, step=2, tag=tag)
    assert sorted(os.listdir(root)) == ["latest", "step1"] and read_latest(root) == "step1"


def _enospc(path):
    import errno

    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_disk_full_while_writing_says_where_and_how_much_is_free_and_leaves_nothing(tmp_path):
    from shardkit.core.errors import CheckpointError
    from shardkit.storage.staged_save import atomic_checkpoint

    root = tmp_path / "root"
    with atomic_checkpoint(root, "a", engine="torch") as save:
        (save.path / "model.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"^disk full at .*\.shardkit-tmp-b/model\.pt, [\d,]+ bytes free, nothing "
                       r"written: the staging folder was removed, .*latest is unchanged \(OSError: .*No space left"):
        with atomic_checkpoint(root, "b", engine="torch") as save:
            (save.path / "model.pt").write_bytes(b"half")
            raise _enospc(save.path / "model.pt")
    assert sorted(os.listdir(root)) == ["a", "latest"] and read_latest(root) == "a"


def test_torch_short_write_error_is_recognised_as_a_full_disk(tmp_path):
    """torch's zip writer reports ENOSPC as '[enforce fail at inline_container.cc:672] . unexpected
    pos': produced here for real by writing to /dev/full."""
    import torch

    from shardkit.storage.atomic import is_disk_full

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    with pytest.raises(RuntimeError) as info:
        torch.save({"w": torch.zeros(1000)}, "/dev/full")
    assert is_disk_full(info.value), str(info.value)
    assert not is_disk_full(RuntimeError("cannot pickle 'generator' object"))
    assert is_disk_full(_enospc("x")) and not is_disk_full(OSError(13, "Permission denied"))


def test_disk_full_while_writing_the_manifest_removes_the_staging(tmp_path, monkeypatch):
    import shardkit.storage.manifest as manifest
    from shardkit.checkpoint.ops.torch_training import save_training
    from shardkit.core.errors import CheckpointError

    root = tmp_path / "root"
    model, _ = _linear_and_adam(0)
    save_training(root, model=model, step=1)

    def full(path, text):
        raise _enospc(path)

    monkeypatch.setattr(manifest, "atomic_write_text", full)
    with pytest.raises(CheckpointError, match=r"^disk full at .*\.shardkit-tmp-step2/shardkit_manifest\.json, [\d,]+ "
                       r"bytes free, nothing written: the staging folder was removed"):
        save_training(root, model=model, step=2)
    assert sorted(os.listdir(root)) == ["latest", "step1"] and read_latest(root) == "step1"


def test_latest_larger_than_a_tag_is_refused_without_reading_it(tmp_path):
    from shardkit.core.errors import CheckpointError

    with open(tmp_path / "latest", "wb") as fh:
        fh.truncate(1 << 30)  # sparse 1 GiB
    with pytest.raises(CheckpointError, match=r"latest: more than 4096 bytes, not a tag name"):
        read_latest(tmp_path)


def test_a_fifo_swapped_in_after_the_check_never_blocks_read_latest(tmp_path, monkeypatch):
    from shardkit.core.errors import CheckpointError
    from tests._corrupt import call_without_blocking, fifo_swapped_in_after_a_check

    write_latest(tmp_path, "step3")
    fifo_swapped_in_after_a_check(monkeypatch, tmp_path / "latest")
    assert call_without_blocking(lambda: read_latest(tmp_path), tmp_path / "latest") == "step3"
    # and a FIFO already there is refused, naming it, instead of being read (or taken for no pointer)
    (tmp_path / "latest").unlink()
    os.mkfifo(tmp_path / "latest")
    with pytest.raises(CheckpointError, match=r"latest: is a FIFO \(named pipe\), not a regular file.*'latest' must be "
                       r"a small text file holding one tag"):
        call_without_blocking(lambda: read_latest(tmp_path), tmp_path / "latest")


def test_read_regular_file_refuses_what_is_not_a_regular_file_and_caps_the_bytes(tmp_path):
    from shardkit.core.errors import ConfigError
    from shardkit.core.files import FileReadError, read_regular_file

    (tmp_path / "f").write_bytes(b"12345")
    assert read_regular_file(tmp_path / "f", 5) == b"12345"
    os.mkfifo(tmp_path / "pipe")
    cases = [(tmp_path / "f", 4, "too_large", "f: more than 4 bytes"),
             (tmp_path / "pipe", 5, "not_regular", r"pipe: is a FIFO \(named pipe\), not a regular file"),
             (tmp_path, 5, "folder", "is a folder, not a regular file"),
             (tmp_path / "none", 5, "missing", "none: no such file"),
             ("/dev/zero", 5, "not_regular", "/dev/zero: is a character device, not a regular file")]
    for path, limit, reason, message in cases:
        with pytest.raises(FileReadError, match=message) as info:
            read_regular_file(path, limit)
        assert info.value.reason == reason and isinstance(info.value, ConfigError)


@pytest.mark.parametrize("content", ["/etc", "../x", "", ".", "a/b", ".shardkit-tmp-step1"])
def test_latest_naming_no_folder_inside_the_root_is_refused_with_the_pointer_file(tmp_path, content):
    from shardkit.checkpoint.zero3.files import resolve_tag_dir
    from shardkit.core.errors import CheckpointError
    from shardkit.storage.tags import latest_tag

    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "x").mkdir()  # '../x' exists: only the check stops it
    (root / "latest").write_text(content)
    msg = rf"{re.escape(str(root / 'latest'))}: holds {re.escape(repr(content))}, which is not a checkpoint tag .*Write the tag of a complete checkpoint into it"
    with pytest.raises(CheckpointError, match=msg):
        latest_tag(root)
    with pytest.raises(CheckpointError, match=msg):
        resolve_tag_dir(root)


def test_a_signal_during_a_deferred_clean_up_waits_for_it_then_runs_its_handler():
    """torchrun SIGTERMs a process that is already removing its staging folder: the clean-up must finish
    (nothing left behind) and the signal still take effect right after it."""
    import signal

    from shardkit.storage.atomic import signals_deferred

    steps: list[str] = []

    def handler(signum, frame):
        steps.append(f"handler {signal.Signals(signum).name}")
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                steps.append("clean-up finished")
        assert steps == ["clean-up finished", "handler SIGTERM"]
        assert signal.getsignal(signal.SIGTERM) is handler  # put back
    finally:
        signal.signal(signal.SIGTERM, previous)
