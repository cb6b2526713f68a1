"""A damaged DCP save without a manifest (nothing to compare digests with) ends every reading command in
exit 1 naming the damaged file, never a traceback: a ``.metadata`` whose pickle FRAME length is
damaged (the unpickler allocates it: MemoryError, or OverflowError past the maximum size) and a ``.distcp``
item whose bytes are zeroed (torch.load's UnpicklingError inside DCP's CheckpointException, a
BaseException). Both were found by byte-flip sweeps of the real FSDP2 save these copies come from.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from tests import _hostile_sweep as H

# every case copies the session's 2-rank FSDP2 save (built in the first one)
pytestmark = pytest.mark.slow

MANIFEST = "shardkit_manifest.json"
STEP_ITEM = "optim.state.lm_head.weight.step"  # a 0-d tensor item: read through torch.load, not byte ranges


def _plain_copy(sweep_sources: Any, tmp_path: Path) -> Path:
    """A copy of the real 2-rank FSDP2 save with its manifest removed: only the structure can be checked."""
    src = sweep_sources.copy("fsdp2", tmp_path)
    (src / "step2" / MANIFEST).unlink()
    return src


def _frame_length(src: Path, length: int) -> Path:
    """Set the pickle FRAME length of ``.metadata`` (protocol 4: PROTO 4, FRAME, 8-byte length)."""
    meta = src / "step2" / ".metadata"
    raw = meta.read_bytes()
    assert raw[:3] == b"\x80\x04\x95", raw[:12]
    meta.write_bytes(raw[:3] + struct.pack("<Q", length) + raw[11:])
    return meta


def _zero_item(src: Path, key: str) -> Path:
    """Zero the bytes ``.metadata`` places item ``key`` at; returns its ``.distcp`` file."""
    from shardkit.checkpoint.dcp.plain_metadata import read_plain_metadata

    tag = src / "step2"
    info = next(i for (k, _), i in read_plain_metadata(tag / ".metadata").storage.items() if k == key)
    f = tag / info.relative_path
    data = bytearray(f.read_bytes())
    data[info.offset:info.offset + info.length] = bytes(info.length)
    f.write_bytes(bytes(data))
    return f


def _argv(sweep_sources: Any, command: str, src: Path, out: Path) -> list[Any]:
    if command == "export":
        return ["export", src, "-o", out, "--model-config", sweep_sources.root("model_config")]
    if command == "consolidate":
        return ["consolidate", src, "-o", out]
    return ["convert", src, "--to", "zero3", "--world-size", "2", "--ds-config", sweep_sources.root("ds_config"),
            "-o", out]


COMMANDS = ("export", "convert --to zero3", "consolidate")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("length, error", [(2**40, "MemoryError"), (2**64 - 1, "OverflowError")])
def test_a_metadata_with_a_damaged_length_field_is_named(sweep_sources, tmp_path, command, length, error):
    meta = _frame_length(_plain_copy(sweep_sources, tmp_path), length)
    out = tmp_path / "out"
    done = H.run_cli(_argv(sweep_sources, command, meta.parent.parent, out), timeout=120)
    assert done.code == 1 and "Traceback" not in done.err, done.err
    assert f"{meta}: cannot be read as DCP metadata ({error}: a damaged length or nesting field" in done.err, done.err
    assert not out.exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_a_zeroed_distcp_item_is_named_with_its_bytes(sweep_sources, tmp_path, command):
    src = _plain_copy(sweep_sources, tmp_path)
    damaged = _zero_item(src, STEP_ITEM)
    out = tmp_path / "out"
    done = H.run_cli(_argv(sweep_sources, command, src, out), timeout=120)
    assert done.code == 1 and "Traceback" not in done.err, done.err
    assert f"{damaged}: rank 0: torch's DCP load failed on the item at bytes " in done.err, done.err
    assert "(UnpicklingError: Unsupported operand 0)" in done.err and "Re-copy the checkpoint" in done.err, done.err
    assert not out.exists()


def test_verify_names_the_same_zeroed_item(sweep_sources, tmp_path):
    """verify reports the reader's own words (its guard for DCP's CheckpointException is gone)."""
    src = _plain_copy(sweep_sources, tmp_path)
    damaged = _zero_item(src, STEP_ITEM)
    done = H.run_cli(["verify", src, "--json"], timeout=120)
    assert done.code == 1 and "Traceback" not in done.out + done.err, done.out + done.err
    messages = [f["message"] for f in json.loads(done.out)["findings"] if f["severity"] == "error"]
    assert any(m.startswith(f"{damaged}: rank 0: torch's DCP load failed on the item at bytes") for m in messages), messages

