"""The DCP writer (``checkpoint.writers.dcp``) and ``convert --to fsdp2`` from any reader that describes
the optimizer.

Fast: a checkpoint model built by hand (each tensor split over two "rank" files as byte ranges, one
tensor only a loader can read) is written and read back by torch's own DCP reader bit for bit; a
tensor whose pieces miss elements is refused naming it; a source whose reader describes weights only
(a DCP folder) is refused by name with nothing written.

Slow: a real 2-rank DeepSpeed ZeRO-2 save (tied embeddings, a frozen norm, two param groups)
converted by the CLI and loaded by FSDP2 at 1 and 2 ranks: every fp32 master and both Adam moments
bit-equal by parameter name to what DeepSpeed's own API reported at the save, step, groups and
client state carried, and the loss curve continuing the uninterrupted ZeRO-2 run (rel 1e-5: the
engines reduce and round in different orders, as in tests/test_convert_zero3_to_fsdp.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.model.tensors import Piece, SourceTensor
from shardkit.checkpoint.ops.convert.to_dcp import convert_to_dcp
from shardkit.checkpoint.writers.dcp import DcpLayout, dcp_items
from shardkit.checkpoint.writers.dcp_files import source_files, write_dcp
from shardkit.core.errors import CheckpointError
from shardkit.storage.manifest import Manifest
from shardkit.storage.request import RunRequest, source_of
from shardkit.storage.shared_save import launch_from_env
from shardkit.storage.shared_tag import signatures
from shardkit.storage.torch_load import read_structure


def _everything(tag_dir: Path) -> dict:
    """Every item of a DCP checkpoint, read by torch's own reader, by flattened key."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner, _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(str(tag_dir)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)  # our own test output
    return flatten_state_dict(state)[0]


def _split_source(folder: Path, tensors: dict[str, torch.Tensor]) -> dict[str, SourceTensor]:
    """Each tensor's first half in rank0.pt, the rest in rank1.pt (as ZeRO partitions), as pieces."""
    folder.mkdir(parents=True, exist_ok=True)
    halves = [{}, {}]
    for name, t in tensors.items():
        flat = t.reshape(-1)
        cut = flat.numel() // 2
        halves[0][name], halves[1][name] = flat[:cut].clone(), flat[cut:].clone()
    out = {name: SourceTensor(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in tensors.items()}
    for rank, half in enumerate(halves):
        path = folder / f"rank{rank}.pt"
        torch.save(half, path)
        refs = read_structure(path)
        for name, ref in refs.items():
            start = 0 if rank == 0 else tensors[name].numel() // 2
            if ref.numel:
                out[name].pieces.append(Piece(path, ref.file_offset, start, ref.numel))
    return out


def _write(ckpt: TrainingCheckpoint, layout: DcpLayout, root: Path, tag: str = "step3") -> Path:
    items = dcp_items(ckpt, layout)
    facts = Manifest(engine="fsdp2", tag=tag, world_size=1, step=3, extra={"user": {}})
    request = RunRequest("convert --to fsdp2", source_of(ckpt.folder), str(root.resolve()), tag, {})
    write_dcp(root, tag, items, facts, ckpt.folder, {}, signatures(source_files(ckpt)), 2, launch_from_env({}), request)
    return root / tag


def _hand_built(tmp_path: Path) -> tuple[TrainingCheckpoint, DcpLayout, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    values = {"w": torch.randn(5, 3), "b": torch.randn(7).to(torch.bfloat16), "frozen": torch.randn(4),
              "w.exp_avg": torch.randn(5, 3), "w.exp_avg_sq": torch.rand(5, 3),
              "b.exp_avg": torch.randn(7), "b.exp_avg_sq": torch.rand(7)}
    src = _split_source(tmp_path / "src", values)
    buffer = torch.arange(6, dtype=torch.int64)
    weights = {"w": src["w"], "b": src["b"], "frozen": src["frozen"],
               # a tensor only its loader reads (a layout byte ranges cannot describe)
               "buf": SourceTensor("buf", "int64", (6,), load=lambda: buffer.clone())}
    optimizer = {n: {k: src[f"{n}.{k}"] for k in ("exp_avg", "exp_avg_sq")} for n in ("w", "b")}
    ckpt = TrainingCheckpoint("test", tmp_path / "src", weights, world_size=2, frozen={"frozen"}, buffers={"buf"},
                              optimizer=optimizer, optimizer_described=True)
    layout = DcpLayout(fqns={n: f"net.{n}" for n in weights}, aliases={"net.w_tied": "net.w"},
                       groups=[{"lr": 0.1, "betas": (0.9, 0.99), "params": ["net.w", "net.b"]}],
                       steps={"w": 3.0, "b": 3.0})
    return ckpt, layout, {**values, "buf": buffer}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_any_checkpoint_model_is_written_as_dcp_bit_for_bit(tmp_path):
    ckpt, layout, values = _hand_built(tmp_path)
    got = _everything(_write(ckpt, layout, tmp_path / "out"))
    expect = {"model.net.w": values["w"], "model.net.b": values["b"], "model.net.frozen": values["frozen"],
              "model.net.buf": values["buf"], "model.net.w_tied": values["w"]}
    for n in ("w", "b"):
        for k in ("exp_avg", "exp_avg_sq"):
            expect[f"optim.state.net.{n}.{k}"] = values[f"{n}.{k}"]
    for key, value in expect.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert torch.equal(got[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key
    assert float(got["optim.state.net.w.step"]) == 3.0 and got["optim.state.net.w.step"].dtype == torch.float32
    assert got["optim.param_groups.0.lr"] == 0.1 and got["optim.param_groups.0.params"] == ["net.w", "net.b"]
    assert "optim.state.net.frozen.exp_avg" not in got  # frozen: weights only


def test_pieces_that_miss_elements_are_refused_naming_the_tensor(tmp_path):
    ckpt, layout, _ = _hand_built(tmp_path)
    ckpt.optimizer["b"]["exp_avg_sq"].pieces.pop()  # rank 1's piece lost
    with pytest.raises(CheckpointError, match=r"^b.exp_avg_sq \(written as optim.state.net.b.exp_avg_sq\): the source's "
                                              r"pieces do not cover its 7 elements once \(1 piece"):
        dcp_items(ckpt, layout)
    ckpt, layout, _ = _hand_built(tmp_path / "again")
    del ckpt.optimizer["w"]["exp_avg"]
    with pytest.raises(CheckpointError, match=r"parameter 'w' has no exp_avg in the checkpoint's optimizer state"):
        dcp_items(ckpt, layout)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_source_read_without_its_optimizer_is_refused_by_name(tmp_path, monkeypatch):
    """A reader that describes the weights only (optimizer_described False): convert --to fsdp2 would
    start Adam from zero, so it is refused by name before anything is written."""
    import dataclasses

    from shardkit.checkpoint.ops.convert import to_dcp
    from shardkit.checkpoint.ops.export.sources import resolve_source
    from shardkit.checkpoint.readers import registry

    ckpt, layout, _ = _hand_built(tmp_path)
    _write(ckpt, layout, tmp_path / "dcp")
    dcp_reader = registry.READERS["dcp"]

    def read(folder: Path) -> TrainingCheckpoint:
        found = dcp_reader(folder)
        return TrainingCheckpoint("weights-only", folder, found.weights, notes=found.notes)

    # a kind of its own (a DCP source is refused earlier: it is DCP already)
    monkeypatch.setitem(registry.READERS, "weights-only", read)
    monkeypatch.setattr(to_dcp, "resolve_source", lambda p: dataclasses.replace(resolve_source(p), kind="weights-only"))
    with pytest.raises(CheckpointError, match=r"shardkit's weights-only reader describes this checkpoint's weights "
                                              r"only, not its optimizer state.*For the weights alone: shardkit export"):
        convert_to_dcp(tmp_path / "dcp", tmp_path / "out", warn=lambda m: None)
    assert not (tmp_path / "out").exists()


def test_a_dcp_source_is_dcp_already(tmp_path):
    """FSDP2 loads a DCP checkpoint at any world size as it is: convert --to fsdp2 says so (as inspect
    does) and writes nothing, instead of rewriting it."""
    from shardkit.core.errors import UsageError

    ckpt, layout, _ = _hand_built(tmp_path)
    _write(ckpt, layout, tmp_path / "dcp")
    with pytest.raises(UsageError, match=r"is an FSDP2/DCP checkpoint already; FSDP2 loads it at any world size"):
        convert_to_dcp(tmp_path / "dcp", tmp_path / "out", warn=lambda m: None)
    assert not (tmp_path / "out").exists()


# --- ZeRO-2 -> FSDP2 on real engines -------------------------------------------------------------

@pytest.fixture(scope="module")
def zero2(tmp_path_factory):
    from shardkit.run.spawn.process import run_ranks
    from tests import _ranks_dcp_writer as W

    root = tmp_path_factory.mktemp("dcp_writer") / "zero2"
    ref = run_ranks(W.zero2_train_save_continue, 2, args=(str(root), False), timeout=400, device="cpu")[0].value
    return root, ref


@pytest.fixture(scope="module")
def zero2_converted(zero2, tmp_path_factory):
    from shardkit.cli import main

    out = tmp_path_factory.mktemp("dcp_writer_out") / "fsdp"
    assert main(["convert", str(zero2[0]), "--to", "fsdp2", "-o", str(out), "--json"]) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_zero2_converted_and_loaded_by_fsdp2_equals_the_source(zero2, zero2_converted, world):
    from shardkit.run.spawn.process import run_ranks
    from tests import _ranks_convert as C

    got = run_ranks(C.fsdp_resume_continue, world, args=(str(zero2_converted), False), timeout=400,
                    backend="gloo")[0].value
    ref = zero2[1]["state"]
    model, optim = got["state"]["model"], got["state"]["optim"]
    assert ref["fp32"] and ref["steps"] == [float(C.SAVE_STEPS)] * len(ref["steps"])
    for name, master in ref["fp32"].items():
        assert torch.equal(model[name], master), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optim["state"][name][key], ref[key][name]), f"{name}.{key}"
        assert float(optim["state"][name]["step"]) == C.SAVE_STEPS, name
    alias, owner = C.TIED
    assert torch.equal(model[alias], ref["fp32"][owner]) and alias not in optim["state"]
    assert torch.equal(model[C.FROZEN], ref["frozen"][C.FROZEN]) and C.FROZEN not in optim["state"]
    assert got["groups"] == [{**g, "decoupled_weight_decay": True} for g in C.GROUPS]
    assert got["step"] == C.SAVE_STEPS and got["user"] == C.CLIENT_STATE
    assert got["losses"] == pytest.approx(zero2[1]["losses_after"], rel=1e-5)
