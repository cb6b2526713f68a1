"""`reshard` and `consolidate` never lose data or launder a corrupted checkpoint (an
output replaced, a corrupted source, user files in -o, a full disk), on a real 2-rank DeepSpeed ZeRO-3 checkpoint.

One checkpoint is trained and saved per module (DeepSpeed on gloo, ~30 s); each test works on its
own copy. ``sealed`` is that copy with a shardkit manifest (what ``save_deepspeed_checkpoint``
writes), ``plain`` the copy as DeepSpeed's own ``save_checkpoint`` left it (no manifest).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
from pathlib import Path

import pytest

from tests import _ranks_zero3 as R
from tests._corrupt import flip_a_byte

pytestmark = pytest.mark.slow

TAG = f"global_step{R.SAVE_STEPS}"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    from shardkit.run.spawn.process import run_ranks

    root = tmp_path_factory.mktemp("convert_safety") / "fp32"
    run_ranks(R.train_and_save, 2, args=(str(root), "fp32", False, R.SAVE_STEPS), timeout=300, device="cpu")
    return root


@pytest.fixture
def plain(built, tmp_path) -> Path:
    root = tmp_path / "plain"
    shutil.copytree(built, root)
    return root


@pytest.fixture
def sealed(plain) -> Path:
    from shardkit.storage.manifest import seal

    seal(plain / TAG, engine="deepspeed", world_size=2, zero_stage=3, step=R.SAVE_STEPS)
    return plain


def _beside_tag(root: Path) -> list[str]:
    """The files DeepSpeed saved beside the tag (zero_to_fp32.py ...): a reshard of the root copies them into OUT."""
    return sorted(n for n in os.listdir(root) if n != "latest" and (root / n).is_file())


def _digest(root: Path) -> dict[str, str]:
    """Every file under root (and its kind) with its content hash: the checkpoint as the user had it."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath, name)
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# --- consolidate -o replaces whatever is there --------------------------------------------------


def test_consolidate_refuses_an_existing_output_unless_forced(sealed, tmp_path, run_cli):
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"the user's previous export")
    code, _, err = run_cli("consolidate", sealed, "-o", out)
    assert code == 2 and f"-o {out}: {out} already exists; pass --force to replace it" in err
    assert out.read_bytes() == b"the user's previous export"
    code, stdout, err = run_cli("consolidate", sealed, "-o", out, "--force")
    assert code == 0, err
    assert out.read_bytes()[8:9] == b"{" and "source checked before reading: sizes and content digests" in stdout


def test_consolidate_never_replaces_a_fifo_or_a_link_to_a_device(sealed, tmp_path, run_cli):
    """As root, `-o /dev/null` used to turn the device into a regular file."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    link = tmp_path / "null"
    link.symlink_to("/dev/null")
    folder = tmp_path / "dir" / "model.safetensors"
    folder.mkdir(parents=True)  # `-o dir` means dir/model.safetensors, which is itself a folder here
    for target, kind in ((fifo, "a FIFO (named pipe)"), (link, "a character device"), (folder.parent, "a folder")):
        code, _, err = run_cli("consolidate", sealed, "-o", target, "--force")
        assert code == 2 and f"exists and is {kind}, not a regular file; consolidate only ever replaces regular " \
                              "files" in err, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert link.is_symlink() and os.readlink(link) == "/dev/null" and stat.S_ISCHR(os.stat(link).st_mode)
    assert folder.is_dir() and not list(folder.iterdir())
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]


def test_consolidate_never_writes_into_the_source_checkpoint(sealed, run_cli):
    before = _digest(sealed)
    targets = [
        (sealed / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt", "is inside the checkpoint being read"),
        (sealed / TAG, "is inside the checkpoint being read"),  # a folder: <tag>/model.safetensors
        (sealed / TAG / "new" / "m.safetensors", "is inside the checkpoint being read"),
        (sealed / "latest", "is a checkpoint's 'latest' pointer"),
        # the root (the folder holding 'latest') is a checkpoint folder too
        (sealed / "model.safetensors", f"is inside the checkpoint being read ({sealed})"),
        (sealed / "exports" / "m.safetensors", f"is inside the checkpoint being read ({sealed})"),
    ]
    for target, why in targets:
        code, _, err = run_cli("consolidate", sealed, "-o", target, "--force")
        assert code == 2 and why in err, (target, err)
    assert _digest(sealed) == before and not (sealed / TAG / "new").exists() and not (sealed / "exports").exists()


def test_consolidate_keeps_a_symlink_to_a_regular_file_and_replaces_its_target(sealed, tmp_path, run_cli):
    target = tmp_path / "exports" / "v1.safetensors"
    target.parent.mkdir()
    target.write_bytes(b"old")
    link = tmp_path / "model.safetensors"
    link.symlink_to(target)
    code, stdout, err = run_cli("consolidate", sealed, "-o", link, "--force")
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(target) and target.stat().st_size > 1000
    assert f"wrote {target}" in stdout


# --- a corrupted source is refused, not converted -----------------------------------------------


def test_a_corrupted_source_is_refused_by_reshard_and_consolidate(sealed, tmp_path, run_cli):
    bad = sealed / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    flip_a_byte(bad)
    refused = rf"refusing to read {re.escape(str(sealed / TAG))}: it fails verification: \[{bad.name}\] .*blake3 mismatch"
    code, _, err = run_cli("reshard", sealed, "--world-size", "3", "-o", tmp_path / "ws3")
    # reshard hashes the source beside its writes and refuses to publish
    assert code == 1 and re.search(rf"refusing to publish the reshard of {re.escape(str(sealed / TAG))}: "
                                   rf"{re.escape(str(bad))} fails verification: its blake3 is", err), err
    assert not (tmp_path / "ws3").exists()  # no fresh manifest vouching for the corruption
    code, _, err = run_cli("consolidate", sealed, "-o", tmp_path / "m.safetensors")
    assert code == 1 and re.search(refused, err), err
    assert not (tmp_path / "m.safetensors").exists()
    # --no-verify skips the hashing, and says so
    code, _, err = run_cli("consolidate", sealed, "-o", tmp_path / "m.safetensors", "--no-verify")
    assert code == 0 and "warning: --no-verify: the content digests of the 4 file(s)" in err, err


def test_a_truncated_source_is_refused_even_with_no_verify(sealed, tmp_path, run_cli):
    bad = sealed / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    bad.write_bytes(bad.read_bytes()[:-10])
    for argv in (("reshard", "--world-size", "3", "-o", tmp_path / "ws3"), ("consolidate", "-o", tmp_path / "m")):
        code, _, err = run_cli(argv[0], sealed, *argv[1:], "--no-verify")
        assert code == 1 and "fails verification" in err and "manifest records" in err and "(truncated)" in err
    assert not (tmp_path / "ws3").exists() and not (tmp_path / "m").exists()


def test_a_source_without_manifest_is_read_with_a_warning_and_recorded_as_unverified(plain, tmp_path, run_cli):
    from shardkit.storage.manifest import read_manifest

    code, stdout, err = run_cli("reshard", plain, "--world-size", "3", "-o", tmp_path / "ws3")
    assert code == 0, err
    assert re.search(rf"warning: {re.escape(str(plain / TAG))} has no shardkit_manifest\.json .* its files cannot be "
                     "verified", err), err
    assert "source checked: not verified (no shardkit manifest)" in stdout
    assert read_manifest(tmp_path / "ws3" / TAG).extra["resharded_from"]["verified"] == "none"
    code, _, err = run_cli("consolidate", plain, "-o", tmp_path / "m.safetensors")
    assert code == 0 and "cannot be verified" in err


def test_library_callers_get_a_python_warning(plain, tmp_path):
    from shardkit.checkpoint.ops.consolidate import consolidate_checkpoint
    from shardkit.storage.pipeline import UnverifiedCheckpointWarning

    with pytest.warns(UnverifiedCheckpointWarning, match="cannot be verified"):
        result = consolidate_checkpoint(plain, tmp_path / "m.safetensors")
    assert result.verified == "none"


# --- verified and read are the same tag folder --------------------------------------------------


def _save_lands_after_verification(monkeypatch, root: Path) -> list[Path]:
    """A concurrent save that lands right after the source was verified: a new tag (a copy with one
    byte flipped, no manifest: never verified) and 'latest' moved to it. Returns the verified folders."""
    import shardkit.storage.pipeline as pipeline

    real, checked = pipeline.verify_before_reading, []

    def verify_then_a_save_lands(tag_dir, **kwargs):
        result = real(tag_dir, **kwargs)
        checked.append(Path(tag_dir))
        shutil.copytree(root / TAG, root / "unverified", ignore=shutil.ignore_patterns("shardkit_manifest.json"))
        flip_a_byte(root / "unverified" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        (root / "latest").write_text("unverified")
        return result

    # the converters call it through pipeline.check_source, which looks it up here
    monkeypatch.setattr(pipeline, "verify_before_reading", verify_then_a_save_lands)
    return checked


def test_reshard_reads_the_tag_folder_it_verified_not_a_newer_latest(sealed, tmp_path, monkeypatch):
    from shardkit.checkpoint.ops.reshard import reshard_checkpoint
    from shardkit.storage.manifest import read_manifest

    checked = _save_lands_after_verification(monkeypatch, sealed)
    result = reshard_checkpoint(sealed, tmp_path / "ws3", 3)
    assert checked == [sealed / TAG] and (sealed / "latest").read_text() == "unverified"
    source = read_manifest(tmp_path / "ws3" / TAG).extra["resharded_from"]
    assert source["path"] == str(sealed / TAG) and source["verified"] == "hash" and result.tag == TAG


def test_consolidate_reads_the_tag_folder_it_verified_not_a_newer_latest(sealed, tmp_path, monkeypatch):
    from shardkit.checkpoint.ops.consolidate import consolidate_checkpoint

    checked = _save_lands_after_verification(monkeypatch, sealed)
    result = consolidate_checkpoint(sealed, tmp_path / "m.safetensors")
    assert checked == [sealed / TAG] and result.tag == TAG and result.verified == "hash"


# --- a bad tag from the source is blamed on where it came from ----------------------------------


def test_reshard_names_where_an_unusable_source_tag_came_from(sealed, tmp_path, run_cli):
    """'latest' names a set-aside copy (what it does while a tag is being saved again): that name
    cannot be reused, and the user, who never passed --tag, is told where it came from."""
    from shardkit.storage.tags import REPLACED_MARK

    copy = f"{TAG}{REPLACED_MARK}0123abcd"
    (sealed / TAG).rename(sealed / copy)
    (sealed / "latest").write_text(copy)
    code, _, err = run_cli("reshard", sealed, "--world-size", "3", "-o", tmp_path / "ws3")
    assert code == 2 and f"source tag {copy!r} (read from {sealed / 'latest'}) cannot name the new checkpoint " \
                          "(names containing" in err and "no --tag was given" in err and "Pass --tag NAME" in err, err
    assert "--tag '" not in err
    code, _, err = run_cli("reshard", sealed / copy, "--world-size", "3", "-o", tmp_path / "ws3")
    assert code == 2 and f"source tag {copy!r} (the name of the source folder {sealed / copy})" in err, err
    code, _, err = run_cli("reshard", sealed, "--world-size", "3", "-o", tmp_path / "ws3", "--tag", "fresh")
    assert code == 0 and (tmp_path / "ws3" / "fresh").is_dir(), err


# --- reshard -o into a folder of user files; tags that collide with internal names --------------


def test_reshard_refuses_a_non_empty_folder_that_is_not_a_checkpoint(sealed, tmp_path, run_cli):
    out = tmp_path / "work"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "latest").write_text("my own file called latest")
    (out / ".shardkit-tmp-x").mkdir()  # named like a leftover: the save sequence would delete it
    before = _digest(out)
    code, _, err = run_cli("reshard", sealed, "--world-size", "3", "-o", out)
    assert code == 2 and re.search(r"folder is not empty and is not a shardkit checkpoint folder \(it holds "
                                   r"\['\.shardkit-tmp-x', 'latest', 'notes\.txt'\]\)", err), err
    assert _digest(out) == before and (out / ".shardkit-tmp-x").is_dir()


def test_reshard_into_a_shardkit_checkpoint_folder_adds_a_tag_and_replaces_one_only_when_forced(sealed, tmp_path, run_cli):
    out = tmp_path / "ws3"
    assert run_cli("reshard", sealed, "--world-size", "3", "-o", out)[0] == 0
    code, _, err = run_cli("reshard", sealed, "--world-size", "3", "-o", out)
    assert code == 2 and f"already holds checkpoint '{TAG}'" in err and "pass --force to replace it" in err
    code, _, err = run_cli("reshard", sealed, "--world-size", "3", "-o", out, "--tag", "again")
    assert code == 0, err
    assert sorted(os.listdir(out)) == sorted(["again", TAG, "latest", *_beside_tag(sealed)])
    assert (out / "latest").read_text() == "again"
    code, _, err = run_cli("reshard", sealed, "--world-size", "3", "-o", out, "--force")
    assert code == 0, err
    assert (out / "latest").read_text() == TAG and run_cli("verify", out)[0] == 0
    # a folder of that name that is not a checkpoint is never replaced, --force or not
    (out / "mine").mkdir()
    (out / "mine" / "data.bin").write_bytes(b"x")
    code, _, err = run_cli("reshard", sealed, "--world-size", "3", "-o", out, "--tag", "mine", "--force")
    assert code == 2 and "exists and is not a shardkit checkpoint" in err and (out / "mine" / "data.bin").exists()


@pytest.mark.parametrize("tag, why", [
    (".shardkit-tmp-x", "staging folders, deleted by the next save"),
    ("latest", "the pointer file"),
    ("a/b", "path separators"),
    ("..", "'.' and '..' are not folder names"),
    ("", "non-empty"),
])
def test_reshard_refuses_tags_that_collide_with_internal_names(sealed, tmp_path, run_cli, tag, why):
    out = tmp_path / "out"
    code, _, err = run_cli("reshard", sealed, "--world-size", "3", "-o", out, "--tag", tag)
    assert code == 2 and f"--tag {tag!r}: not a usable checkpoint tag (" in err and why in err, err
    assert not out.exists() and not (tmp_path / "a").exists()


def test_reshard_refuses_an_output_inside_the_source(sealed, run_cli):
    before = _digest(sealed)
    code, _, err = run_cli("reshard", sealed, "--world-size", "3", "-o", sealed / TAG / "sub")
    assert code == 2 and "is inside the checkpoint being read" in err
    assert _digest(sealed) == before


# --- disk full during reshard -------------------------------------------------------------------


def test_disk_full_during_reshard_names_the_file_and_leaves_nothing_half_written(sealed, tmp_path, run_cli, monkeypatch):
    """Rank 1's optim file goes to /dev/full: the writer hits a real ENOSPC (shardkit's streaming
    writer: OSError; torch's own writer: its '[enforce fail at inline_container.cc:672] . unexpected
    pos' RuntimeError)."""
    import shardkit.checkpoint.ops.reshard as reshard

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    out = tmp_path / "ws3"
    assert run_cli("reshard", sealed, "--world-size", "3", "-o", out, "--tag", "before")[0] == 0
    before = _digest(out)
    real_save, calls = reshard.write_torch_zip, []

    def second_file_hits_a_full_disk(path, data, records, **kw):
        calls.append(path)
        full = Path(path).name == "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        return real_save("/dev/full" if full else path, data, records, **kw)

    monkeypatch.setattr(reshard, "write_torch_zip", second_file_hits_a_full_disk)
    code, _, err = run_cli("reshard", sealed, "--world-size", "3", "-o", out)
    assert code == 1 and "Traceback" not in err
    assert re.search(rf"error: disk full at {re.escape(str(out))}/\.shardkit-tmp-{TAG}/zero_pp_rank_1_mp_rank_00_"
                     rf"optim_states\.pt, [\d,]+ bytes free, nothing written: the staging folder was removed, "
                     rf"{re.escape(str(out / 'latest'))} is unchanged \((RuntimeError: \[enforce fail at "
                     r"inline_container\.cc:\d+\] \. unexpected pos|OSError: No space left on device)", err), err
    assert _digest(out) == before and sorted(os.listdir(out)) == sorted(["before", "latest", *_beside_tag(sealed)])


def test_disk_full_during_consolidate_keeps_the_previous_output(sealed, tmp_path, run_cli, monkeypatch):
    """ENOSPC from the copy loop (what os.copy_file_range / os.pwrite raise on a full disk)."""
    import errno

    import shardkit.checkpoint.ops.export.writer as writer

    out = tmp_path / "model.safetensors"
    out.write_bytes(b"previous export")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer, "copy_bytes", full)  # consolidate's copy is export's streaming writer
    code, _, err = run_cli("consolidate", sealed, "-o", out, "--force")
    assert code == 1 and "Traceback" not in err
    assert re.search(rf"error: disk full at {re.escape(str(out))}, [\d,]+ bytes free, nothing written: the partial "
                     rf"file was removed, {re.escape(str(out))} is unchanged \(OSError: No space left", err), err
    assert out.read_bytes() == b"previous export" and sorted(os.listdir(tmp_path)) == ["model.safetensors", "plain"]
