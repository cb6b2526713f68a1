"""The claim on an output's staging folder (shardkit/storage/shared_save.py): a fresh folder
without an owner file is another run's claim under way, refused by name; an old one is a killed
save's leftover, removed and claimed; a failure after the claim removes this run's claim only."""

from __future__ import annotations

import json
import os
import time

import pytest

from shardkit.core.errors import CheckpointError
from shardkit.storage.atomic import staging_dir
from shardkit.storage.shared_save import CLAIM_GRACE_S, OWNER_NAME, Launch, claim, remove_own_claim

LAUNCH = Launch(0, 1, "job-a", "single process", "host")


def test_a_fresh_staging_folder_without_an_owner_is_a_claim_under_way(tmp_path):
    staged = staging_dir(tmp_path, "step1")
    staged.mkdir()
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'step1'}: another shardkit run \(a run claiming it right now "
                                              rf"\({OWNER_NAME} not written yet\)\) is writing this output right now .*"
                                              rf"remove {staged}"):
        claim(tmp_path, "step1", LAUNCH)
    assert staged.is_dir()  # never removed under the other claimer


def test_an_old_staging_folder_without_an_owner_is_a_leftover_and_is_claimed(tmp_path):
    staged = staging_dir(tmp_path, "step1")
    staged.mkdir()
    (staged / "half.pt").write_bytes(b"x")
    old = time.time() - CLAIM_GRACE_S - 5
    os.utime(staged, (old, old))
    assert claim(tmp_path, "step1", LAUNCH) == staged
    assert sorted(p.name for p in staged.iterdir()) == [OWNER_NAME]
    assert json.loads((staged / OWNER_NAME).read_text())["job"] == "job-a"


def test_only_this_runs_claim_is_removed(tmp_path):
    staged = claim(tmp_path, "step1", LAUNCH)
    remove_own_claim(staged, Launch(0, 1, "job-b", "single process", "host"))
    assert staged.is_dir()  # another job's claim: left alone
    remove_own_claim(staged, LAUNCH)
    assert not staged.exists()


def test_the_output_check_looks_again_when_another_writer_publishes_while_it_looks(tmp_path, monkeypatch):
    """Two converts into one -o: the loser lists the folder while the winner's staging folder is
    still there, and the winner renames it to its tag right after. The check looks again and sees
    a shardkit checkpoint folder (and, for the same tag, names it), instead of calling the folder
    'not a shardkit checkpoint folder' because the entry it listed vanished."""
    from pathlib import Path

    from shardkit.core.errors import UsageError
    from shardkit.storage.manifest import MANIFEST_NAME
    from shardkit.storage.pipeline import check_output_root
    from shardkit.storage.tags import STAGING_PREFIX

    source = tmp_path / "src" / "step1"
    source.mkdir(parents=True)
    root = tmp_path / "out"

    def racing(tag: str) -> None:
        staged = root / f"{STAGING_PREFIX}B"
        staged.mkdir(parents=True)
        (staged / MANIFEST_NAME).write_text("{}")
        real, published = Path.iterdir, []

        def iterdir(self: Path):
            listed = list(real(self))
            if self == root and not published:
                published.append(True)
                staged.rename(root / "B")  # the winner publishes right after this listing
            return iter(listed)

        with monkeypatch.context() as m:
            m.setattr(Path, "iterdir", iterdir)
            check_output_root(root, tag, source)
        assert published

    racing("A")  # another tag beside the winner's: accepted
    for p in sorted(root.iterdir(), reverse=True):
        (p / MANIFEST_NAME).unlink()
        p.rmdir()
    with pytest.raises(UsageError, match=r"out: already holds checkpoint 'B' .*; pass --force to replace it"):
        racing("B")  # the same tag: the winner's checkpoint is named, not 'not a checkpoint folder'
