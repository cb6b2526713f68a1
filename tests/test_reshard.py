"""`shardkit reshard` offline: new partitions hold bit-identical fp32 masters and moments, the
round trip 2 -> 3 -> 2 gives back the original flat tensors, sub-groups follow DeepSpeed's rule.
Loading the output with DeepSpeed's plain load_checkpoint is covered in test_zero3_resume."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from shardkit.checkpoint.ops.reshard import reshard_checkpoint
from shardkit.checkpoint.readers.zero3_open import open_zero3_layout
from shardkit.checkpoint.zero3.repartition import layout_from_names, plan_layout
from shardkit.core.errors import CheckpointError, UsageError
from shardkit.storage.torch_load import safe_torch_load
from tests import _ranks_zero3 as R
from tests._zero3_gather import gathered, read_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    return R.build_sources(tmp_path_factory.getbasetemp() / "zero3")


def _flats(tag_dir: Path) -> list[dict]:
    out = []
    for f in sorted(tag_dir.glob("*optim_states.pt"), key=lambda p: int(p.name.split("rank_")[1].split("_")[0])):
        osd = torch.load(f, weights_only=False)["optimizer_state_dict"]
        out.append(osd)
    return out


@pytest.mark.parametrize("label", ["fp32", "bf16_offload"])
def test_round_trip_2_to_3_to_2_is_bit_exact(sources, tmp_path, run_cli, label):
    src = open_zero3_layout(sources[label])
    code, out, err = run_cli("reshard", sources[label], "--world-size", "3", "-o", tmp_path / "ws3")
    assert code == 0, err
    assert "world size 2 -> 3" in out and "engine.load_checkpoint(" in out
    code, _, err = run_cli("reshard", tmp_path / "ws3", "--world-size", "2", "-o", tmp_path / "ws2")
    assert code == 0, err
    before, after = _flats(src.tag_dir), _flats(tmp_path / "ws2" / src.tag)
    for a, b in zip(before, after):
        assert a["partition_count"] == b["partition_count"] == 2
        for x, y in zip(a["fp32_flat_groups"], b["fp32_flat_groups"]):
            assert torch.equal(x, y)
        sa, sb = a["optimizer_state_dict"]["state"], b["optimizer_state_dict"]["state"]
        assert sa.keys() == sb.keys()
        for i in sa:
            assert sa[i]["step"] == sb[i]["step"]
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(sa[i][key], sb[i][key])
        assert a["optimizer_state_dict"]["param_groups"] == b["optimizer_state_dict"]["param_groups"]


@pytest.mark.parametrize("world", [1, 3, 5])
def test_every_parameter_and_moment_survives(sources, tmp_path, world):
    src = open_zero3_layout(sources["fp32"])
    result = reshard_checkpoint(sources["fp32"], tmp_path / "out", world)
    new = open_zero3_layout(result.output)
    assert new.world_size == world and len(result.files) == 2 * world
    src_model, new_model = read_model(sources["fp32"]), read_model(result.output)
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        for a, b in zip(src.slots, new.slots):
            assert a.name == b.name
            assert torch.equal(gathered(src_model, a.name, key), gathered(new_model, b.name, key)), (key, a.name)
    # the last rank's tail of every odd-sized parameter is zero padding, like DeepSpeed's own
    last = _flats(new.tag_dir)[-1]
    padded = 0
    for slot in new.slots:
        lo, hi = slot.rank_range(world - 1)
        for flat in (last["fp32_flat_groups"][slot.sub_group], last["optimizer_state_dict"]["state"][slot.sub_group]["exp_avg"]):
            pad = flat[slot.offset + (hi - lo) : slot.offset + slot.partition_numel]
            padded += pad.numel()
            assert not pad.any(), slot.name
    assert padded > 0 or world == 1


def test_sub_groups_follow_deepspeed_rule(sources, tmp_path):
    src = open_zero3_layout(sources["bf16_offload"])  # sub_group_size 30000 in its config
    layout = plan_layout(src, 3)
    sizes = [layout.sub_group_numel(j) for j in range(len(layout.sub_groups))]
    # DeepSpeed closes a sub-group once its partition numel reaches sub_group_size
    assert all(s >= 30_000 for s in sizes[:-1]) and sum(sizes) == sum(
        -(-s.numel // 3) for s in src.slots
    )
    one = plan_layout(src, 3, sub_group_size=10**9)
    assert len(one.sub_groups) == 1
    result = reshard_checkpoint(sources["bf16_offload"], tmp_path / "o", 3, sub_group_size=10**9)
    assert len(open_zero3_layout(result.output).sub_group_numel) == 1


def test_output_is_safe_loadable_with_manifest_and_latest(sources, tmp_path, run_cli):
    result = reshard_checkpoint(sources["fp32"], tmp_path / "out", 3, tag="resharded")
    assert (tmp_path / "out" / "latest").read_text() == "resharded"
    for f in result.files:
        safe_torch_load(f, real_deepspeed_objects=True)
    model1 = safe_torch_load(result.output / "resharded" / "zero_pp_rank_1_mp_rank_00_model_states.pt")
    assert model1["dp_world_size"] == 3 and model1["global_steps"] == R.SAVE_STEPS
    assert result.manifest is not None and result.manifest.exists()
    code, out, err = run_cli("verify", tmp_path / "out")
    assert code == 0, out + err
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".shardkit-tmp-")]


def test_refuses_to_overwrite_its_source_and_bad_world_size(sources, run_cli):
    code, _, err = run_cli("reshard", sources["fp32"], "--world-size", "3", "-o", sources["fp32"])
    assert code == 2 and "holds the checkpoint being read" in err and "--tag NEW_TAG" not in err
    code, _, err = run_cli("reshard", sources["fp32"], "--world-size", "0", "-o", "/tmp/x")
    assert code == 2 and "--world-size 0: must be at least 1" in err


def test_cli_flags_are_stable(run_cli):
    code, out, _ = run_cli("reshard", "--help")
    assert code == 0
    for flag in ("--world-size", "-o", "--output", "--tag", "--sub-group-size", "--no-manifest", "--workers", "example:"):
        assert flag in out
    code, out, _ = run_cli("consolidate", "--help")
    for flag in ("-o", "--output", "--dtype", "--exclude-frozen", "example:"):
        assert flag in out


def test_a_different_model_is_named_before_any_tensor_is_touched(sources):
    """The in-process loader builds its layout from the live engine's parameter names."""
    src = open_zero3_layout(sources["fp32"])
    names = [s.name for s in src.slots]
    ok = layout_from_names(src, 3, [names], [0])
    assert ok.sub_group_numel(0) == sum(-(-s.numel // 3) for s in src.slots)
    with pytest.raises(CheckpointError, match=r"not in the checkpoint \['lm_head.extra'\].*but not trained by this engine \['lm_head.weight'\]"):
        layout_from_names(src, 3, [[*names[:-1], "lm_head.extra"]], [0])


def test_refuses_to_write_into_the_source_root_under_another_tag(sources, run_cli):
    before = (Path(sources["fp32"]) / "latest").read_text()
    code, _, err = run_cli("reshard", sources["fp32"], "--world-size", "3", "-o", sources["fp32"], "--tag", "ws3")
    assert code == 2 and "holds the checkpoint being read" in err and "'latest' would point at the new tag" in err
    assert (Path(sources["fp32"]) / "latest").read_text() == before and not (Path(sources["fp32"]) / "ws3").exists()


def test_saved_sub_group_size_auto_means_deepspeed_default(sources):
    ckpt = open_zero3_layout(sources["fp32"])
    default = plan_layout(ckpt, 3)
    ckpt.ds_config.setdefault("zero_optimization", {})["sub_group_size"] = "auto"
    with pytest.warns(UserWarning, match=r"sub_group_size is 'auto', which DeepSpeed treats as its default 1e\+09"):
        auto = plan_layout(ckpt, 3)
    assert [[tp.source.name for tp in g] for g in auto.sub_groups] == \
        [[tp.source.name for tp in g] for g in default.sub_groups]
    ckpt.ds_config["zero_optimization"]["sub_group_size"] = "big"
    with pytest.raises(UsageError, match=r"sub_group_size is 'big', not a positive integer; pass the resuming "
                       r"run's value with --sub-group-size N"):
        plan_layout(ckpt, 3)


def test_each_rank_keeps_its_own_client_state_at_the_same_world_size(sources, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(sources["fp32"], src)
    tag_dir = src / (src / "latest").read_text().strip()
    for r in range(2):
        f = tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
        sd = torch.load(f, weights_only=False)
        sd["data_position"] = 100 + r  # per-rank client_state (a data-loader offset)
        torch.save(sd, f)
    same = reshard_checkpoint(src, tmp_path / "ws2", 2)
    got = [safe_torch_load(same.output / same.tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")["data_position"]
           for r in range(2)]
    assert got == [100, 101] and same.notes == []
    other = reshard_checkpoint(src, tmp_path / "ws3", 3)
    assert len(other.notes) == 1 and re.search(r"client_state \['data_position'\] comes from rank 0's file", other.notes[0])


def test_same_world_size_and_sub_groups_copy_the_rank_files_byte_for_byte(sources, tmp_path):
    """Nothing changes, so nothing is rebuilt: fresh copies (never links: a run re-saving the
    source tag rewrites its files in place), hashed while copied."""
    from shardkit.storage.manifest import file_digest, read_manifest

    src = open_zero3_layout(sources["fp32"])
    same = reshard_checkpoint(sources["fp32"], tmp_path / "ws2", 2, workers=3)
    assert same.copied_unchanged and read_manifest(same.output / same.tag).extra["resharded_from"]["copied_unchanged"]
    entries = {e.path: e for e in read_manifest(same.output / same.tag).files}
    for f in [*src.optim_files, *src.model_files]:
        copy = same.output / same.tag / f.name
        assert copy.read_bytes() == f.read_bytes() and copy.stat().st_ino != f.stat().st_ino and f.stat().st_nlink == 1
        assert entries[f.name].digest == file_digest(f, "blake3") and entries[f.name].size == f.stat().st_size
    # another sub_group_size at the same world size is a real repartition
    other = reshard_checkpoint(sources["bf16_offload"], tmp_path / "sg", 2, sub_group_size=10**9, workers=1)
    assert not other.copied_unchanged and len(open_zero3_layout(other.output).sub_group_numel) == 1


def test_default_workers_follow_the_cores_and_the_files():
    from shardkit.storage.pipeline import default_workers

    assert default_workers(1) == 1 and default_workers(3) == 3  # one per rank file, even on 2 cores
    assert default_workers(100) == max(8, len(os.sched_getaffinity(0)))
    with pytest.raises(UsageError, match=r"workers=0: must be at least 1"):
        reshard_checkpoint("/nonexistent", "/tmp/x", 2, workers=0)


def test_reshard_imports_no_torch_and_writes_what_the_in_process_resume_builds(sources, tmp_path):
    """The offline reshard parses the source with the torch-free reader and copies byte ranges: no
    torch (seconds to import) in its process. Its files hold exactly the tensors the in-process
    resume builds with torch (resume_zero3_state.optim_state_for_rank), element for element."""
    import subprocess
    import sys

    from shardkit.checkpoint.ops.resume_zero3_state import optim_state_for_rank

    out = tmp_path / "ws3"
    code = (f"import sys; from shardkit.checkpoint.ops.reshard import reshard_checkpoint; "
            f"reshard_checkpoint({str(sources['bf16_offload'])!r}, {str(out)!r}, 3, warn=lambda m: None); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'numpy')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    ckpt = open_zero3_layout(sources["bf16_offload"])
    layout, model = plan_layout(ckpt, 3), read_model(sources["bf16_offload"])
    for r in range(3):
        want = optim_state_for_rank(ckpt, model, layout, r)["optimizer_state_dict"]
        got = safe_torch_load(next((out / ckpt.tag).glob(f"*zero_pp_rank_{r}_mp_rank_00_optim_states.pt")))["optimizer_state_dict"]
        assert all(torch.equal(a, b) for a, b in zip(want["fp32_flat_groups"], got["fp32_flat_groups"]))
        for j, entry in want["optimizer_state_dict"]["state"].items():
            for k, v in entry.items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(got["optimizer_state_dict"]["state"][j][k])), (r, j, k)


def test_a_source_rewritten_after_verification_is_not_copied_under_a_new_manifest(sources, tmp_path, monkeypatch):
    """Same layout: the rank files are copied byte for byte and hashed as copied. A file changed
    between verification and copy (a run re-saving the tag) no longer matches the manifest it was
    verified against: refused, naming the file and both digests, and nothing is left behind."""
    import shutil

    import shardkit.storage.pipeline as pipeline
    from shardkit.storage.manifest import file_digest, read_manifest, seal
    from tests._corrupt import flip_a_byte

    root = tmp_path / "src"
    shutil.copytree(sources["fp32"], root)
    tag_dir = open_zero3_layout(root).tag_dir
    # sealed with sha256 (a manifest of a shardkit before blake3): the copy hashes with the source's algorithm
    monkeypatch.setenv("SHARDKIT_HASH", "sha256")
    seal(tag_dir, engine="deepspeed", world_size=2, zero_stage=3)
    monkeypatch.delenv("SHARDKIT_HASH")
    victim = tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    verified = {e.path: e.sha256 for e in read_manifest(tag_dir).files}[victim.name]
    assert verified is not None
    real_verify = pipeline.verify_before_reading

    def verify_then_the_source_changes(*args, **kwargs):
        checked = real_verify(*args, **kwargs)
        flip_a_byte(victim)
        return checked

    monkeypatch.setattr(pipeline, "verify_before_reading", verify_then_the_source_changes)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(victim))}: its sha256 is ([0-9a-f]{{64}}), its "
                       rf"manifest says {verified}: the file is corrupted, or was rewritten after the save.*Nothing "
                       r"was written.*re-run the reshard") as caught:
        reshard_checkpoint(root, out, 2, workers=2)
    assert f"sha256 is {file_digest(victim, 'sha256')}," in str(caught.value)
    assert not out.exists() or os.listdir(out) == []
    # --no-verify never hashed the source, so there is nothing to compare with: copied as it is now
    monkeypatch.setattr(pipeline, "verify_before_reading", real_verify)
    done = reshard_checkpoint(root, tmp_path / "unverified", 2, verify=False)
    assert done.copied_unchanged and (done.output / done.tag / victim.name).read_bytes() == victim.read_bytes()
