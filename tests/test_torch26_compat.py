"""torch 2.6 (the oldest pyproject allows) on CPU ranks: what the release verifier's 2.6 run found
beyond the FSDP2 root's reshard_after_forward=None (tests/test_fsdp_config.py). The suite runs torch
2.13, so the installed version is faked through platform.versions.package_version and 2.6's missing
pieces are taken away; the real 2.6 runs are the verifier's rows (docs/versions.md)."""

from __future__ import annotations

import pytest
import torch

import shardkit.engines.fsdp as engine
from shardkit.core.errors import ConfigError
from shardkit.platform import versions


def _torch_is(monkeypatch: pytest.MonkeyPatch, installed: str) -> None:
    monkeypatch.setattr(versions, "package_version", lambda name, **_: installed if name == "torch" else None)


class _BareCpuStream:
    """torch 2.6's torch.cpu.Stream: no record_event, no wait_event."""

    def wait_stream(self, stream: object) -> None:
        pass


def test_torch_2_6_cpu_stream_gets_the_no_op_events_fsdp2_calls(monkeypatch):
    # 2.6's FSDP2 failed its first CPU forward on "'Stream' object has no attribute 'record_event'"
    monkeypatch.setattr(torch.cpu, "Stream", type("Stream", (_BareCpuStream,), {}))
    _torch_is(monkeypatch, "2.13.0+cpu")
    engine.backport_cpu_stream_events()
    assert not hasattr(torch.cpu.Stream(), "record_event")  # 2.7 and later: torch's own, untouched
    _torch_is(monkeypatch, "2.6.0+cu124")
    engine.backport_cpu_stream_events()
    stream = torch.cpu.Stream()
    event = stream.record_event()
    assert event is None  # what torch 2.7+'s CPU stream returns: FSDP2 waits on nothing
    stream.wait_event(event)


def test_torch_2_6_keeps_a_cpu_stream_method_it_already_has(monkeypatch):
    def own(self: object) -> str:
        return "own"

    monkeypatch.setattr(torch.cpu, "Stream", type("Stream", (_BareCpuStream,), {"record_event": own}))
    _torch_is(monkeypatch, "2.6.0")
    engine.backport_cpu_stream_events()
    assert torch.cpu.Stream().record_event() == "own" and hasattr(torch.cpu.Stream, "wait_event")


def test_fsdp2_resharding_on_cpu_ranks_with_torch_2_6_is_refused_with_the_fix(monkeypatch):
    seen: list[object] = []
    monkeypatch.setattr("torch.distributed.fsdp.fully_shard", lambda module, **kw: seen.append(kw["reshard_after_forward"]))
    monkeypatch.setattr(engine, "_has_accelerator", lambda: False)
    _torch_is(monkeypatch, "2.6.0+cu124")
    with pytest.raises(ConfigError, match=r"fsdp\.reshard_after_forward=true on CPU ranks with torch 2\.6\.0\+cu124.*"
                                          r"#132014.*Set fsdp\.reshard_after_forward to false"):
        engine.apply_fsdp(torch.nn.Sequential(torch.nn.Linear(2, 2)), {"fsdp": {"wrap": []}})
    assert seen == []  # refused before torch shards anything
    # false never re-gathers for backward: it runs (bit-exact in the verifier's 2.6 run)
    engine.apply_fsdp(torch.nn.Sequential(torch.nn.Linear(2, 2)), {"fsdp": {"wrap": [], "reshard_after_forward": False}})
    assert seen == [False]
    # on accelerator ranks, and on CPU ranks with later torch, resharding is not refused
    for accelerator, installed in ((True, "2.6.0+cu124"), (False, "2.13.0+cpu")):
        monkeypatch.setattr(engine, "_has_accelerator", lambda: accelerator)
        _torch_is(monkeypatch, installed)
        seen.clear()
        engine.apply_fsdp(torch.nn.Sequential(torch.nn.Linear(2, 2)), {"fsdp": {"wrap": []}})
        assert seen[-1] in (True, None), (accelerator, installed)


def test_dcp_load_reads_the_metadata_with_torch_2_6s_reader(monkeypatch, tmp_path):
    # torch 2.6's FileSystemReader has no _get_metadata_path: the FSDP2 resume failed on it
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from shardkit.checkpoint.dcp.safe_load import load_dcp_state

    saved = {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}}
    dcp.save(saved, checkpoint_id=str(tmp_path), no_dist=True)
    monkeypatch.delattr(FileSystemReader, "_get_metadata_path")
    into = {"model": {"w": torch.zeros(2, 3)}}
    load_dcp_state(into, tmp_path)
    assert torch.equal(into["model"]["w"], saved["model"]["w"])
