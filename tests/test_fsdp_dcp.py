"""FSDP2 sharded checkpoints through torch.distributed.checkpoint on real gloo ranks: saved at 2
ranks, resumed at 2, 1 and 3 (the last with CPU offload switched on, pin_memory=False), model and
optimizer state bit-equal to the saved state, training continuing on the uninterrupted loss curve;
a full safetensors export; the manifest guarding the DCP files."""

import shutil

import pytest
import torch

from shardkit.core.errors import CheckpointError
from shardkit.run.spawn.process import run_ranks
from shardkit.storage.verify import check_resumable
from tests import _ranks_ckpt as targets

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("fsdp")
    root, export = base / "root", base / "model.safetensors"
    ref = run_ranks(targets.fsdp_train_save_continue, 2, args=(str(root), str(export)), timeout=300,
                    backend="gloo")[0].value
    return root, export, ref


def _assert_state_equal(ref, got):
    assert ref["model"].keys() == got["model"].keys()
    for k, v in ref["model"].items():
        assert torch.equal(v, got["model"][k]), k
    rs, gs = ref["optim"]["state"], got["optim"]["state"]
    assert rs.keys() == gs.keys() and len(rs) > 0
    for fqn, st in rs.items():
        for key, v in st.items():
            assert torch.equal(v, gs[fqn][key]), f"{fqn}.{key}"


@pytest.mark.parametrize("world, offload", [(2, False), (1, False), (3, True)], ids=["2->2", "2->1", "2->3+offload"])
def test_resume_at_any_world_size(saved, world, offload):
    root, _, ref = saved
    got = run_ranks(targets.fsdp_resume_continue, world, args=(str(root), offload), timeout=300, backend="gloo")[0].value
    assert got["step"] == 2 and got["user"] == {"epoch": 0, "sample": 12}
    assert got["findings"] == ([] if world == 2 else ["ckpt.world_size.reshard"])
    _assert_state_equal(ref["state"], got["state"])  # resharded bit for bit
    if world == 2:
        assert got["losses"] == ref["losses"]  # same world size: the same run, exactly
    else:
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)  # only reduction order differs


def test_save_is_atomic_and_verified(saved, tmp_path):
    root, _, _ = saved
    assert (root / "latest").read_text() == "step2"
    report = check_resumable(root, world_size=3, engine="fsdp2")
    m = report.manifest
    assert m.engine == "fsdp2" and m.world_size == 2 and m.step == 2 and m.dtype == "float32"
    assert sorted(f.path for f in m.files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert saved[2]["listing"] == ["latest", "step2"]  # no staging directory left behind
    bad = tmp_path / "root"
    shutil.copytree(root, bad)
    f = bad / "step2" / "__1_0.distcp"
    data = bytearray(f.read_bytes())
    data[100] ^= 0x10
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"\[__1_0\.distcp\] .*blake3 mismatch"):
        check_resumable(bad, world_size=2, engine="fsdp2")
    with pytest.raises(CheckpointError, match=r"\[engine\] checkpoint was written by engine 'fsdp2', this run uses "
                       "'deepspeed'"):
        check_resumable(root, engine="deepspeed")


def test_full_state_dict_exported_as_safetensors(saved):
    from safetensors.torch import load_file

    _, export, ref = saved
    tensors = load_file(str(export))
    assert tensors.keys() == ref["state"]["model"].keys()
    for k, v in tensors.items():
        assert torch.equal(v, ref["state"]["model"][k]), k
