"""verify_checkpoint / check_resumable / `shardkit verify` on small checkpoints built in-process.

The same checks on a real 2-rank DeepSpeed ZeRO-3 checkpoint (and a real SIGKILL mid-save) are in
test_atomic_deepspeed.py.
"""

import json
import re

import pytest

from shardkit.core.errors import CheckpointError
from shardkit.storage.atomic import staging_dir, write_latest
from shardkit.storage.manifest import MANIFEST_NAME, seal
from shardkit.storage.verify import check_resumable, verify_checkpoint


def _ckpt(root, tag="step5", world_size=2, engine="deepspeed"):
    d = root / tag
    d.mkdir(parents=True)
    for r in range(world_size):
        (d / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt").write_bytes(b"m" * 100)
        (d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(bytes(range(200)))
    seal(d, engine=engine, world_size=world_size, zero_stage=3, step=int(tag.removeprefix("step")))
    write_latest(root, tag)
    return d


def test_root_and_step_folder_both_resolve(tmp_path):
    tag = _ckpt(tmp_path)
    rep = verify_checkpoint(tmp_path)
    assert rep.ok and rep.tag_dir == str(tag) and rep.manifest.world_size == 2
    rep = verify_checkpoint(tag)
    assert rep.ok and rep.root == str(tmp_path)


def test_step_folder_that_is_not_latest_is_noted(tmp_path):
    old = _ckpt(tmp_path, "step5")
    _ckpt(tmp_path, "step9")
    rep = verify_checkpoint(old)
    assert rep.ok
    assert any(f.rule == "ckpt.path.not_latest" and "'step9'" in f.message for f in rep.findings)


def test_flipped_byte_is_a_checksum_error_naming_the_file(tmp_path):
    tag = _ckpt(tmp_path)
    f = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(f.read_bytes())
    data[57] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt.*blake3 mismatch"):
        check_resumable(tmp_path)
    assert verify_checkpoint(tmp_path, checksums=False).ok  # size-only mode cannot see a flipped byte


def test_truncated_file_is_named_with_both_sizes(tmp_path):
    tag = _ckpt(tmp_path)
    f = tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    f.write_bytes(f.read_bytes()[:40])
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_0_mp_rank_00_model_states\.pt: 40 bytes on disk, "
                       r"manifest records 100 \(truncated\)"):
        check_resumable(tmp_path)


def test_missing_rank_file_and_wrong_world_size_and_engine(tmp_path):
    tag = _ckpt(tmp_path)
    (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_model_states\.pt: file listed in the "
                       "manifest is missing"):
        check_resumable(tmp_path)
    tag2 = _ckpt(tmp_path / "b")
    with pytest.raises(CheckpointError, match=r"\[world_size\] checkpoint was saved by 2 ranks, this run has 3.*"
                       "shardkit reshard"):
        check_resumable(tag2, world_size=3)
    assert check_resumable(tag2, world_size=3, allow_reshard=True).ok
    with pytest.raises(CheckpointError, match=r"\[engine\] checkpoint was written by engine 'deepspeed', this run "
                       "uses 'fsdp2'"):
        check_resumable(tag2, engine="fsdp2")


def test_manifest_that_lacks_a_rank_is_refused(tmp_path):
    d = tmp_path / "step1"
    d.mkdir()
    (d / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"x")
    (d / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    seal(d, engine="deepspeed", world_size=2, zero_stage=3)
    with pytest.raises(CheckpointError, match=r"\[rank 1\] .*no file for rank 1"):
        check_resumable(d)


def test_fsdp2_world_size_change_is_fine(tmp_path):
    d = tmp_path / "step1"
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(b"x")
    seal(d, engine="fsdp2", world_size=2)
    rep = check_resumable(d, world_size=3)
    assert any(f.rule == "ckpt.world_size.reshard" for f in rep.findings)


def test_misuse_of_paths_is_explained(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        check_resumable(tmp_path / "nope")
    (tmp_path / "f.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint directory"):
        check_resumable(tmp_path / "f.pt")
    root = tmp_path / "root"
    staging_dir(root, "step8").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"no completed checkpoint under .*root \(only interrupted saves: "
                       r"\['\.shardkit-tmp-step8'\]\)"):
        check_resumable(root)
    with pytest.raises(CheckpointError, match="staging directory of a save that never completed"):
        check_resumable(staging_dir(root, "step8"))
    # a DeepSpeed step folder written without shardkit: no manifest, no completion marker
    plain = tmp_path / "plain" / "global_step3"
    plain.mkdir(parents=True)
    (plain / "mp_rank_00_model_states.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="looks like a checkpoint step folder but has no " + MANIFEST_NAME):
        check_resumable(plain)
    write_latest(plain.parent, "global_step3")
    with pytest.raises(CheckpointError, match="global_step3 has no " + MANIFEST_NAME):
        check_resumable(plain.parent)
    write_latest(plain.parent, "global_step4")
    with pytest.raises(CheckpointError, match=r"latest names tag 'global_step4' but .*global_step4 does not exist"):
        check_resumable(plain.parent)


def test_root_without_latest_uses_newest_complete_with_a_warning(tmp_path):
    _ckpt(tmp_path, "step5")
    _ckpt(tmp_path, "step12")
    (tmp_path / "latest").unlink()
    rep = verify_checkpoint(tmp_path)
    assert rep.ok and rep.tag_dir.endswith("step12")
    assert [f.rule for f in rep.warnings] == ["ckpt.latest.missing"]


def test_extra_file_is_a_warning(tmp_path):
    tag = _ckpt(tmp_path)
    (tag / "notes.txt").write_text("added later")
    rep = verify_checkpoint(tmp_path)
    assert rep.ok and [f.key for f in rep.warnings] == ["notes.txt"]


def test_cli_exit_codes_and_json(tmp_path, run_cli):
    tag = _ckpt(tmp_path)
    code, out, _ = run_cli("verify", tmp_path, "--world-size", "2")
    assert code == 0 and "resumable" in out and "world size 2" in out
    code, out, _ = run_cli("verify", tmp_path, "--json", "--world-size", "4")
    data = json.loads(out)
    assert code == 1 and data["ok"] is False and data["findings"][0]["key"] == "world_size"
    assert data["tag"] == "step5" and data["engine"] == "deepspeed"
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    code, out, _ = run_cli("verify", tmp_path)
    assert code == 1 and "truncated" in out
    code, _, err = run_cli("verify", tmp_path, "--world-size", "0")
    assert code == 2 and "--world-size must be at least 1" in err
    code, _, err = run_cli("verify")
    assert code == 2


def test_verify_cli_flags_are_frozen():
    """The public flags of `shardkit verify`: renaming one breaks users' scripts."""
    from shardkit.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    p = sub.choices["verify"]
    flags = sorted(s for a in p._actions for s in a.option_strings)
    # --no-checksum: the old spelling of --no-verify, kept so no script breaks; --write-manifest: plain saves
    assert flags == sorted(["--engine", "--json", "--json-file", "--no-verify", "--no-checksum", "--world-size", "-h",
                            "--help", "--write-manifest"])
    assert "example:\n  shardkit verify checkpoints/ --world-size 8" in p.epilog


def _edit_manifest(tag_dir, **fields):
    path = tag_dir / MANIFEST_NAME
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("fields, match", [
    ({"world_size": -1}, r"field world_size is -1: must be between 1 and 1,048,576 ranks"),
    ({"world_size": 10**12}, r"field world_size is 1000000000000: must be between 1 and 1,048,576 ranks"),
    ({"files": [{"path": "../../etc/passwd", "size": 1, "sha256": "0" * 64}]},
     r"field files\[0\]\.path is '\.\./\.\./etc/passwd': contains '\.\.'"),
    ({"files": [{"path": "/etc/passwd", "size": 1, "sha256": "0" * 64}]},
     r"field files\[0\]\.path is '/etc/passwd': an absolute path"),
], ids=["world_size=-1", "world_size=1e12", "dotdot-path", "absolute-path"])
def test_hostile_manifest_is_refused_by_verify_naming_the_field(tmp_path, run_cli, fields, match):
    """verify used to call world_size -1 'resumable', loop 10**12 times, and hash /etc/passwd."""
    import time

    _edit_manifest(_ckpt(tmp_path), **fields)
    start = time.monotonic()
    code, out, err = run_cli("verify", tmp_path)
    assert time.monotonic() - start < 10
    assert code == 1 and "resumable" not in out and "Traceback" not in out + err
    code, out, _ = run_cli("verify", tmp_path, "--json")
    [finding] = json.loads(out)["findings"]
    assert code == 1 and finding["key"] == MANIFEST_NAME and re.search(match, finding["message"]), finding
    with pytest.raises(CheckpointError, match=match):
        check_resumable(tmp_path)


def test_manifest_nested_100k_deep_is_a_clean_verify_error(tmp_path, run_cli):
    tag = _ckpt(tmp_path)
    (tag / MANIFEST_NAME).write_text('{"extra": ' + "[" * 100_000 + "]" * 100_000 + "}")
    code, out, err = run_cli("verify", tmp_path, "--json")
    assert code == 1 and "Traceback" not in out + err and "RecursionError" not in out + err
    assert "manifest JSON is nested too deeply to parse" in json.loads(out)["findings"][0]["message"]


def test_many_missing_ranks_are_counted_not_listed_one_by_one(tmp_path):
    """A large world size with few files: a handful of findings, in well under a second."""
    import time

    tag = _ckpt(tmp_path)
    _edit_manifest(tag, world_size=1 << 20)
    start = time.monotonic()
    rep = verify_checkpoint(tmp_path)
    assert time.monotonic() - start < 5
    rank_errors = [f for f in rep.errors if f.rule == "ckpt.rank_file.missing"]
    assert [f.key for f in rank_errors] == ["rank 2", "rank 3", "rank 4", "rank 5", "rank 6", "ranks"] * 2
    assert "1,048,569 more rank(s) have no optim_states file" in rank_errors[5].message


def test_listed_file_that_is_a_fifo_is_not_read(tmp_path):
    import os

    tag = _ckpt(tmp_path)
    f = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.unlink()
    os.mkfifo(f)  # hashing it would block forever
    rep = verify_checkpoint(tmp_path)
    assert [e.rule for e in rep.errors] == ["ckpt.file.not_regular"]
    assert "is not a regular file" in rep.errors[0].message


def test_a_symlink_inside_the_tag_folder_cannot_lead_verify_outside_it(tmp_path):
    """The manifest path 'sub/secret' is fine as text; 'sub' is a link to a folder outside the
    checkpoint (it could be '/', and 'sub/etc/passwd' would be hashed)."""
    import os
    import shutil

    root = tmp_path / "root"
    tag = _ckpt(root)
    (tag / "sub").mkdir()
    (tag / "sub" / "secret").write_bytes(b"outside data")
    seal(tag, engine="deepspeed", world_size=2, zero_stage=3, step=5)
    outside = tmp_path / "elsewhere"
    shutil.move(tag / "sub", outside)  # same bytes, now outside the checkpoint
    os.symlink(outside, tag / "sub")
    rep = verify_checkpoint(root)
    assert [e.rule for e in rep.errors] == ["ckpt.file.outside"]
    assert rep.errors[0].key == "sub/secret" and rep.errors[0].message.startswith(
        f"{tag / 'sub' / 'secret'}: leads outside the checkpoint folder {tag.resolve()} (to {outside / 'secret'}")
    with pytest.raises(CheckpointError, match=r"\[sub/secret\] .*leads outside the checkpoint folder"):
        check_resumable(root)


@pytest.mark.parametrize("content", ["/etc", "../elsewhere"])
def test_latest_naming_a_folder_outside_the_root_is_an_error_not_checked(tmp_path, content, run_cli):
    root = tmp_path / "root"
    _ckpt(root)
    _ckpt(tmp_path / "elsewhere_root", "step7")
    (tmp_path / "elsewhere").symlink_to(tmp_path / "elsewhere_root" / "step7")  # a valid checkpoint out there
    (root / "latest").write_text(content)
    rep = verify_checkpoint(root)
    assert [e.rule for e in rep.errors] == ["ckpt.latest.invalid"] and rep.manifest is None
    assert f"{root / 'latest'}: holds {content!r}, which is not a checkpoint tag" in rep.errors[0].message
    code, out, _ = run_cli("verify", root, "--json")
    assert code == 1 and "not a checkpoint tag" in json.loads(out)["findings"][0]["message"]


def test_a_link_leading_outside_the_tag_is_refused_and_named_even_when_not_listed(tmp_path):
    """A rank file swapped for a link to another run's file (same bytes: the sha256
    would match), and an extra link nobody listed, are both refused by name; the file behind them
    is never opened (a FIFO there would hang any reader)."""
    import os

    root = tmp_path / "root"
    tag = _ckpt(root)
    elsewhere = tmp_path / "other_run"
    elsewhere.mkdir()
    rank1 = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    (elsewhere / rank1.name).write_bytes(rank1.read_bytes())  # identical content: only the link is wrong
    rank1.unlink()
    rank1.symlink_to(elsewhere / rank1.name)
    os.mkfifo(elsewhere / "pipe")  # read through the link, it would block forever
    (tag / "extra").symlink_to(elsewhere / "pipe")
    rep = verify_checkpoint(root)
    assert sorted(e.rule for e in rep.errors) == ["ckpt.file.outside", "ckpt.link.outside"], rep.errors
    extra = next(e for e in rep.errors if e.rule == "ckpt.link.outside")
    assert extra.key == "extra" and extra.message == (
        f"{tag / 'extra'}: a symlink to {str(elsewhere / 'pipe')!r}, which leads outside the checkpoint folder "
        f"{tag.resolve()} (to {elsewhere / 'pipe'}); shardkit never reads or writes through it")
    assert "replace the link with a copy of the file" in extra.fix
    listed = next(e for e in rep.errors if e.rule == "ckpt.file.outside")
    assert listed.key == rank1.name and f"(to {elsewhere / rank1.name}" in listed.message
    with pytest.raises(CheckpointError, match=r"\[.*\] .*leads outside the checkpoint folder.*1 more problem"):
        check_resumable(root)


def test_a_link_inside_the_tag_is_read_and_a_manifest_linked_from_outside_is_not(tmp_path):
    root = tmp_path / "root"
    tag = _ckpt(root)
    (tag / "alias").symlink_to(tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")  # stays inside: harmless
    rep = verify_checkpoint(root)
    assert rep.ok and [f.rule for f in rep.warnings] == ["ckpt.file.extra"]
    (tag / "alias").unlink()
    other = _ckpt(tmp_path / "other", tag="step7")
    (tag / MANIFEST_NAME).unlink()
    (tag / MANIFEST_NAME).symlink_to(other / MANIFEST_NAME)  # another run's manifest vouching for these files
    with pytest.raises(CheckpointError, match=r"shardkit_manifest\.json: a symlink leading outside the checkpoint "
                       r"folder \(to .*other/step7/shardkit_manifest\.json\); a manifest must be the folder's own file"):
        check_resumable(tag)


def test_the_hash_never_follows_a_link_swapped_in_after_the_path_was_checked(tmp_path):
    from shardkit.storage.manifest import file_digest

    tag = _ckpt(tmp_path)
    f = tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    outside = tmp_path / "outside.bin"
    outside.write_bytes(f.read_bytes())
    f.unlink()
    f.symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"leads outside the checkpoint folder .* it is not read"):
        file_digest(f, "blake3", inside=tag.resolve())


def test_readers_of_a_folder_without_manifest_refuse_links_leaving_it(tmp_path):
    from shardkit.storage.verify import refuse_links_leaving

    tag = tmp_path / "global_step1"
    tag.mkdir()
    (tmp_path / "secret").write_bytes(b"x")
    (tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").symlink_to(tmp_path / "secret")
    (tag / "sub").symlink_to("/", target_is_directory=True)
    with pytest.raises(CheckpointError, match=r"refusing to convert .*global_step1: .*global_step1/sub: a symlink to "
                       r"'/', which leads outside the checkpoint folder .* \(to /\); shardkit never reads or writes "
                       r"through it \(1 more such link\(s\)\)\. Fix: replace the link"):
        refuse_links_leaving(tag, "convert")


def test_files_named_for_another_precision_than_the_resuming_run_are_named_before_deepspeed_reads(tmp_path):
    """DeepSpeed 0.19.8's load_checkpoint looks only for its own naming (bf16_zero_pp_rank_* under
    bf16) and fails with FileNotFoundError; verify, told the run's bf16.enabled, names it first."""
    tag = _ckpt(tmp_path)  # zero_pp_rank_* files: written by a run without bf16
    assert verify_checkpoint(tmp_path, bf16=False).ok
    rep = verify_checkpoint(tmp_path, bf16=True)
    (err,) = rep.errors
    assert err.rule == "ckpt.precision.mismatch" and err.key == "bf16.enabled" and err.value is True
    assert err.message == (f"{tag}: its ZeRO optimizer files are named for a run without bf16 (fp32 or fp16) "
                           "(zero_pp_rank_0_mp_rank_00_optim_states.pt), but this engine runs bf16 (bf16.enabled: "
                           "true), so DeepSpeed's load_checkpoint looks for bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt "
                           "and stops with FileNotFoundError (DeepSpeed 0.19.8 never falls back to the other naming)")
    assert err.fix.startswith("resume with the precision the checkpoint was written in (set bf16.enabled to false")
    with pytest.raises(CheckpointError, match=r"\[bf16\.enabled\] .*named for a run without bf16"):
        check_resumable(tmp_path, bf16=True)
    # shardkit's own loader (allow_reshard) reads either naming: no error there
    assert verify_checkpoint(tmp_path, bf16=True, allow_reshard=True).ok


def test_a_dcp_shard_the_manifest_does_not_list_fails_verify_naming_it(tmp_path):
    # found by the hostile sweep: a manifest with a .distcp entry dropped verified, and the converts
    # then read that shard unchecked; a data file the loaders read must be vouched for
    import json

    d = tmp_path / "step5"
    d.mkdir()
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata"):
        (d / name).write_bytes(name.encode() * 10)
    seal(d, engine="fsdp2", world_size=2, step=5)
    write_latest(tmp_path, "step5")
    assert verify_checkpoint(tmp_path).ok
    data = json.loads((d / MANIFEST_NAME).read_text())
    data["files"] = [f for f in data["files"] if f["path"] != "__1_0.distcp"]
    (d / MANIFEST_NAME).write_text(json.dumps(data))
    rep = verify_checkpoint(tmp_path)
    unlisted = [f for f in rep.errors if f.rule == "ckpt.file.unlisted"]
    assert not rep.ok and [f.key for f in unlisted] == ["__1_0.distcp"], rep.findings
    assert "it would be read unverified" in unlisted[0].message and "restore the manifest" in unlisted[0].fix
    (d / "notes.txt").write_text("a user's note")  # any other file stays a warning
    assert "ckpt.file.extra" in [f.rule for f in verify_checkpoint(tmp_path).warnings]
