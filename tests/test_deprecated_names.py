"""The public names that outgrew their first format keep working one release under their old spelling:
``from shardkit import reshard_zero3`` still imports, each call warns with a ShardkitDeprecationWarning
naming the replacement (pointing at the caller's line), and then does exactly what the new name does.

The old names are left out of ``shardkit.__all__``: ``import *``, the docs and the API reference offer
only the names that say what they do for every layout."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

import pytest

import shardkit
from shardkit.core.deprecated import ShardkitDeprecationWarning, deprecated_alias

RENAMED = {
    "reshard_zero3": "reshard_checkpoint",
    "consolidate_zero3": "consolidate_checkpoint",
    "load_zero3_checkpoint": "load_checkpoint_resharded",
}


def _outcome(call: Callable[[], Any]) -> tuple[str, str]:
    """What a user sees of one call: its refusal (type and message), or that it returned."""
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "returned", ""


def _warned(call: Callable[[], Any]) -> tuple[tuple[str, str], list[warnings.WarningMessage]]:
    with pytest.warns(ShardkitDeprecationWarning) as record:
        got = _outcome(call)
    return got, [w for w in record if issubclass(w.category, ShardkitDeprecationWarning)]


def _says_use(record: list[warnings.WarningMessage], old: str) -> None:
    new = RENAMED[old]
    assert len(record) == 1
    assert str(record[0].message) == (f"shardkit.{old} is deprecated: use shardkit.{new} (same behaviour); "
                                      f"{old} goes in the next release")
    assert record[0].filename == __file__  # the caller's line, the one to change


@pytest.fixture(scope="module")
def dcp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-tensor DCP checkpoint saved in this process (no ranks spawned)."""
    import torch
    import torch.distributed.checkpoint as dcp

    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    state = {"model": {"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b.bias": torch.ones(4)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    return path


def test_old_names_import_but_are_not_offered():
    for old, new in RENAMED.items():
        assert old not in shardkit.__all__ and new in shardkit.__all__
        alias = getattr(shardkit, old)
        assert alias.__wrapped__ is getattr(shardkit, new)  # the same function, not a copy that could drift
        assert alias.__doc__ == getattr(shardkit, new).__doc__
    from shardkit import consolidate_zero3, load_zero3_checkpoint, reshard_zero3  # noqa: F401


def test_consolidate_zero3_warns_and_writes_the_same_file(dcp_checkpoint, tmp_path):
    new = shardkit.consolidate_checkpoint(dcp_checkpoint, tmp_path / "new.safetensors", warn=lambda m: None)
    with pytest.warns(ShardkitDeprecationWarning) as record:
        old = shardkit.consolidate_zero3(dcp_checkpoint, tmp_path / "old.safetensors", warn=lambda m: None)
    _says_use([w for w in record if issubclass(w.category, ShardkitDeprecationWarning)], "consolidate_zero3")
    assert (tmp_path / "old.safetensors").read_bytes() == (tmp_path / "new.safetensors").read_bytes()
    assert (old.tensors, old.parameters, old.bytes) == (new.tensors, new.parameters, new.bytes) == (2, 16, 232)


def test_reshard_zero3_warns_and_refuses_in_the_same_words(dcp_checkpoint, tmp_path):
    new = _outcome(lambda: shardkit.reshard_checkpoint(dcp_checkpoint, tmp_path / "out", 2))
    old, record = _warned(lambda: shardkit.reshard_zero3(dcp_checkpoint, tmp_path / "out", 2))
    _says_use(record, "reshard_zero3")
    assert old == new
    assert new[0] == "CheckpointError" and "a DCP checkpoint needs no reshard" in new[1]
    assert not (tmp_path / "out").exists()


class _Stage0Engine:
    """Just enough of a DeepSpeed engine for the loader to read its ZeRO stage (0: nothing to reshard)."""

    def zero_optimization_stage(self) -> int:
        return 0


def test_load_zero3_checkpoint_warns_and_refuses_in_the_same_words(tmp_path):
    new = _outcome(lambda: shardkit.load_checkpoint_resharded(_Stage0Engine(), tmp_path))
    old, record = _warned(lambda: shardkit.load_zero3_checkpoint(_Stage0Engine(), tmp_path))
    _says_use(record, "load_zero3_checkpoint")
    assert old == new
    assert new[0] == "CheckpointError" and "this engine runs stage 0" in new[1]


def test_the_warning_can_be_made_an_error_without_touching_other_libraries_deprecations():
    alias = deprecated_alias("old_name", "new_name", lambda x: x * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardkitDeprecationWarning)
        with pytest.raises(ShardkitDeprecationWarning, match=r"^shardkit\.old_name is deprecated: use "
                                                             r"shardkit\.new_name \(same behaviour\)"):
            alias(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardkitDeprecationWarning)
        assert alias(21) == 42
    assert issubclass(ShardkitDeprecationWarning, DeprecationWarning)
