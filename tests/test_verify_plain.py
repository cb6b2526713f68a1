"""``shardkit verify`` of plain saves without a shardkit manifest: real 2-rank saves of
DeepSpeed ZeRO-3 and ZeRO-2 (gloo), FSDP2 (DCP), a Trainer checkpoint-N wrapping ZeRO-2 and Accelerate's
FSDP1 SHARDED_STATE_DICT and FULL_STATE_DICT folders each verify whole (exit 0, said to be a structural
check with no digests); then a rank file deleted, one truncated, a ``.distcp`` deleted, a ``data.pkl``
corrupted, a rank file of another world size mixed in: exit 1 naming the file. ``--write-manifest``
records digests once, after which a changed byte inside a tensor (which the structural check cannot
see, by design) is caught.
"""

from __future__ import annotations

import json
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MANIFEST = "shardkit_manifest.json"


def save_fsdp1(base: str) -> None:
    """Rank target: tests/test_fsdp1_sources' and tests/test_fsdp1_bins' own savers, for the three accelerate
    layouts verified here (SHARDED_STATE_DICT as DCP and as per-rank files, FULL_STATE_DICT)."""
    from tests import test_fsdp1_bins as B
    from tests import test_fsdp1_sources as F

    F.FSDP1_SAVES = {label: F.FSDP1_SAVES[label] for label in ("sharded", "full")}
    F.save_fsdp1_checkpoints(base)
    B.SAVES = {"bins": B.SAVES["bins"]}
    B.save_checkpoints(base)


@pytest.fixture(scope="module")
def saves(sweep_sources: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """label -> a plain save (no manifest), built once for the module."""
    from shardkit.run.spawn.process import run_ranks
    from tests import _ranks_zero12_sources as S

    base = tmp_path_factory.mktemp("verify_plain")
    run_ranks(S.save_all, 2, args=(str(base / "zero12"), {"zero2": S.VARIANTS["zero2"]}), timeout=600, device="cpu")
    run_ranks(save_fsdp1, 2, args=(str(base / "fsdp1"),), timeout=400, device="cpu")
    fsdp2 = base / "fsdp2"
    shutil.copytree(sweep_sources.root("fsdp2"), fsdp2)
    for m in fsdp2.rglob(MANIFEST):  # shardkit's own save: made a plain DCP save
        m.unlink()
    from shardkit.cli import main

    assert main(["convert", str(base / "zero12" / "zero2"), "--to", "universal", "-o", str(base / "universal")]) == 0
    for m in (base / "universal").rglob(MANIFEST):  # as ds_to_universal writes it: no manifest
        m.unlink()
    trainer = base / "trainer" / "checkpoint-2"
    shutil.copytree(base / "zero12" / "zero2", trainer)
    (trainer / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    return {"zero3": sweep_sources.root("zero3"), "zero2": base / "zero12" / "zero2", "fsdp2": fsdp2,
            "trainer_zero2": trainer, "fsdp1_sharded": base / "fsdp1" / "sharded" / "checkpoint-2",
            "fsdp1_full": base / "fsdp1" / "full" / "checkpoint-2", "fsdp1_bins": base / "fsdp1" / "bins" / "checkpoint-2",
            "universal": base / "universal"}


KINDS = {"zero3": "zero3", "zero2": "zero12", "fsdp2": "dcp", "trainer_zero2": "zero12",
         "fsdp1_sharded": "fsdp1-sharded", "fsdp1_full": "fsdp1-full", "fsdp1_bins": "fsdp1-sharded-bins",
         "universal": "universal"}
#: Layouts whose files do not record how many ranks wrote them.
NO_WORLD_SIZE = ("fsdp1_full", "universal")


def _copy(saves: dict[str, Path], label: str, tmp_path: Path) -> Path:
    dst = tmp_path / label
    shutil.copytree(saves[label], dst)
    return dst


def _tag(root: Path) -> Path:
    latest = root / "latest"
    return root / latest.read_text().strip() if latest.is_file() else root


def _verify(run_cli: Any, path: Path, *flags: str) -> tuple[int, dict[str, Any]]:
    code, out, err = run_cli("verify", path, "--json", *flags)
    return code, json.loads(out)


def _errors(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["severity"] == "error"]


@pytest.mark.parametrize("label", list(KINDS))
def test_a_whole_plain_save_verifies_as_a_structural_check(saves, run_cli, label):
    assert not list(saves[label].rglob(MANIFEST)), "the source must be a plain save"
    code, report = _verify(run_cli, saves[label])
    assert code == 0, _errors(report)
    assert report["check"] == "structure" and "no digests" in report["digests"]
    assert report["kind"] == KINDS[label]
    assert report["files"] >= 2 and report["bytes"] > 0 and report["tensors"] > 0
    assert report["world_size"] == (None if label in NO_WORLD_SIZE else 2)
    code, out, _ = run_cli("verify", saves[label])
    assert code == 0
    assert "whole as far as its structure tells" in out and "no digests exist" in out and "--write-manifest" in out


def test_a_deleted_rank_file_is_named_with_the_world_size(saves, run_cli, tmp_path):
    root = _copy(saves, "zero3", tmp_path)
    (_tag(root) / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    code, report = _verify(run_cli, root)
    assert code == 1
    assert any("zero_pp_rank_1_mp_rank_00_optim_states.pt of 2: missing" in f["message"] for f in _errors(report))
    code, out, _ = run_cli("verify", root)
    assert code == 1 and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in out


def test_a_truncated_rank_file_is_named(saves, run_cli, tmp_path):
    root = _copy(saves, "zero2", tmp_path)
    victim = _tag(root) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    size = victim.stat().st_size
    with open(victim, "r+b") as fh:
        fh.truncate(size // 2)
    code, report = _verify(run_cli, root)
    assert code == 1
    errors = _errors(report)
    assert errors[0]["key"] == victim.name and "truncated" in errors[0]["message"]
    assert any(f["rule"] == "ckpt.structure.skipped" for f in report["findings"])


def test_a_missing_distcp_file_is_named_with_what_it_held(saves, run_cli, tmp_path):
    root = _copy(saves, "fsdp2", tmp_path)
    folder = next(p.parent for p in root.rglob(".metadata"))
    victim = sorted(folder.glob("*.distcp"))[-1]
    victim.unlink()
    code, report = _verify(run_cli, root)
    assert code == 1
    assert any(f["key"].endswith(victim.name) and "missing" in f["message"] and "item(s)" in f["message"]
               for f in _errors(report))


def test_a_missing_distcp_of_an_fsdp1_optimizer_is_named(saves, run_cli, tmp_path):
    root = _copy(saves, "fsdp1_sharded", tmp_path)
    victim = sorted((root / "optimizer_0").glob("*.distcp"))[0]
    victim.unlink()
    code, report = _verify(run_cli, root)
    assert code == 1
    assert any(f["key"] == f"optimizer_0/{victim.name}" for f in _errors(report))


def test_a_lost_fsdp1_rank_file_is_named_with_the_world_size(saves, run_cli, tmp_path):
    root = _copy(saves, "fsdp1_bins", tmp_path)
    (root / "optimizer_0_rank1.bin").unlink()
    code, report = _verify(run_cli, root)
    assert code == 1
    assert any(f["message"].startswith("optimizer_0_rank1.bin of 2: missing") for f in _errors(report)), _errors(report)


def test_a_universal_checkpoint_missing_a_moment_is_named(saves, run_cli, tmp_path):
    root = _copy(saves, "universal", tmp_path)
    (_tag(root) / "zero" / "model.norm.weight" / "exp_avg.pt").unlink()
    code, report = _verify(run_cli, root)
    assert code == 1
    assert any("model.norm.weight (no exp_avg)" in f["message"] for f in _errors(report)), _errors(report)


def _record_offset(path: Path, tensor: bool = False) -> int:
    """Where the bytes of ``path``'s data.pkl (or its largest tensor record) start."""
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        info = (max((i for i in infos if "/data/" in i.filename), key=lambda i: i.file_size) if tensor
                else next(i for i in infos if i.filename.endswith("data.pkl")))
    with open(path, "rb") as fh:
        fh.seek(info.header_offset)
        header = fh.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _flip_tensor_byte(path: Path) -> None:
    """One byte inside the largest tensor record: nothing structural changes."""
    with open(path, "r+b") as fh:
        fh.seek(_record_offset(path, tensor=True) + 5)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))


def test_a_corrupted_data_pkl_is_named(saves, run_cli, tmp_path):
    root = _copy(saves, "zero3", tmp_path)
    victim = _tag(root) / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    with open(victim, "r+b") as fh:  # same size: the zip directory still reads, the pickle does not
        fh.seek(_record_offset(victim) + 2)
        fh.write(b"\xfe" * 24)
    code, report = _verify(run_cli, root)
    assert code == 1
    assert any(f["key"] == victim.name and f["rule"] == "ckpt.structure.pickle" for f in _errors(report))


def test_a_rank_file_of_another_world_size_is_named(saves, run_cli, tmp_path):
    root = _copy(saves, "zero2", tmp_path)
    tag = _tag(root)
    shutil.copy(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt", tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    code, report = _verify(run_cli, root)
    assert code == 1
    assert any("zero_pp_rank_2_mp_rank_00_optim_states.pt" in f["message"] and "another world size" in f["message"]
               for f in _errors(report))


def test_a_deepspeed_save_at_another_world_size_is_refused_for_the_resume(saves, run_cli):
    code, report = _verify(run_cli, saves["zero2"], "--world-size", "4")
    assert code == 1
    assert [f["rule"] for f in _errors(report)] == ["ckpt.world_size.mismatch"]
    assert "shardkit reshard" in _errors(report)[0]["fix"]


def test_a_refusal_marker_is_named_and_the_files_still_checked(saves, run_cli, tmp_path):
    root = _copy(saves, "zero3", tmp_path)
    tag = _tag(root)
    shutil.copy(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", tag / "expp_rank_0_mp_rank_00_optim_states.pt")
    code, report = _verify(run_cli, root)
    assert code == 0, _errors(report)
    assert any(f["rule"] == "ckpt.structure.refusal" and "MoE expert files" in f["key"] for f in report["findings"])


def test_write_manifest_records_digests_that_later_verifies_compare(saves, run_cli, tmp_path):
    root = _copy(saves, "zero2", tmp_path)
    tag = _tag(root)
    victim = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    code, report = _verify(run_cli, root, "--write-manifest")
    assert code == 0 and report["manifest_written"] is True
    assert (tag / MANIFEST).is_file()
    code, again = _verify(run_cli, root)
    assert code == 0 and again["checked"] == "sizes and content digests"
    _flip_tensor_byte(victim)
    code, after = _verify(run_cli, root)
    assert code == 1 and [f["rule"] for f in _errors(after)] == ["ckpt.file.checksum"]
    code, _, err = run_cli("verify", root, "--write-manifest")
    assert code == 2 and f"--write-manifest: {tag}/{MANIFEST} exists already" in err


def test_a_changed_tensor_byte_is_not_seen_without_a_manifest(saves, run_cli, tmp_path):
    """The limit the output states: with no digests, bytes inside a tensor are never read."""
    root = _copy(saves, "zero2", tmp_path)
    victim = _tag(root) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    _flip_tensor_byte(victim)
    code, report = _verify(run_cli, root)
    assert code == 0 and "no digests" in report["digests"]


def test_a_folder_no_reader_knows_keeps_the_manifest_checks_words(run_cli, tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    code, report = _verify(run_cli, tmp_path)
    assert code == 1 and "check" not in report  # nothing structural was claimed
    assert _errors(report)[0]["rule"] == "ckpt.none_complete"
    assert _errors(report)[0]["message"] == f"no completed checkpoint under {tmp_path}"
    assert "not a checkpoint shardkit knows (it holds ['notes.txt'])" in _errors(report)[1]["message"]


def test_plain_tags_without_latest_are_named_as_ambiguous(saves, run_cli, tmp_path):
    for tag in ("global_step2", "global_step4"):
        shutil.copytree(_tag(saves["zero2"]), tmp_path / "root" / tag)
    code, report = _verify(run_cli, tmp_path / "root")
    assert code == 1
    assert any("has no 'latest' file, so which tag to read is ambiguous" in f["message"] and "global_step4" in f["message"]
               for f in _errors(report)), _errors(report)


def test_at_eight_ranks_a_lost_rank_and_a_rank_of_another_save_are_named(saves, run_cli, tmp_path):
    """The 2-rank ZeRO-3 save resharded to 8 and to 4 ranks (shardkit's torch-free reshard, no manifest): rank 5's
    optimizer file lost, rank 3's model file swapped for the 4-rank save's."""
    from shardkit.checkpoint.ops.reshard import reshard_checkpoint

    reshard_checkpoint(saves["zero3"], tmp_path / "eight", 8, manifest=False, warn=lambda _: None)
    reshard_checkpoint(saves["zero3"], tmp_path / "four", 4, manifest=False, warn=lambda _: None)
    eight, four = _tag(tmp_path / "eight"), _tag(tmp_path / "four")
    code, report = _verify(run_cli, tmp_path / "eight")
    assert code == 0 and report["world_size"] == 8 and report["files"] == 16, _errors(report)
    (eight / "zero_pp_rank_5_mp_rank_00_optim_states.pt").unlink()
    shutil.copy(four / "zero_pp_rank_3_mp_rank_00_model_states.pt", eight / "zero_pp_rank_3_mp_rank_00_model_states.pt")
    code, report = _verify(run_cli, tmp_path / "eight")
    assert code == 1
    messages = [f["message"] for f in _errors(report)]
    assert any(m.startswith("zero_pp_rank_5_mp_rank_00_optim_states.pt of 8: missing (dp_world_size in "
                            "zero_pp_rank_0_mp_rank_00_model_states.pt is 8)") for m in messages), messages
    assert any("ranks disagree: zero_pp_rank_3_mp_rank_00_model_states.pt records dp_world_size=4 where "
               "zero_pp_rank_0_mp_rank_00_model_states.pt records 8" in m for m in messages), messages


def test_a_rank_file_that_is_a_directory_is_named_as_one(saves, run_cli, tmp_path):
    """A copy that made a folder of a rank file: said to be a directory (what the readers say), not 'missing'."""
    root = _copy(saves, "zero3", tmp_path)
    victim = _tag(root) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.unlink()
    victim.mkdir()
    code, report = _verify(run_cli, root)
    assert code == 1
    found = [f for f in _errors(report) if f["key"] == victim.name]
    assert found and f"{victim} is a directory, not the rank file" in found[0]["message"], _errors(report)
    assert "missing" not in found[0]["message"] and "replace it with the file" in found[0]["fix"]


def test_a_distcp_file_that_is_a_directory_is_named_as_one(saves, run_cli, tmp_path):
    root = _copy(saves, "fsdp2", tmp_path)
    victim = sorted(next(p.parent for p in root.rglob(".metadata")).glob("*.distcp"))[-1]
    victim.unlink()
    victim.mkdir()
    code, report = _verify(run_cli, root)
    assert code == 1
    found = [f for f in _errors(report) if f["key"].endswith(victim.name)]
    assert found and "is a directory, not the .distcp file" in found[0]["message"], _errors(report)
    assert "missing" not in found[0]["message"]


@pytest.mark.parametrize("label", ["zero3", "zero2"])
def test_each_rank_file_is_opened_and_parsed_once(saves, tmp_path, monkeypatch, label):
    """The file checks take the reader's parses and the zip records its central directory lists, and the layout
    detection's and the reader's parses of rank 0's files are one: at 8 ranks every rank file's zip is opened
    (its central directory read) and its data.pkl parsed exactly once. Before: twice each, rank 0's optimizer
    file 4 times and parsed 3 times."""
    from collections import Counter

    from shardkit.checkpoint.ops.reshard import reshard_checkpoint
    from shardkit.checkpoint.ops.verify_structure import verify_structure
    from shardkit.storage.structure_observers import observe_structures

    reshard_checkpoint(saves[label], tmp_path / "eight", 8, manifest=False, warn=lambda _: None)
    opened: Counter[str] = Counter()
    real_init = zipfile.ZipFile.__init__

    def counting_init(self: zipfile.ZipFile, file: Any, *args: Any, **kwargs: Any) -> None:
        opened.update([Path(str(getattr(file, "name", file))).name])  # a path, or the file open_regular opened
        real_init(self, file, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "__init__", counting_init)
    seen: Counter[str] = Counter()
    with observe_structures(lambda path, _structure, _records: seen.update([path.name])):
        report = verify_structure(tmp_path / "eight")
    assert report.ok and report.world_size == 8 and report.tensors > 0, report.findings
    files = [f.name for f in _tag(tmp_path / "eight").iterdir() if f.name.endswith(".pt")]
    assert len(files) >= 9 and {n: opened[n] for n in files} == {n: 1 for n in files}, opened
    assert set(seen) == set(files)  # every file's structure was checked


def test_a_weights_only_folder_for_another_engine_is_not_sent_to_convert(saves, run_cli, tmp_path):
    """The DCP model folder of an accelerate save (no optimizer state) checked for a DeepSpeed resume: every convert
    target refuses it, so the fix names a fresh start from its weights instead of `convert --to zero3`."""
    src = tmp_path / "weights_only"
    shutil.copytree(saves["fsdp1_sharded"] / "pytorch_model_fsdp_0", src)
    code, report = _verify(run_cli, src, "--engine", "zero3")
    assert code == 1
    (engine,) = [f for f in _errors(report) if f["rule"] == "ckpt.structure.engine"]
    assert "no optimizer state" in engine["fix"] and "shardkit export" in engine["fix"], engine
    assert "convert" not in engine["fix"].replace("no convert", "")
    code, report = _verify(run_cli, saves["fsdp2"], "--engine", "zero3")  # with optimizer state: convert takes it
    assert code == 1 and "convert it first: shardkit convert" in _errors(report)[0]["fix"]


def test_a_command_reading_a_plain_save_points_to_verify(saves, run_cli, tmp_path):
    """reshard, convert and consolidate read a save without a manifest with a warning; the warning names the check
    that exists for it (it said only 'save with shardkit to get a manifest')."""
    code, _, err = run_cli("consolidate", saves["zero2"], "-o", tmp_path / "model.safetensors")
    assert code == 0, err
    assert "cannot be verified" in err and f"shardkit verify {_tag(saves['zero2'])}" in err, err
