"""The ZeRO-3 reader on real 2-rank DeepSpeed checkpoints (fp32, bf16 + offload with several
sub-groups, fp16): gathered fp32 masters equal DeepSpeed's zero_to_fp32, moments equal an
independent concatenation, and broken checkpoints are named precisely."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from shardkit.checkpoint.readers.zero3 import read_zero3
from shardkit.checkpoint.readers.zero3_open import open_zero3_layout
from shardkit.checkpoint.zero3.checkpoint import FP32
from shardkit.core.errors import CheckpointError
from tests import _ranks_zero3 as R
from tests._zero3_gather import gathered

pytestmark = pytest.mark.slow
LABELS = ["fp32", "bf16_offload", "fp16"]


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    return R.build_sources(tmp_path_factory.getbasetemp() / "zero3")


def _independent_gather(tag_dir: Path, key: str) -> dict[str, torch.Tensor]:
    """Moments rebuilt the plain way (full unrestricted torch.load, torch.cat): the test's oracle."""
    model0 = torch.load(tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False)
    world = model0["dp_world_size"]
    optim = sorted(tag_dir.glob("*optim_states.pt"), key=lambda p: int(p.name.split("rank_")[1].split("_")[0]))
    flats = []
    for f in optim:
        osd = torch.load(f, weights_only=False)["optimizer_state_dict"]
        groups = osd["fp32_flat_groups"] if key == FP32 else [osd["optimizer_state_dict"]["state"][i][key] for i in range(len(osd["fp32_flat_groups"]))]
        flats.append(torch.cat([g.reshape(-1) for g in groups]))
    out, offset = {}, 0
    for shapes in model0["param_shapes"]:
        for name, shape in shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            out[name] = torch.cat([fl[offset : offset + part] for fl in flats])[:numel].view(shape)
            offset += part
    return out


@pytest.mark.parametrize("label", LABELS)
def test_fp32_masters_equal_zero_to_fp32(sources, label):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt = open_zero3_layout(sources[label])
    model = read_zero3(ckpt.tag_dir)
    expected = get_fp32_state_dict_from_zero_checkpoint(str(sources[label]))
    assert [s.name for s in ckpt.slots] == list(expected)
    for slot in ckpt.slots:
        assert torch.equal(gathered(model, slot.name), expected[slot.name]), slot.name


@pytest.mark.parametrize("label", LABELS)
def test_adam_moments_equal_an_independent_gather(sources, label):
    ckpt = open_zero3_layout(sources[label])
    model = read_zero3(ckpt.tag_dir)
    assert ckpt.state_keys == ["exp_avg", "exp_avg_sq"]
    for key in ckpt.state_keys:
        expected = _independent_gather(ckpt.tag_dir, key)
        for slot in ckpt.slots:
            got = gathered(model, slot.name, key)
            assert got.dtype == torch.float32 and torch.equal(got, expected[slot.name]), (key, slot.name)


def test_the_reader_describes_every_parameter_in_checkpoint_order(sources):
    ckpt = open_zero3_layout(sources["bf16_offload"])
    model = read_zero3(ckpt.tag_dir)
    moments = _independent_gather(ckpt.tag_dir, "exp_avg")
    trainable = [name for name in model.weights if name not in model.frozen and name not in model.buffers]
    assert trainable == [s.name for s in ckpt.slots]
    for slot in ckpt.slots:
        assert gathered(model, slot.name).shape == slot.shape
        assert torch.equal(gathered(model, slot.name, "exp_avg"), moments[slot.name]), slot.name


def test_layout_facts(sources):
    fp32 = open_zero3_layout(sources["fp32"])
    assert (fp32.world_size, fp32.precision, fp32.tag, len(fp32.sub_group_numel)) == (2, "fp32", "global_step2", 1)
    bf16 = open_zero3_layout(sources["bf16_offload"])
    assert bf16.precision == "bf16" and bf16.optim_files[0].name.startswith("bf16_")
    assert len(bf16.sub_group_numel) >= 2  # sub_group_size 30000 splits the tiny model into several flats
    # every parameter takes ceil(numel / world) per rank, back to back in param_shapes order
    for slot in fp32.slots:
        assert slot.partition_numel == math.ceil(slot.numel / 2)


def test_fp16_layout(sources):
    assert open_zero3_layout(sources["fp16"]).precision == "fp16"


def test_root_tag_folder_and_rank_file_are_the_same_checkpoint(sources):
    root = Path(sources["fp32"])
    a = open_zero3_layout(root)
    b = open_zero3_layout(root / "global_step2")
    c = open_zero3_layout(root / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert a.tag_dir == b.tag_dir == c.tag_dir and a.slots == b.slots == c.slots


@pytest.fixture
def copy_of(sources, tmp_path):
    def _copy(label: str) -> Path:
        dst = tmp_path / label
        shutil.copytree(sources[label], dst)
        return dst

    return _copy


def test_missing_rank_file_is_named(copy_of):
    root = copy_of("fp32")
    victim = root / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"{victim}: missing, but dp_world_size is 2"):
        open_zero3_layout(root)


def test_truncated_rank_file_is_named_when_read(copy_of):
    root = copy_of("bf16_offload")
    victim = root / "global_step1" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:1000])
    ckpt = open_zero3_layout(root)  # rank 0's files are fine
    model = read_zero3(ckpt.tag_dir, lazy=True)
    with pytest.raises(CheckpointError, match=rf"{victim}: cannot be read as a torch checkpoint"):
        gathered(model, ckpt.slots[0].name)


@pytest.mark.parametrize("label", LABELS)
def test_the_readers_windows_hold_the_bytes_of_the_ranks_overlapping_them(sources, label):
    """readers.zero3 stores no piece list: a window of elements gets the pieces of the ranks holding it,
    clipped to it, and their bytes are those elements of the master (and of each Adam moment)."""
    from shardkit.checkpoint.model.tensors import Pieces

    tag_dir = open_zero3_layout(sources[label]).tag_dir
    model = read_zero3(tag_dir, lazy=True)
    masters, moments = _independent_gather(tag_dir, FP32), _independent_gather(tag_dir, "exp_avg")
    for name, expected in [*((n, masters[n]) for n in masters), *((f"{n}.exp_avg", moments[n]) for n in moments)]:
        t = model.weights[name] if name in masters else model.optimizer[name[: -len(".exp_avg")]]["exp_avg"]
        assert isinstance(t.pieces, Pieces) and t.covered()
        flat = expected.reshape(-1)
        for lo, hi in ((0, t.numel), (t.numel // 3, min(t.numel, t.numel // 3 + 5)), (t.numel - 1, t.numel)):
            got, at = [], lo
            for piece in t.pieces_in(lo, hi):
                assert piece.start == at, f"{name}[{lo}:{hi}]: pieces out of order or overlapping"
                with open(piece.file, "rb") as fh:
                    fh.seek(piece.offset)
                    got.append(torch.frombuffer(bytearray(fh.read(piece.numel * flat.element_size())), dtype=flat.dtype))
                at += piece.numel
            assert at == hi and torch.equal(torch.cat(got) if got else flat[:0], flat[lo:hi]), f"{name}[{lo}:{hi}]"


def test_a_lazy_read_names_a_damaged_rank_file_when_its_pieces_are_asked_for(copy_of):
    root = copy_of("fp32")
    victim = root / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=rf"{victim}: cannot be read as a torch checkpoint"):
        read_zero3(root / "global_step2")  # eager (the default): every rank file parsed before anything is written
    model = read_zero3(root / "global_step2", lazy=True)  # rank 0's files alone are read
    t = next(iter(model.weights.values()))
    assert list(t.pieces_in(0, 1))[0].file.name == "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with pytest.raises(CheckpointError, match=rf"{victim}: cannot be read as a torch checkpoint"):
        list(t.pieces_in(0, t.numel))


def test_latest_pointing_nowhere_and_ambiguous_root(copy_of):
    root = copy_of("fp32")
    (root / "latest").write_text("global_step9")
    with pytest.raises(CheckpointError, match=r"latest: points to tag 'global_step9' but .* does not exist"):
        open_zero3_layout(root)
    (root / "latest").unlink()
    with pytest.raises(CheckpointError, match=r"has no 'latest' file.*found tags \['global_step2'\]"):
        open_zero3_layout(root)


def test_not_a_zero3_checkpoint(tmp_path):
    (tmp_path / "mp_rank_00_model_states.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="ZeRO-0/1/2 checkpoint"):
        open_zero3_layout(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        open_zero3_layout(tmp_path / "nothing")


def test_extra_rank_files_from_another_save_are_refused(copy_of):
    root = copy_of("fp32")
    tag = root / "global_step2"
    shutil.copy(tag / "zero_pp_rank_1_mp_rank_00_model_states.pt", tag / "zero_pp_rank_2_mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match=r"rank files beyond dp_world_size=2"):
        open_zero3_layout(root)


def test_the_old_public_name_warns_and_opens_the_same_layout(sources):
    """shardkit.open_zero3_checkpoint stays one release: it warns, naming open_zero3_layout, and returns what that
    returns (its old torch_free keyword is still taken)."""
    import shardkit
    from shardkit.core.deprecated import ShardkitDeprecationWarning

    with pytest.warns(ShardkitDeprecationWarning, match=r"shardkit\.open_zero3_checkpoint is deprecated: use "
                      r"shardkit\.open_zero3_layout \(same behaviour\)"):
        old = shardkit.open_zero3_checkpoint(sources["fp32"], torch_free=False)
    new = shardkit.open_zero3_layout(sources["fp32"])
    assert (old.tag_dir, old.slots, old.state_keys) == (new.tag_dir, new.slots, new.state_keys)
