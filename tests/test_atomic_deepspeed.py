"""A real SIGKILL in the middle of a 2-rank DeepSpeed ZeRO-3 save leaves the previous checkpoint
verifiable and loadable by DeepSpeed's own load_checkpoint, with `latest` unchanged; corrupting that
checkpoint is then refused with a message naming the file, before anything is unpickled."""

import shutil

import pytest

import shardkit.run.spawn.process as spawn
from shardkit.core.errors import CheckpointError
from shardkit.run.spawn.process import run_ranks
from shardkit.storage.verify import check_resumable, verify_checkpoint
from tests import _ranks_ckpt as targets

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def killed_save(tmp_path_factory):
    """Root holding 'step2' (complete) and the remains of a 'step4' save whose rank 1 was SIGKILLed."""
    base = tmp_path_factory.mktemp("killed")
    root, record = base / "root", base / "record"
    record.mkdir()
    mp = pytest.MonkeyPatch()
    mp.setattr(spawn, "FAILURE_GRACE_S", 3.0)  # rank 0 is then stuck in a barrier: do not wait 20 s
    try:
        results = run_ranks(targets.save_then_die_in_second_save, 2, args=(str(root), str(record), 1),
                            timeout=240, backend="gloo", raise_on_error=False)
    finally:
        mp.undo()
    return root, record, results


def test_sigkill_mid_save_leaves_previous_checkpoint_and_latest(killed_save):
    root, record, results = killed_save
    assert results[1].exitcode == -9  # a real SIGKILL, not an exception
    assert (record / "killed_after").read_text() == "zero_pp_rank_1_mp_rank_00_model_states.pt"
    assert (root / "latest").read_text() == "step2"
    assert not (root / "step4").exists()
    # rank 0 sees rank 1 vanish in the save's collective and removes the staging folder it claimed
    # (a leftover of a save killed on every rank is covered in test_atomic: never loaded, noted by verify)
    assert not (root / ".shardkit-tmp-step4").exists()
    rep = verify_checkpoint(root, world_size=2, engine="deepspeed")
    assert rep.ok, rep.to_json()
    assert rep.tag_dir == str(root / "step2") and rep.manifest.step == 2 and rep.manifest.zero_stage == 3
    assert rep.findings == []

    # DeepSpeed's plain load_checkpoint(root) resumes the step-2 state bit for bit, and trains on
    loaded = run_ranks(targets.load_and_fingerprint, 2, args=(str(root),), timeout=240, backend="gloo")
    for r in loaded:
        assert r.value["tag_dir"] == str(root / "step2")
        assert r.value["global_steps"] == 2
        assert r.value["fingerprint"] == (record / f"fingerprint{r.rank}").read_text()


@pytest.mark.parametrize(
    "damage, match",
    [
        ("flip", r"\[zero_pp_rank_0_mp_rank_00_optim_states\.pt\] .*blake3 mismatch"),
        ("truncate", r"\[zero_pp_rank_1_mp_rank_00_optim_states\.pt\] .*bytes on disk, manifest records \d+ "
                     r"\(truncated\)"),
        ("delete", r"\[zero_pp_rank_1_mp_rank_00_model_states\.pt\] .*file listed in the manifest is missing"),
        ("world", r"\[world_size\] checkpoint was saved by 2 ranks, this run has 3"),
    ],
)
def test_damaged_real_checkpoint_is_refused_naming_the_file(killed_save, tmp_path, damage, match):
    src, _, _ = killed_save
    root = tmp_path / "root"
    shutil.copytree(src, root)
    tag = root / "step2"
    world = 2
    if damage == "flip":
        f = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        f.write_bytes(f.read_bytes()[:1000])
    elif damage == "delete":
        (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    else:
        world = 3
    with pytest.raises(CheckpointError, match=match) as info:
        check_resumable(root, world_size=world, engine="deepspeed")
    assert "Traceback" not in str(info.value) and "unpickl" not in str(info.value).lower()


@pytest.mark.parametrize("checkpoint_cfg, match", [
    ({"use_node_local_storage": True}, r"^CheckpointError: checkpoint\.use_node_local_storage is true: .*shares"),
    ({"writer": {"decoupled": True}}, r"^CheckpointError: checkpoint\.writer\.decoupled .*is on: DeepSpeed's "
                                      r"DecoupledCheckpointEngine writes in the background"),
], ids=["node-local", "decoupled"])
def test_writers_that_finish_after_save_returns_are_refused(tmp_path, checkpoint_cfg, match):
    import os
    import re

    root = tmp_path / "root"
    [res] = run_ranks(targets.ds_save_with_checkpoint_config, 1, args=(str(root), checkpoint_cfg), timeout=180,
                      backend="gloo")
    assert re.match(match, res.value), res.value
    assert not root.exists() or os.listdir(root) == []
