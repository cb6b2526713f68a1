"""Hostile and careless checkpoints and outputs given to `reshard` and `consolidate`: special files
where a rank file should be, empty and sparse files, a `latest` with garbage or a path, absurd world
sizes, odd output names, an output on a read-only or full filesystem, an output folder removed
mid-write. Each ends in a message naming the file and value, a non-zero exit and nothing written
(or, where the input is legitimate, in a checkpoint that verifies)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import _ranks_zero3 as R
from tests._slow_writes import slow_fsync_cli

pytestmark = pytest.mark.slow

TAG = "global_step2"
RANK1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
TIMEOUT_S = 120


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    return R.build_sources(tmp_path_factory.getbasetemp() / "zero3")


@pytest.fixture
def src(sources, tmp_path) -> Path:
    out = tmp_path / "src"
    shutil.copytree(sources["fp32"], out)
    return out


def _run(*args: object, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardkit", *map(str, args)], capture_output=True, text=True,
                          errors="surrogateescape", timeout=timeout)


def _command(name: str, src: Path, out: Path) -> list[object]:
    return ["reshard", src, "--world-size", "3", "-o", out] if name == "reshard" else ["consolidate", src, "-o", out]


def _break_rank_file(src: Path, how: str) -> Path:
    f = src / TAG / RANK1
    size = f.stat().st_size
    f.unlink()
    if how == "fifo":
        os.mkfifo(f)
    elif how == "device":
        f.symlink_to("/dev/zero")
    elif how == "chardev":
        if os.geteuid() != 0:
            pytest.skip("mknod of a character device needs root")
        os.mknod(f, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # what /dev/zero is, inside the tag
    elif how == "empty":
        f.write_bytes(b"")
    elif how == "sparse":
        with open(f, "wb") as fh:
            fh.truncate(size)  # the right size, no data: a copy that lost its blocks
    elif how == "folder":
        f.mkdir()
    return f


SOURCE_CASES = {
    "fifo": r"is a FIFO \(named pipe\), not a regular file, so it is not read",
    # a link leaving the tag is refused before the file is even looked at (pipeline.verify_before_reading)
    "device": r"a symlink to '/dev/zero', which leads outside the checkpoint folder .*shardkit never reads or writes through it",
    "chardev": r"is a character device, not a regular file, so it is not read",
    "empty": r"checkpoint file is empty \(0 bytes\): the save that wrote it did not finish",
    "sparse": r"cannot be read as a torch checkpoint \(BadZipFile: .*\)\. The file is truncated or corrupted",
    "folder": r"is a directory, expected a checkpoint file",
}


@pytest.mark.parametrize("command", ["reshard", "consolidate"])
@pytest.mark.parametrize("how", sorted(SOURCE_CASES))
def test_a_rank_file_that_is_not_a_checkpoint_file_is_named_and_nothing_is_written(src, tmp_path, command, how):
    bad = _break_rank_file(src, how)
    out = tmp_path / ("out" if command == "reshard" else "model.safetensors")
    done = _run(*_command(command, src, out), timeout=30)  # a FIFO read would block: the timeout says so
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert str(bad) in done.stderr and re.search(SOURCE_CASES[how], done.stderr), done.stderr
    assert not out.exists() or list(out.iterdir()) == []


@pytest.mark.parametrize("content", ["global_step2\n\x00junk", "../elsewhere/global_step2", "/etc", ""])
def test_a_latest_with_garbage_or_a_path_is_refused_naming_the_pointer(src, tmp_path, content):
    (src / "latest").write_text(content)
    for command in ("reshard", "consolidate"):
        out = tmp_path / f"out_{command}"
        done = _run(*_command(command, src, out))
        assert done.returncode != 0 and f"{src / 'latest'}" in done.stderr, done.stderr
        assert not out.exists()


def test_an_absurd_world_size_is_refused_before_any_file_is_written(src, tmp_path, monkeypatch):
    done = _run("reshard", src, "--world-size", "1000000", "-o", tmp_path / "out")
    assert done.returncode == 2, done.stderr
    assert re.search(r"world_size 1,000,000: more ranks than shardkit writes \(131,072, two files each\); pass the "
                     r"data-parallel world size of the resuming run", done.stderr), done.stderr
    assert not (tmp_path / "out").exists()
    # below that cap, more ranks than elements would write files of padding only
    import shardkit.checkpoint.zero3.repartition as repartition
    from shardkit.checkpoint.readers.zero3_open import open_zero3_layout
    from shardkit.core.errors import UsageError

    monkeypatch.setattr(repartition, "MAX_WORLD_SIZE", 10**9)
    ckpt = open_zero3_layout(src)
    with pytest.raises(UsageError, match=rf"world_size {ckpt.num_params + 1:,}: more ranks than the checkpoint's "
                       rf"{ckpt.num_params:,} trainable elements \(every extra rank would hold only padding\)"):
        repartition.plan_layout(ckpt, ckpt.num_params + 1)


@pytest.mark.parametrize("name", ["with spaces", "new\nline", "bytes-\udcff-not-utf8", "-starts-with-dash"])
def test_odd_output_names_get_a_checkpoint_that_verifies(src, tmp_path, name):
    out = tmp_path / name
    done = _run("reshard", src, "--world-size", "3", f"--output={out}")
    assert done.returncode == 0, done.stderr
    assert _run("verify", f"{out}").returncode == 0


def test_a_source_folder_that_is_a_symlink_and_a_hard_linked_rank_file_are_read(src, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(src, target_is_directory=True)
    twin = src / TAG / "twin.pt"
    os.link(src / TAG / RANK1, twin)  # another name for the same inode: harmless
    done = _run("reshard", link, "--world-size", "3", "-o", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert _run("verify", tmp_path / "out").returncode == 0


def test_an_output_under_a_regular_file_is_named(src, tmp_path):
    (tmp_path / "file").write_text("x")
    done = _run("reshard", src, "--world-size", "3", "-o", tmp_path / "file" / "out")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert str(tmp_path / "file") in done.stderr, done.stderr


def _in_own_mount_namespace(tmp_path: Path, mount_opts: str, argv: list[object]) -> subprocess.CompletedProcess[str]:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a filesystem of the test's own")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cmd = " ".join(f"'{a}'" for a in [sys.executable, "-m", "shardkit", *map(str, argv)])
    script = f"mount -t tmpfs -o {mount_opts} tmpfs '{mnt}' && {cmd}"
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def test_an_output_on_a_read_only_filesystem_is_named(src, tmp_path):
    done = _in_own_mount_namespace(tmp_path, "ro,size=64m", ["reshard", src, "--world-size", "3", "-o",
                                                             tmp_path / "mnt" / "out"])
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert re.search(r"mnt/out.*Read-only file system", done.stderr), done.stderr


@pytest.mark.parametrize("command", ["reshard", "consolidate"])
def test_an_output_filesystem_that_fills_up_is_named_and_left_empty(src, tmp_path, command):
    out = tmp_path / "mnt" / ("out" if command == "reshard" else "model.safetensors")
    size = "400k" if command == "reshard" else "100k"  # smaller than the output (1.7 MiB / 0.3 MiB)
    done = _in_own_mount_namespace(tmp_path, f"size={size}", _command(command, src, out))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert re.search(r"disk full at .*mnt.*bytes free, nothing written", done.stderr), done.stderr


def test_an_output_folder_removed_mid_write_fails_and_publishes_nothing(sources, tmp_path):
    """Someone cleans up the output folder while the reshard writes into it."""
    from benchmarks._scale_zero3 import scale_checkpoint

    big = scale_checkpoint(sources["fp32"], tmp_path / "big", 150).parent
    out = tmp_path / "out"
    # fsyncs slowed (tests/_slow_writes.py): the whole 250 MB write can end between two polls of a test
    # process the load keeps off the CPU, and the folder removed would be the published checkpoint (exit 0)
    run = subprocess.Popen(slow_fsync_cli("reshard", big, "--world-size", "3", "-o", out),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list(out.glob(".shardkit-tmp-*/*optim_states.pt")) and time.monotonic() < deadline:
            time.sleep(0.005)
        shutil.rmtree(out, ignore_errors=True)
        _, err = run.communicate(timeout=TIMEOUT_S)
    finally:
        run.kill()
        run.wait()
    assert run.returncode == 1 and "Traceback" not in err, err
    assert "No such file or directory" in err and ".shardkit-tmp-global_step2" in err, err
    assert not out.exists() or not (out / "latest").exists()


def test_a_staging_folder_left_by_a_save_killed_on_every_rank_is_noted_never_loaded(src, tmp_path):
    """SIGKILL on every rank leaves the staging folder (nobody survives to remove it): verify names
    it as a leftover, loaders refuse it, and a reshard of that root reads the complete tag."""
    from shardkit.core.errors import CheckpointError
    from shardkit.storage.manifest import seal
    from shardkit.storage.verify import check_resumable, verify_checkpoint

    seal(src / TAG, engine="deepspeed", world_size=2, zero_stage=3)
    staged = src / ".shardkit-tmp-global_step4"
    staged.mkdir()
    (staged / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"half")
    rep = verify_checkpoint(src, world_size=2, engine="deepspeed")
    assert rep.ok and [f.rule for f in rep.findings] == ["ckpt.staging.leftover"], rep.to_json()
    with pytest.raises(CheckpointError, match="staging directory of a save that never completed"):
        check_resumable(staged)
    done = _run("reshard", src, "--world-size", "2", "-o", tmp_path / "out", "--sub-group-size", "1000")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("command", ["reshard", "consolidate"])
def test_a_rank_file_linking_outside_a_checkpoint_without_manifest_is_never_read(src, tmp_path, command):
    elsewhere = tmp_path / "elsewhere.pt"
    f = src / TAG / RANK1
    shutil.copy(f, elsewhere)
    f.unlink()
    f.symlink_to(elsewhere)
    out = tmp_path / ("out" if command == "reshard" else "model.safetensors")
    done = _run(*_command(command, src, out))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert RANK1 in done.stderr and str(elsewhere) in done.stderr, done.stderr
    assert not out.exists() or list(out.iterdir()) == []


def test_name_prefix_is_refused_where_it_means_nothing(src, tmp_path):
    done = _run("convert", src, "--to", "fsdp2", "-o", tmp_path / "out", "--name-prefix", "module")
    assert done.returncode == 2 and "--name-prefix module with --to fsdp2" in done.stderr, done.stderr


@pytest.mark.parametrize("command", ["reshard", "consolidate", "convert"])
def test_workers_is_a_count_of_writers(src, tmp_path, command):
    out = tmp_path / ("model.safetensors" if command == "consolidate" else "out")
    argv = (_command(command, src, out) if command != "convert"
            else ["convert", src, "--to", "fsdp2", "-o", out])
    refused = _run(*argv, "--workers", "0")
    assert refused.returncode == 2 and "--workers 0: must be at least 1" in refused.stderr, refused.stderr
    done = _run(*argv, "--workers", "1")
    assert done.returncode == 0, done.stderr
    if command != "consolidate":
        assert _run("verify", out).returncode == 0
