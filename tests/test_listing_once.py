"""Each one-shot command lists its source's tag folder once (storage.listing.source_listed_once): before,
consolidate, verify and convert listed a ZeRO-3 tag folder 7 times and reshard 5 (layout refusal, layout
description, resolver, link check, reader, file walk, opener), plus a stat per rank file: at 1,024 ranks
on a shared filesystem each listing of 2,048 rank files is a metadata storm of its own. Counted on real
sources, in-process, by patching os.listdir/os.scandir (tests/_listings.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardkit.storage.listing import list_folder, source_listed_once, walk
from tests._listings import listings_of

pytestmark = pytest.mark.slow


def _tag(root: Path) -> Path:
    return root / (root / "latest").read_text().strip()


@pytest.mark.parametrize(("kind", "command"), [
    ("zero3", "consolidate"), ("zero3", "verify"), ("zero3", "convert --to fsdp2"), ("zero3", "reshard"),
    ("zero3_sealed", "consolidate"), ("zero3_sealed", "verify"), ("zero3_sealed", "convert --to fsdp2"),
    ("zero3_sealed", "reshard"),
    ("fsdp2", "consolidate"), ("fsdp2", "verify"), ("fsdp2", "convert --to zero3"),
    ("zero3", "export"), ("zero3_sealed", "export"), ("fsdp2", "export"),
])
def test_a_command_lists_its_tag_folder_once(sweep_sources, tmp_path, run_cli, kind, command):
    """zero3: DeepSpeed's own save (no manifest: verify's structural check); zero3_sealed: shardkit's (a
    manifest, checked before reading); fsdp2: a DCP save."""
    src = sweep_sources.root(kind)
    argv, _ = sweep_sources.command(command, src, tmp_path)
    with listings_of(_tag(src)) as listed:
        code, out, err = run_cli(*argv)
    assert code == 0, f"{err}{out}"
    assert len(listed) == 1, f"{command} of {kind} listed {_tag(src)} {len(listed)} times: {listed}"


def test_listings_are_shared_only_inside_the_source_and_never_for_the_output(tmp_path):
    src, out = tmp_path / "ckpt", tmp_path / "ckpt" / "out"  # an output inside the source's folder (Trainer output_dir)
    (src / "tag").mkdir(parents=True)
    out.mkdir()
    with listings_of(src / "tag") as tag_listed, listings_of(out) as out_listed, source_listed_once(src, out):
        first = list_folder(src / "tag")
        (src / "tag" / "late").write_text("x")  # the source does not change under a command: the first listing holds
        assert list_folder(src / "tag").names == first.names == ()
        assert list_folder(src / "tag").describes(src / "tag")
        assert list(walk(src / "tag")) == [(str(src / "tag"), [], [])]
        list_folder(out)
        (out / "written").write_text("x")
        assert list_folder(out).names == ("written",)  # what the command writes is listed afresh
    assert len(tag_listed) == 1 and len(out_listed) == 2
    assert list_folder(src / "tag").names == ("late",)  # outside the block: listed afresh


def test_walk_is_os_walk_with_the_top_listed_once(tmp_path):
    top = tmp_path / "t"
    (top / "sub" / "deeper").mkdir(parents=True)
    (top / "f").write_text("x")
    (top / "sub" / "g").write_text("x")
    (top / "sub" / "deeper" / "h").write_text("x")
    os.symlink(top / "sub", top / "link_to_dir")
    os.symlink(top / "f", top / "link_to_file")
    os.symlink(top / "missing", top / "broken")

    def norm(walked):
        return sorted((d, sorted(ds), sorted(fs)) for d, ds, fs in walked)

    with source_listed_once(top):
        assert norm(walk(top)) == norm(os.walk(top))
    assert list(walk(tmp_path / "nothing")) == list(os.walk(tmp_path / "nothing")) == []
