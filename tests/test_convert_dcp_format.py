"""The DCP files ``convert --to fsdp2`` writes without torch (``convert.dcp_format``), against what
torch itself writes for the same state: each item's zip holds the records ``torch.save`` writes into
a stream, the ``.metadata`` unpickles (plain pickle and shardkit's restricted reader) to what
``dcp.save`` records, and ``dcp.load`` reads every tensor and value back bit for bit. One process,
no DeepSpeed: the end-to-end conversions are in tests/test_convert_zero3_to_fsdp.py."""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from shardkit.checkpoint.dcp.safe_load import read_dcp_metadata
from shardkit.checkpoint.readers.deepspeed_scalars import step_value
from shardkit.checkpoint.writers.dcp_format import (
    Stored,
    TensorItem,
    ValueItem,
    append_item,
    is_plain,
    metadata_pickle,
    write_tensor_file,
)
from shardkit.core.errors import CheckpointError
from shardkit.storage.torch_load import TensorRef
from shardkit.storage.torch_zip import Segment, SegmentedRecord

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64, "bool": torch.bool}


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(3, 5, generator=g), "e.weight": torch.randn(4, generator=g).to(torch.bfloat16),
                  "bn.num_batches_tracked": torch.tensor(7), "mask": torch.tensor([True, False])},
        "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 5, generator=g)}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "foreach": None, "amsgrad": False,
                                    "params": ["w"]}]},
    }


def _items(state: dict, tmp_path: Path) -> tuple[list[TensorItem], list[ValueItem]]:
    """The state as items; the big tensor ``w`` as a byte range of a file (as the converter copies)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, paths = flatten_state_dict(state)
    tensors, values = [], []
    source = tmp_path / "source.bin"
    counter = _tensor_bytes(flat["model.bn.num_batches_tracked"])
    source.write_bytes(b"x" * 13 + _tensor_bytes(flat["model.w"]) + b"y" * 7 + counter)
    ranges = {  # the big tensor in two ranges (two ranks' pieces), a small one as a range too (a buffer)
        "model.w": SegmentedRecord(60, [Segment(str(source), 13, 40), Segment(str(source), 53, 20)]),
        "model.bn.num_batches_tracked": SegmentedRecord(8, [Segment(str(source), 80, 8)]),
    }
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).removeprefix("torch.")
            data = ranges.get(key) or _tensor_bytes(value)
            tensors.append(TensorItem(key, tuple(paths[key]), dtype, tuple(value.shape), data))
        else:
            values.append(ValueItem(key, tuple(paths[key]), value))
    return tensors, values


def _write(tensors: list[TensorItem], values: list[ValueItem], folder: Path) -> None:
    """The converter's layout: the big tensor in its own file, everything else in __0_0.distcp."""
    folder.mkdir()
    stored = {}
    with open(folder / "__0_0.distcp", "wb") as raw:
        for item in [*[t for t in tensors if t.key != "model.w"], *values]:
            at = raw.tell()
            stored[item.key] = Stored("__0_0.distcp", at, append_item(raw, item))
    big = next(t for t in tensors if t.key == "model.w")
    stored[big.key] = Stored("__0_1.distcp", 0, write_tensor_file(folder / "__0_1.distcp", big).size)
    (folder / ".metadata").write_bytes(metadata_pickle(tensors, values, stored, folder))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_written_files_are_what_dcp_save_writes_and_load_bit_for_bit(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner, _load_state_dict

    state = _state()
    tensors, values = _items(state, tmp_path)
    ours = tmp_path / "ours"
    _write(tensors, values, ours)
    ref = tmp_path / "ref"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(ref)), no_dist=True)

    a, b = read_dcp_metadata(ours / ".metadata"), read_dcp_metadata(ref / ".metadata")
    assert pickle.loads((ours / ".metadata").read_bytes()).planner_data == a.planner_data  # plain pickle too
    assert a.state_dict_metadata == b.state_dict_metadata and a.planner_data == b.planner_data
    assert set(a.storage_data) == set(b.storage_data) and a.version == b.version
    assert type(a.storage_meta) is type(b.storage_meta) and a.storage_meta.checkpoint_id == ours
    # every item's zip has exactly the length of torch's (the same records, the same alignment)
    assert {k.fqn: v.length for k, v in a.storage_data.items()} == {k.fqn: v.length for k, v in b.storage_data.items()}

    got: dict = {}
    _load_state_dict(got, storage_reader=dcp.FileSystemReader(str(ours)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    for key, value in state["model"].items():
        assert got["model"][key].dtype == value.dtype and _tensor_bytes(got["model"][key]) == _tensor_bytes(value), key
    entry = got["optim"]["state"]["w"]
    assert torch.equal(entry["exp_avg"], state["optim"]["state"]["w"]["exp_avg"]) and entry["step"].item() == 3.0
    assert got["optim"]["param_groups"] == state["optim"]["param_groups"]
    # and into a training run's own tensors, through shardkit's restricted reader
    from shardkit.checkpoint.dcp.safe_load import load_dcp_state

    into = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    load_dcp_state(into, ours)
    assert all(torch.equal(into["model"][k], v) for k, v in state["model"].items())


def test_an_item_zip_holds_the_records_torch_save_writes_into_a_stream():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    ref = io.BytesIO()
    torch.save(t, ref)
    ours = io.BytesIO()
    append_item(ours, TensorItem("k", ("k",), "float32", (2, 3), _tensor_bytes(t)))
    za, zb = zipfile.ZipFile(io.BytesIO(ours.getvalue())), zipfile.ZipFile(ref)
    assert za.namelist() == zb.namelist()
    for name in za.namelist():
        if not name.endswith("serialization_id"):  # torch draws part of it at random
            assert za.read(name) == zb.read(name), name
    assert [i.header_offset for i in za.infolist()] == [i.header_offset for i in zb.infolist()]
    assert torch.equal(torch.load(io.BytesIO(ours.getvalue()), weights_only=True), t)


def test_only_plain_values_are_byte_items_and_a_tensor_step_is_read_from_its_bytes(tmp_path):
    assert is_plain([1, 2.5, "a", None, True, (0.9, 0.999)])
    assert not is_plain({"a": 1}) and not is_plain(object()) and not is_plain([1, b"x"])
    assert step_value(4, "sub-group 0") == 4.0 and step_value(2.0, "sub-group 1") == 2.0
    # a tensor step (torch's optimizers keep a float32 one) is read from the file without torch
    path = tmp_path / "step.pt"
    torch.save({"step": torch.tensor(7.0)}, path)
    from shardkit.storage.torch_load import read_structure

    assert step_value(read_structure(path)["step"], "sub-group 0") == 7.0
    with pytest.raises(CheckpointError, match=r"sub-group 1: step is a TensorRef .* not a number or a one-element"):
        step_value(TensorRef("0", "float32", 0, (2,), (1,)), "sub-group 1")
