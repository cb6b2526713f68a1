"""What shardkit says is whole, and every manifest it seals, covers only what it checked.

Real 2-rank DeepSpeed saves (ZeRO-2 and ZeRO-3, gloo on CPU), damaged as a careless copy or a bad disk does:

- a ZeRO-2 rank optimizer file copied over the other one, or the two swapped: each file parses, agrees on
  every size and covers every tensor, but its ``param_slice_mappings`` name the other rank's parameters.
  ``verify`` and every reader (consolidate, reshard, convert, export) name the file and the rank whose
  partition it holds, and write nothing (before: "whole", exit 0, and other weights consolidated);
- a record size rewritten in a rank file's zip directory (the file's size unchanged): ``torch.load`` refuses
  it, and a same-world-size ``reshard``, which copies the files, sealed a manifest over it (exit 0). The copy
  now checks each file as verify does (and a ZeRO-3 rank file against rank 0's layout) before anything is
  published;
- a rank file that is a symlink leading out of the tag folder: ``verify --write-manifest`` hashed it through
  the link and wrote the manifest. Now named as an error, nothing written;
- a ``loop -> loop`` symlink in a root or tag folder: every command listing the folder stopped with "Too many
  levels of symbolic links" (verify of a root too). Now no command reads it (it is no file), ``verify`` names
  it as a warning, ``--write-manifest`` refuses while it is there;
- ``verify FOLDER --write-manifest`` of a folder that is no checkpoint said it "has a shardkit manifest
  already".
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

TAG = "global_step2"
RANK0 = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
RANK1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
MANIFEST = "shardkit_manifest.json"


@pytest.fixture(scope="module")
def zero2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain DeepSpeed ZeRO-2 save at 2 ranks (the ZeRO-1/2 sources' qwen2 model, two param groups)."""
    from shardkit.run.spawn.process import run_ranks
    from tests import _ranks_zero12_sources as S

    base = tmp_path_factory.mktemp("vouch_zero12")
    run_ranks(S.save_all, 2, args=(str(base), {"zero2": S.VARIANTS["zero2"]}), timeout=600, device="cpu")
    return base / "zero2"


@pytest.fixture(scope="module")
def zero3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's plain 2-rank ZeRO-3 save (tests/_ranks_zero3, shared with the hostile-checkpoint tests)."""
    from tests import _ranks_zero3 as R

    return R.build_sources(tmp_path_factory.getbasetemp() / "zero3")["fp32"]


def _copy(src: Path, tmp_path: Path, name: str = "src") -> Path:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def grow_record(path: Path, grow: int = 4096) -> str:
    """Rewrite the central directory's sizes of the file's largest tensor record (the file's size unchanged),
    as a bad copy or an edit can; returns the record's name."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    at = data.find(b"PK\x01\x02")
    while at >= 0:
        name_len = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46: at + 46 + name_len] == info.filename.encode():
            break
        at = data.find(b"PK\x01\x02", at + 4)
    size = len(data)
    compressed, uncompressed = struct.unpack_from("<II", data, at + 20)
    if compressed != 0xFFFFFFFF:
        struct.pack_into("<II", data, at + 20, compressed + grow, uncompressed + grow)
    else:  # zip64: both sizes are in the entry's zip64 extra field (id 1), uncompressed first
        extra = at + 46 + name_len
        while struct.unpack_from("<H", data, extra)[0] != 1:
            extra += 4 + struct.unpack_from("<H", data, extra + 2)[0]
        big_u, big_c = struct.unpack_from("<QQ", data, extra + 4)
        struct.pack_into("<QQ", data, extra + 4, big_u + grow, big_c + grow)
    path.write_bytes(bytes(data))
    assert path.stat().st_size == size
    return info.filename


def _errors(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["severity"] == "error"]


# --- ZeRO-1/2 rank files in their place -------------------------------------------------------------


@pytest.mark.parametrize("damage", ["copy", "swap"])
def test_a_rank_file_in_another_ranks_place_is_named_by_verify_and_every_reader(zero2, tmp_path, run_cli, damage):
    src = _copy(zero2, tmp_path)
    tag = src / TAG
    if damage == "copy":  # rank 1's file is a copy of rank 0's
        shutil.copyfile(tag / RANK0, tag / RANK1)
        named, holds = RANK1, "holds rank 0's partition of param group 0, not rank 1's"
    else:  # the two files renamed into each other's place
        (tag / RANK0).rename(tag / "x")
        (tag / RANK1).rename(tag / RANK0)
        (tag / "x").rename(tag / RANK1)
        named, holds = RANK0, "holds rank 1's partition of param group 0, not rank 0's"

    code, out, _ = run_cli("verify", src, "--json")
    report = json.loads(out)
    assert code == 1 and not report["ok"], report
    (finding,) = _errors(report)
    assert finding["rule"] == "ckpt.structure.reader" and f"{tag / named}: {holds}" in finding["message"]
    assert "param_slice_mappings[0] places 'model." in finding["message"] and "re-copy the tag folder" in \
        finding["message"].lower()

    for argv, out_path in ((["consolidate", src, "-o", tmp_path / "c.safetensors"], tmp_path / "c.safetensors"),
                           (["reshard", src, "--world-size", "3", "-o", tmp_path / "r3"], tmp_path / "r3"),
                           (["reshard", src, "--world-size", "2", "-o", tmp_path / "r2"], tmp_path / "r2"),
                           (["convert", src, "--to", "fsdp2", "-o", tmp_path / "dcp"], tmp_path / "dcp"),
                           (["export", src, "-o", tmp_path / "hf"], tmp_path / "hf")):
        code, out, err = run_cli(*argv)
        assert code == 1, (argv, out, err)
        assert f"{tag / named}: {holds}" in err, (argv, err)
        assert not out_path.exists(), argv  # refused before anything was written


def test_the_place_check_names_padding_and_fragments_that_belong_to_another_rank():
    """Rank logic in one process: a group of 3 parameters (10 + 7 + 5 elements, data ends at 22) cut into
    partitions of 12 at 2 ranks; rank 1 holds 'b' from element 0 and 'c', and 2 elements of tail padding."""
    from shardkit.checkpoint.readers.zero12_place import check_group_places
    from shardkit.core.errors import CheckpointError
    from shardkit.storage.torch_load import deepspeed_stub

    frag = "deepspeed.utils.tensor_fragment.fragment_address"
    params = [("a", (10,), 0), ("b", (7,), 10), ("c", (5,), 17)]
    r0 = [{"a": deepspeed_stub(frag, numel=10, start=0), "b": deepspeed_stub(frag, numel=2, start=10)}]
    r1 = [{"b": deepspeed_stub(frag, numel=5, start=0), "c": deepspeed_stub(frag, numel=5, start=5)}]
    here = Path("/ckpt/tag")
    check_group_places(here, 0, 12, 22, params, {0: (here / "r0", 0, r0), 1: (here / "r1", 2, r1)}, 2)
    with pytest.raises(CheckpointError, match=r"/ckpt/tag/r1: holds rank 0's partition of param group 0, not rank 1's: "
                       r"its param_slice_mappings\[0\] places 'a' at element 0 \(10 elements\), 'b' at element 10 "
                       r"\(2 elements\); rank 1's partition \(elements 12..24 of the group's flat buffer\) holds 'b'"):
        check_group_places(here, 0, 12, 22, params, {1: (here / "r1", 2, r0)}, 2)
    # without param_slice_mappings (another tool's file) the padding alone tells the last rank's file apart
    with pytest.raises(CheckpointError, match=r"/ckpt/tag/r0: group_paddings\[0\] is 2, but rank 0 of 2 holds 0 "
                       r"padding elements of param group 0"):
        check_group_places(here, 0, 12, 22, params, {0: (here / "r0", 2, None)}, 2)
    with pytest.raises(CheckpointError, match=r"holds a partition of param group 0 that no rank of this 2-rank save holds"):
        odd = [{"a": deepspeed_stub(frag, numel=3, start=1)}]
        check_group_places(here, 0, 12, 22, params, {0: (here / "r0", 0, odd)}, 2)


# --- a copy is checked before a manifest is sealed over it ------------------------------------------


def test_zip_records_whose_directory_size_was_rewritten_are_named_and_whole_ones_pass(tmp_path, monkeypatch):
    """The zip check compares each record's own size and crc (data descriptor or local header) with the central
    directory's: torch.save's files, shardkit's own (zip64 records and offsets too) and zipfile's pass."""
    import torch

    import shardkit.storage.torch_zip as torch_zip
    from shardkit.checkpoint.ops.verify_files import torch_zip_problem
    from shardkit.storage.stream import stream_save

    sd = {"small": torch.arange(3), "big": torch.randn(2000), "empty": torch.zeros(0), "step": 7}
    torch.save(sd, tmp_path / "torch.pt")
    monkeypatch.setattr(torch_zip, "ZIP64_AT", 1000)  # every zip64 branch on a few KB (tests/test_stream.py)
    stream_save(sd, tmp_path / "shardkit.pt")
    with zipfile.ZipFile(tmp_path / "plain.zip", "w") as z:  # sizes in the local header, no data descriptor
        z.writestr("archive/data/0", b"x" * 100)
        z.writestr("archive/data/1", b"")
    for name in ("torch.pt", "shardkit.pt", "plain.zip"):
        assert torch_zip_problem(tmp_path / name) is None, name
        record = grow_record(tmp_path / name, grow=8)
        problem = torch_zip_problem(tmp_path / name)
        assert problem is not None and problem.startswith(f"record {record}: the central directory says "), (name, problem)
        assert "the zip's directory was edited or the file is damaged" in problem


def test_a_same_size_reshard_refuses_to_copy_a_zero2_file_whose_record_size_was_rewritten(zero2, tmp_path, run_cli):
    src = _copy(zero2, tmp_path)
    record = grow_record(src / TAG / RANK0)
    code, out, err = run_cli("reshard", src, "--world-size", "2", "-o", tmp_path / "out")
    assert code == 1, (out, err)
    assert f"{src / TAG / RANK0}: record {record}: the central directory says" in err
    assert "Nothing was published" in err and not (tmp_path / "out").exists()
    code, out, _ = run_cli("verify", src, "--json")  # the source's verify names it alike
    assert code == 1 and any(f["rule"] == "ckpt.structure.zip" and record in f["message"]
                             for f in _errors(json.loads(out)))


def test_a_same_size_reshard_checks_every_zero3_rank_file_it_copies(zero3, zero2, tmp_path, run_cli):
    """The ZeRO-3 copy route reads no pieces (the lazy reader parsed rank 0 only): each copied rank file is
    checked as verify checks it and against rank 0's layout, as the reader checks the files it parses."""
    damaged = _copy(zero3, tmp_path, "damaged")
    record = grow_record(damaged / TAG / RANK1)
    code, _, err = run_cli("reshard", damaged, "--world-size", "2", "-o", tmp_path / "out1")
    assert code == 1 and f"{damaged / TAG / RANK1}: record {record}: the central directory says" in err, err
    assert not (tmp_path / "out1").exists()

    mixed = _copy(zero3, tmp_path, "mixed")  # a rank file of another save in rank 1's place (the ZeRO-2 save's)
    shutil.copyfile(zero2 / TAG / RANK1, mixed / TAG / RANK1)
    code, _, err = run_cli("reshard", mixed, "--world-size", "2", "-o", tmp_path / "out2")
    assert code == 1 and f"{mixed / TAG / RANK1}: has no fp32_flat_groups" in err, err
    assert not (tmp_path / "out2").exists()

    code, out, err = run_cli("reshard", zero3, "--world-size", "2", "-o", tmp_path / "whole")  # the whole save copies
    assert code == 0, err
    assert run_cli("verify", tmp_path / "whole")[0] == 0


# --- links -------------------------------------------------------------------------------------------


def test_write_manifest_refuses_a_rank_file_linked_from_outside_the_tag_folder(zero2, tmp_path, run_cli):
    src = _copy(zero2, tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (src / TAG / RANK1).rename(outside / RANK1)
    (src / TAG / RANK1).symlink_to(outside / RANK1)

    code, out, _ = run_cli("verify", src, "--write-manifest", "--json")
    report = json.loads(out)
    assert code == 1 and report["manifest_written"] is False
    (link,) = [f for f in _errors(report) if f["rule"] == "ckpt.link.outside"]
    assert link["key"] == RANK1 and "leads outside the checkpoint folder" in link["message"]
    assert "shardkit never reads or writes through it" in link["message"]
    assert not (src / TAG / MANIFEST).exists()
    code, out, _ = run_cli("verify", src, "--write-manifest")
    assert code == 1 and "--write-manifest: no manifest was written: the checkpoint is not whole" in out

    # the writer refuses it itself too, whatever report it is handed
    from shardkit.checkpoint.ops.verify_manifest import write_plain_manifest
    from shardkit.checkpoint.ops.verify_structure import StructureReport
    from shardkit.core.errors import CheckpointError

    whole = StructureReport(subject=str(src), kind="zero12", tensor_folder=str(src / TAG), world_size=2)
    with pytest.raises(CheckpointError, match=rf"refusing to write a manifest for {src / TAG}: .*{RANK1}: a symlink "):
        write_plain_manifest(whole)
    assert not (src / TAG / MANIFEST).exists()


def test_a_link_loop_is_no_file_to_any_command_and_verify_names_it(zero2, tmp_path, run_cli):
    src = _copy(zero2, tmp_path)
    (src / "loop").symlink_to("loop")  # in the root, beside 'latest'
    (src / TAG / "loop").symlink_to("loop")  # in the tag folder

    code, out, err = run_cli("verify", src, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"], (report, err)
    (warning,) = [f for f in report["findings"] if f["rule"] == "ckpt.link.nowhere"]
    assert warning["key"] == "loop" and "leads nowhere (a loop of links)" in warning["message"]
    assert str(src / TAG / "loop") in warning["message"]
    code, out, _ = run_cli("verify", src)  # and advises no --write-manifest, which it would refuse
    assert code == 0 and "whole as far as its structure tells" in out and "--write-manifest` hashes" not in out

    for argv in (["reshard", src, "--world-size", "1", "-o", tmp_path / "r1"],
                 ["reshard", src, "--world-size", "2", "-o", tmp_path / "r2"],
                 ["convert", src, "--to", "fsdp2", "-o", tmp_path / "dcp"],
                 ["consolidate", src, "-o", tmp_path / "c.safetensors"]):
        code, out, err = run_cli(*argv)
        assert code == 0 and "Too many levels of symbolic links" not in err, (argv, err)

    code, out, err = run_cli("verify", src, "--write-manifest")
    assert code == 1 and f"refusing to write a manifest for {src / TAG}: {src / TAG / 'loop'} is a symbolic link " \
        "to 'loop', which leads nowhere" in err, err
    assert not (src / TAG / MANIFEST).exists()

    # in a sealed tag folder: named as the link it is (not as a file added after the save), read by nothing
    (tmp_path / "r2" / TAG / "loop").symlink_to("loop")
    code, out, _ = run_cli("verify", tmp_path / "r2", "--json")
    report = json.loads(out)
    assert code == 0 and [f["rule"] for f in report["findings"] if f["key"] == "loop"] == ["ckpt.link.nowhere"]
    assert run_cli("reshard", tmp_path / "r2", "--world-size", "1", "-o", tmp_path / "r2_1")[0] == 0


def test_write_manifest_of_a_folder_that_is_no_checkpoint_says_so(tmp_path, run_cli, zero2):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("hi")
    code, out, err = run_cli("verify", tmp_path / "notes", "--write-manifest")
    assert code == 2 and "manifest already" not in err
    assert f"--write-manifest: {tmp_path / 'notes'} is no checkpoint shardkit reads (" in err
    assert "so no manifest was written" in err and not (tmp_path / "notes" / MANIFEST).exists()

    sealed = tmp_path / "sealed"
    assert run_cli("reshard", zero2, "--world-size", "2", "-o", sealed)[0] == 0
    code, out, err = run_cli("verify", sealed, "--write-manifest")
    assert code == 2 and f"--write-manifest: {sealed / TAG}/{MANIFEST} exists already" in err
