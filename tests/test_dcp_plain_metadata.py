"""The torch-free DCP ``.metadata`` reader (``dcp.plain_metadata``): every field equal to what
torch's own reader rebuilds from real ``dcp.save`` output, and hostile, truncated or foreign files
refused by name with nothing run."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkit.checkpoint.dcp.plain_metadata import DcpMetadata, read_plain_metadata
from shardkit.core.errors import CheckpointError


def assert_same_as_torch(path: Path) -> DcpMetadata:
    """``read_plain_metadata(path)`` holds every field torch's reader does (dtype, size, chunks,
    planner paths, each item's file, offset and length); returns it."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    from shardkit.checkpoint.dcp.safe_load import read_dcp_metadata

    ours, real = read_plain_metadata(path), read_dcp_metadata(path)
    assert list(ours.keys) == list(real.state_dict_metadata)
    for key, meta in real.state_dict_metadata.items():
        if isinstance(meta, BytesStorageMetadata):
            assert key in ours.values and key not in ours.tensors
            continue
        assert isinstance(meta, TensorStorageMetadata)
        got = ours.tensors[key]
        assert got.dtype == str(meta.properties.dtype).removeprefix("torch.") and got.size == tuple(meta.size), key
        assert [(c.offsets, c.sizes) for c in got.chunks] == [(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks]
    assert ours.planner_data == {k: tuple(v) for k, v in real.planner_data.items()}
    assert len(ours.storage) == len(real.storage_data)
    for index, info in real.storage_data.items():
        got_info = ours.storage_info(index.fqn, None if index.offset is None else tuple(index.offset))
        assert got_info is not None, index
        assert (got_info.relative_path, got_info.offset, got_info.length) == (info.relative_path, info.offset, info.length)
        assert got_info.transformed == bool(getattr(info, "transform_descriptors", None))
    return ours


def _save(tmp_path: Path, state: dict[str, Any]) -> Path:
    import torch.distributed.checkpoint as dcp

    d = tmp_path / "dcp"
    dcp.save(state, checkpoint_id=str(d), no_dist=True)
    return d


def test_every_field_equals_torchs_reader(tmp_path):
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b16": torch.ones(5, dtype=torch.bfloat16),
                       "count": torch.tensor(7, dtype=torch.int64), "mask": torch.tensor([True, False])},
             "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.zeros(3, 4)}},
                       "param_groups": [{"lr": 0.25, "betas": (0.9, 0.99), "params": ["w"], "foreach": None}]}}
    md = assert_same_as_torch(_save(tmp_path, state) / ".metadata")
    assert md.tensors["model.count"].dtype == "int64" and md.tensors["optim.state.w.step"].size == ()
    assert "optim.param_groups.0.lr" in md.values


def test_reading_it_imports_no_torch(tmp_path):
    d = _save(tmp_path, {"w": torch.arange(6.0), "lr": 0.25})
    code = ("import sys; from shardkit.checkpoint.dcp.slices import DcpSlices; "
            f"s = DcpSlices(__import__('pathlib').Path({str(d)!r})); "
            "print(sorted(s.md.tensors), s.value('lr'), [m for m in sys.modules if m.split('.')[0] == 'torch'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["['w']", "(True,", "0.25)", "[]"]


class _MakesMarker:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def test_a_poisoned_metadata_is_refused_by_name_and_nothing_runs(tmp_path):
    d = _save(tmp_path, {"w": torch.arange(6.0)})
    marker = tmp_path / "ran"
    (d / ".metadata").write_bytes(pickle.dumps(_MakesMarker(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata: refused to load: the DCP metadata pickle asks for global "
                                              r"builtins\.exec, which real torch.distributed.checkpoint metadata never"):
        read_plain_metadata(d / ".metadata")
    assert not marker.exists()


@pytest.mark.parametrize("reader", ["plain", "torch"])
def test_truncated_foreign_and_missing_files_are_named(tmp_path, reader):
    """Both readers (torch-free, and the one dcp.load uses) name the file, what is wrong and the fix."""
    from shardkit.checkpoint.dcp.safe_load import read_dcp_metadata

    read = read_plain_metadata if reader == "plain" else read_dcp_metadata
    d = _save(tmp_path, {"w": torch.arange(6.0)})
    data = (d / ".metadata").read_bytes()
    (d / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"\.metadata: cannot be read as DCP metadata \(.*\); the file is truncated "
                                              r"or corrupted\. Resume from another checkpoint"):
        read(d / ".metadata")
    (d / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(CheckpointError, match=r"holds a dict, not torch.distributed.checkpoint Metadata; not a DCP "
                                              r"checkpoint\. Pass the folder save_fsdp_checkpoint \(or dcp.save\) wrote"):
        read(d / ".metadata")
    with pytest.raises(CheckpointError, match=r"nothing/\.metadata: missing; a DCP checkpoint directory needs its "
                                              r"\.metadata file \(the save did not complete\)\. Resume from another"):
        read(tmp_path / "nothing" / ".metadata")
