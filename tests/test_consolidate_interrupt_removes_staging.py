"""A consolidate interrupted while it removes its staging folder still removes it: the output published
before the interrupt stays, and nothing else is left beside it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def test_an_interrupt_while_consolidate_removes_its_staging_folder_still_removes_it(tmp_path, monkeypatch):
    """After the rename, process 0 removes the staging folder; rmtree may take the owner file (that the
    clean-up looks for) before a Ctrl-C lands: the folder must still go."""
    import shutil
    import types

    from shardkit.checkpoint.ops import consolidate_shared
    from shardkit.storage.atomic import staging_dir
    from shardkit.storage.request import RunRequest
    from shardkit.storage.shared_save import OWNER_NAME, Launch

    calls = []

    def rmtree_interrupted_after_the_owner_file(path, ignore_errors=False):
        calls.append(Path(path))
        if len(calls) == 1:  # the rmtree after the rename: the owner file goes first, then the interrupt
            (Path(path) / OWNER_NAME).unlink()
            raise KeyboardInterrupt
        shutil.rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(consolidate_shared, "shutil", types.SimpleNamespace(rmtree=rmtree_interrupted_after_the_owner_file))
    out = tmp_path / "model.safetensors"
    request = RunRequest("consolidate", str(tmp_path / "src"), str(out), None, {})
    with pytest.raises(KeyboardInterrupt):
        consolidate_shared.write_shared(out, Launch(0, 1, "job-interrupted", "single process", "host"), request,
                                        lambda fd: os.pwrite(fd, b"header", 0), lambda fd: None, [], 1, "nothing kept")
    assert out.read_bytes() == b"header"  # published before the interrupt
    assert calls and not staging_dir(tmp_path, out.name).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
