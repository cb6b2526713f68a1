"""`shardkit convert --to fsdp2`: a 2-rank DeepSpeed ZeRO-3 run (tied embeddings, a
frozen parameter, two param groups with their own lr/weight_decay) converted to DCP and resumed
under FSDP2 at 1 rank and at 3 ranks with CPU offload, on real gloo ranks.

Right after loading, every fp32 master, both Adam moments and ``step`` equal what DeepSpeed's own
API (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``) reported after the save, bit
for bit. The loss curve then continues the uninterrupted ZeRO-3 run within rel 1e-5: the weights
are identical, but the two engines reduce gradients (and the per-rank loss means) in different
orders and DeepSpeed's fused CPU Adam rounds its update differently from torch's AdamW, so later
steps differ in the last float32 bits (about 3e-7 relative measured here).

One ZeRO-3 spawn and one FSDP2 spawn per world size for the whole module; the refusals work on
copies of the converted source (small files) in-process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shardkit.checkpoint.dcp.safe_load import load_dcp_state
from shardkit.checkpoint.ops.convert.names import build_name_map
from shardkit.checkpoint.ops.convert.to_dcp import convert_to_dcp
from shardkit.core.errors import CheckpointError
from shardkit.run.spawn.process import run_ranks
from tests import _ranks_convert as C
from tests._ports import job_port

pytestmark = pytest.mark.slow

TAG = f"global_step{C.SAVE_STEPS}"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("convert_src") / "zero3"
    ref = run_ranks(C.ds_train_save_continue, 2, args=(str(root),), timeout=400, device="cpu")[0].value
    return root, ref


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("convert_out") / "fsdp"
    warnings: list[str] = []
    result = convert_to_dcp(source[0], out, warn=warnings.append)
    return out, result, warnings


@pytest.fixture(scope="module", params=[(1, False), (3, True)], ids=["ws1", "ws3+offload"])
def resumed(request, converted):
    world, offload = request.param
    got = run_ranks(C.fsdp_resume_continue, world, args=(str(converted[0]), offload), timeout=400,
                    backend="gloo")[0].value
    return world, got


def test_state_equals_the_source_bit_for_bit_after_loading(source, resumed):
    ref = source[1]["state"]
    world, got = resumed
    model, optim = got["state"]["model"], got["state"]["optim"]
    assert ref["fp32"] and ref["steps"] == [float(C.SAVE_STEPS)]
    for name, master in ref["fp32"].items():
        assert torch.equal(model[name], master), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optim["state"][name][key], ref[key][name]), f"{name}.{key}"
        assert float(optim["state"][name]["step"]) == C.SAVE_STEPS, name
    # tied: lm_head reads the embedding's master; it has no optimizer state of its own
    alias, owner = C.TIED
    assert alias not in ref["fp32"] and torch.equal(model[alias], ref["fp32"][owner])
    assert alias not in optim["state"]
    # frozen: its value, no optimizer state
    assert torch.equal(model[C.FROZEN], ref["frozen"][C.FROZEN]) and C.FROZEN not in optim["state"]
    # both param groups with their own hyperparameters; DeepSpeed's AdamW decays decoupled
    assert got["groups"] == [{**g, "decoupled_weight_decay": True} for g in C.GROUPS]
    assert source[1]["groups"] == list(C.GROUPS)
    assert got["step"] == C.SAVE_STEPS and got["user"] == C.CLIENT_STATE
    assert got["findings"] == ([] if world == 1 else ["ckpt.world_size.reshard"])
    # an optimizer with other param groups is refused, not silently given group 0's hyperparameters
    assert "the checkpoint's optimizer has 2 param group(s), this optimizer 1" in got["one_group_error"]
    assert "Build the optimizer with the same 2 group(s)" in got["one_group_error"]


def test_loss_curve_continues_the_uninterrupted_zero3_run(source, resumed):
    _, got = resumed
    reference = source[1]["losses_after"]
    assert len(got["losses"]) == C.RESUME_STEPS
    # same weights, different reduction order and Adam kernel rounding: see the module docstring
    assert got["losses"] == pytest.approx(reference, rel=1e-5)
    # and the curve is not flat-lined on the source's first losses: it is the continuation
    assert got["losses"][0] != pytest.approx(source[1]["losses_before"][0], rel=1e-5)


def test_result_and_manifest_say_what_was_carried(source, converted):
    out, r, warnings = converted
    assert warnings == [] and r.verified == "hash"  # shardkit's save sealed the source
    assert (r.source_engine, r.target_engine, r.tag, r.source_world_size) == ("zero3", "fsdp2", TAG, 2)
    assert r.params == 20  # 19 trainable (the tied pair stored once) + 1 frozen
    assert r.not_carried == []
    carried = " | ".join(r.carried)
    for what in ("fp32 masters (19 trainable)", "exp_avg", "exp_avg_sq", "step", "param_groups x2",
                 "frozen parameters (1", "tied names (lm_head.weight)", "client_state (epoch, sample)"):
        assert what in carried, what
    assert any("lm_head.weight is model.embed_tokens.weight" in n for n in r.notes)
    manifest = json.loads((out / TAG / "shardkit_manifest.json").read_text())
    assert manifest["engine"] == "fsdp2" and manifest["step"] == C.SAVE_STEPS and manifest["world_size"] == 1
    assert manifest["extra"]["user"] == C.CLIENT_STATE and manifest["extra"]["keys"] == ["model", "optim"]
    assert manifest["extra"]["converted_from"]["world_size"] == 2
    assert (out / "latest").read_text() == TAG
    assert r.bytes == sum(f.stat().st_size for f in (out / TAG).iterdir())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_written_like_dcp_save_and_read_straight_from_the_files(converted, tmp_path):
    """The tensors are streamed into their own .distcp files by byte-range copies, not written by
    DCP's FileSystemWriter: the .metadata must be what dcp.save writes for the same state (field by
    field, only the files and offsets differ), every tensor must be what torch's own reader reads,
    and every tensor must be readable straight from its file by dcp_slices (convert --to zero3's
    fast path, which otherwise falls back to dcp.load without saying so)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner, _load_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from shardkit.checkpoint.dcp.safe_load import read_dcp_metadata
    from shardkit.checkpoint.dcp.slices import DcpSlices
    from shardkit.checkpoint.ops.convert.to_dcp_plan import ADAMW_GROUP_DEFAULTS
    from tests.test_dcp_plain_metadata import assert_same_as_torch

    out, _, _ = converted
    tag_dir = out / TAG
    state: dict = {}
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(str(tag_dir)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)  # torch's own reader, every item (our own test output: unrestricted is fine)
    ref_dir = tmp_path / "dcp_save"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(ref_dir)), no_dist=True)
    ours, ref = read_dcp_metadata(tag_dir / ".metadata"), read_dcp_metadata(ref_dir / ".metadata")
    assert ours.state_dict_metadata == ref.state_dict_metadata and ours.planner_data == ref.planner_data
    assert ours.version == ref.version and set(ours.storage_data) == set(ref.storage_data)
    assert type(ours.storage_meta) is type(ref.storage_meta)
    # one file per big tensor, the small items (param-group values, step) together in __0_0
    files = {info.relative_path for info in ours.storage_data.values()}
    assert "__0_0.distcp" in files and len(files) > 20
    assert_same_as_torch(tag_dir / ".metadata")  # and shardkit's torch-free reader reads all of it
    slices = DcpSlices(tag_dir)
    try:
        keys = [k for k, m in ours.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata) and len(m.size)]
        assert keys and [k for k in keys if slices.chunks(k) is None] == []
        flat = {f"model.{k}": v for k, v in state["model"].items() if v.dim()}
        flat.update({f"optim.state.{fqn}.{k}": v for fqn, entry in state["optim"]["state"].items()
                     for k, v in entry.items() if v.dim()})
        assert sorted(flat) == sorted(keys)
        for key, value in flat.items():
            got = torch.empty(value.numel(), dtype=value.dtype)
            assert slices.read_into(key, 0, got) and torch.equal(got.view(torch.uint8), value.reshape(-1).view(torch.uint8))
    finally:
        slices.close()
    # the group defaults are written out (the converter never imports torch): the installed torch's
    assert ADAMW_GROUP_DEFAULTS == dict(torch.optim.AdamW([torch.zeros(1)]).defaults)


# --- the CLI -------------------------------------------------------------------------------------


def test_cli_converts_and_reports(source, tmp_path, run_cli):
    out = tmp_path / "out"
    code, stdout, err = run_cli("convert", source[0], "--to", "fsdp2", "-o", out)
    assert code == 0, err
    assert f"wrote {out / TAG}: zero3 -> fsdp2, 20 parameters" in stdout
    assert "load_fsdp_checkpoint(model, optimizer" in stdout and "sizes and content digests (blake3 or sha256, as its manifest lists them) match its manifest" in stdout
    assert "carried: fp32 masters (19 trainable)" in stdout
    code, _, err = run_cli("convert", source[0], "--to", "fsdp2", "-o", out)
    assert code == 2 and f"already holds checkpoint '{TAG}'" in err and "--force" in err
    code, _, err = run_cli("convert", source[0], "--to", "fsdp2", "-o", out, "--force", "--tag", "again")
    assert code == 0, err
    assert (out / "latest").read_text() == "again"


@pytest.mark.parametrize("argv, message", [
    (["--to", "fsdp2", "--world-size", "2"], "--world-size 2 with --to fsdp2: a DCP checkpoint loads at any world size"),
    (["--to", "zero3"], "--to zero3 needs --world-size N"),
    (["--to", "zero3", "--world-size", "0"], "--world-size 0: must be at least 1"),
    (["--to", "zero3", "--world-size", "2", "--adam-w-mode", "on"], "--adam-w-mode on with --to zero3"),
], ids=["fsdp2-world-size", "zero3-no-world-size", "zero3-world-size-0", "zero3-adam-w-mode"])
def test_cli_usage_errors(source, tmp_path, run_cli, argv, message):
    code, _, err = run_cli("convert", source[0], *argv, "-o", tmp_path / "out")
    assert code == 2 and message in err
    assert not (tmp_path / "out").exists()


def test_cli_missing_source_names_the_path(tmp_path, run_cli):
    code, _, err = run_cli("convert", tmp_path / "nope", "--to", "fsdp2", "-o", tmp_path / "out")
    assert code == 1 and f"{tmp_path / 'nope'}: checkpoint path does not exist" in err


# --- refused or reported by name -------------------------------------------------------------


def _plain_copy(source: Path, dest: Path) -> Path:
    """A copy without the shardkit manifest, so a test may edit the rank files (read with a warning)."""
    shutil.copytree(source, dest)
    (dest / TAG / "shardkit_manifest.json").unlink()
    return dest


def _edit(path: Path, change) -> None:
    sd = torch.load(path, weights_only=False)
    change(sd)
    torch.save(sd, path)


def test_tensor_parallel_and_moe_checkpoints_are_refused_by_name(source, tmp_path):
    src = _plain_copy(source[0], tmp_path / "src")
    (src / TAG / "zero_pp_rank_0_mp_rank_01_model_states.pt").write_bytes(b"")
    (src / TAG / "expp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    # refused by checkpoint.layout.support, the one check every command runs first
    with pytest.raises(CheckpointError, match=r"convert --to fsdp2 refuses .*tensor/model-parallel ranks \(mp_world_size "
                       r"1, files zero_pp_rank_0_mp_rank_01_model_states.pt\).*ds_to_universal.*; and .*native DeepSpeed "
                       r"MoE expert files \(expp_rank_0_mp_rank_00_optim_states.pt\).*Nothing was written"):
        convert_to_dcp(src, tmp_path / "out", warn=lambda m: None)
    assert not (tmp_path / "out").exists()


def test_other_optimizers_and_amsgrad_are_refused_by_name(source, tmp_path):
    src = _plain_copy(source[0], tmp_path / "src")
    model0 = src / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    _edit(model0, lambda sd: sd["ds_config"].update(optimizer={"type": "Lamb", "params": {"lr": 1e-3}}))
    with pytest.raises(CheckpointError, match=r"optimizer.type \('Lamb'\): only Adam/AdamW state .* Fix: train with "
                       r"optimizer.type Adam or AdamW"):
        convert_to_dcp(src, tmp_path / "out", warn=lambda m: None)
    _edit(model0, lambda sd: sd["ds_config"].update(optimizer={"type": "AdamW", "params": {"lr": 1e-3}}))
    optim0 = src / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    _edit(optim0, lambda sd: sd["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"][1].update(amsgrad=True))
    with pytest.raises(CheckpointError, match=r"param_groups\[1\].amsgrad \(True\): the checkpoint has no "
                       r"max_exp_avg_sq state to carry. Fix: convert a run with amsgrad off"):
        convert_to_dcp(src, tmp_path / "out", warn=lambda m: None)


def test_state_that_is_not_adams_is_refused_by_name(source, tmp_path):
    """A client optimizer keeping only a momentum (Lion-style): refused, not written without its second moment."""
    src = _plain_copy(source[0], tmp_path / "src")

    def momentum_only(sd):
        for entry in sd["optimizer_state_dict"]["optimizer_state_dict"]["state"].values():
            del entry["exp_avg_sq"]

    _edit(src / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt", momentum_only)
    with pytest.raises(CheckpointError, match=r"optimizer.state \(per-element keys \['exp_avg'\]\): Adam/AdamW keeps "
                       r"exactly \['exp_avg', 'exp_avg_sq'\]. Fix: convert a checkpoint saved after at least one step"):
        convert_to_dcp(src, tmp_path / "out", warn=lambda m: None)


def test_client_optimizer_with_weight_decay_needs_adam_w_mode(source, tmp_path, run_cli):
    src = _plain_copy(source[0], tmp_path / "src")
    _edit(src / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt", lambda sd: sd["ds_config"].pop("optimizer"))
    code, _, err = run_cli("convert", src, "--to", "fsdp2", "-o", tmp_path / "out")
    assert code == 1 and "param_groups[0].weight_decay (0.01): the client optimizer is not named in ds_config" in err
    assert "Fix: pass --adam-w-mode on (AdamW) or off (Adam)" in err and "warning:" in err  # unverified copy
    r = convert_to_dcp(src, tmp_path / "out", adam_w_mode=False, warn=lambda m: None)
    assert any("client optimizer" in n for n in r.notes)
    written = {"optim": {"param_groups": [{"decoupled_weight_decay": None, "weight_decay": None}]}}
    load_dcp_state(written, tmp_path / "out" / TAG)
    assert written["optim"]["param_groups"][0] == {"decoupled_weight_decay": False, "weight_decay": 0.01}


def test_loss_scaler_scheduler_and_non_json_client_state_are_reported_by_name(source, tmp_path):
    src = _plain_copy(source[0], tmp_path / "src")

    def fp16_scaler(sd):
        osd = sd["optimizer_state_dict"]
        osd["dynamic_loss_scale"] = True
        osd["loss_scaler"].cur_scale = 65536.0

    def scheduler_and_rng(sd):
        sd["lr_scheduler"] = {"last_batch_iteration": 1, "warmup_num_steps": 10, "warmup_max_lr": 1e-3}
        sd["rng"] = torch.arange(3)

    _edit(src / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt", fp16_scaler)
    _edit(src / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt", scheduler_and_rng)
    warnings: list[str] = []
    r = convert_to_dcp(src, tmp_path / "out", warn=warnings.append)
    assert r.verified == "none" and "has no shardkit_manifest.json" in warnings[0]
    lines = "\n".join(r.not_carried)
    assert "loss_scaler (cur_scale=65536.0, dynamic=True)" in lines and "GradScaler(init_scale=65536.0)" in lines
    assert "lr_scheduler (3 keys): shardkit's FSDP2 checkpoint has no scheduler" in lines
    assert "client_state.rng (Tensor)" in lines
    extra = json.loads((tmp_path / "out" / TAG / "shardkit_manifest.json").read_text())["extra"]
    assert extra["converted_from"]["loss_scaler"]["cur_scale"] == 65536.0
    assert extra["converted_from"]["lr_scheduler"]["warmup_num_steps"] == 10
    assert extra["user"] == C.CLIENT_STATE  # the JSON entries still carried, rng not


# --- names ---------------------------------------------------------------------------------------


def test_name_map_strips_module_prefix_only_when_every_name_has_it():
    m = build_name_map(["module.model.embed_tokens.weight", "module.lm_head.bias"],
                       {"module.lm_head.weight": "module.model.embed_tokens.weight"})
    assert m.prefix == "module." and m.fsdp_name("module.lm_head.bias") == "lm_head.bias"
    assert m.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert m.zero3_name("lm_head.bias") == "module.lm_head.bias"
    kept = build_name_map(["module.w", "other.w", "_orig_mod.x.w"])
    assert kept.prefix == "" and kept.fsdp_name("module.w") == "module.w" and kept.fsdp_name("_orig_mod.x.w") == "x.w"
    with pytest.raises(CheckpointError, match=r"parameters 'x.w' and '_orig_mod.x.w' both map to the FSDP name 'x.w'"):
        build_name_map(["x.w", "_orig_mod.x.w"])
    with pytest.raises(CheckpointError, match=r"shared_params says 'a' is tied to 'b', but 'b' is not among"):
        build_name_map(["x.w"], {"a": "b"})


def test_name_map_drops_only_whole_wrapper_components():
    # _get_fqns skips whole module names; a user's module merely containing one keeps its name
    m = build_name_map(["my_orig_mod.weight", "a._fsdp_wrapped_module.b._checkpoint_wrapped_module.w",
                        "x_checkpoint_wrapped_module.w"])
    assert m.fsdp_name("my_orig_mod.weight") == "my_orig_mod.weight"
    assert m.fsdp_name("a._fsdp_wrapped_module.b._checkpoint_wrapped_module.w") == "a.b.w"
    assert m.fsdp_name("x_checkpoint_wrapped_module.w") == "x_checkpoint_wrapped_module.w"


def test_round_trip_with_frozen_tied_and_two_groups_is_tensor_equal(source, converted, tmp_path):
    """ZeRO-3 (tied embeddings, a frozen parameter outside the optimizer, two param groups) -> FSDP2
    -> ZeRO-3 at the source's world size: every tensor in every rank file equal in bits. The DCP was
    written by one process, so the frozen norm is one unsplit tensor like a buffer: the manifest's
    buffer names are what keep it a frozen parameter (without them it came back as a buffer)."""
    from shardkit.checkpoint.ops.convert.to_zero3 import convert_to_zero3
    from shardkit.storage.manifest import read_manifest
    from shardkit.storage.torch_load import safe_torch_load

    out, _, _ = converted
    assert read_manifest(out / TAG).extra["converted_from"]["buffer_names"] == []
    src = source[0] / TAG
    ds_cfg = safe_torch_load(src / "zero_pp_rank_0_mp_rank_00_model_states.pt")["ds_config"]
    back = convert_to_zero3(out, tmp_path / "back", world_size=2, ds_config=ds_cfg)
    names = sorted(p.name for p in src.glob("*.pt"))
    assert names == sorted(p.name for p in (back.output / TAG).glob("*.pt")) and len(names) == 4
    for name in names:
        a, b = safe_torch_load(src / name), safe_torch_load(back.output / TAG / name)
        if "model_states" in name:
            assert list(a["frozen_param_shapes"]) == list(b["frozen_param_shapes"]) == [C.FROZEN]
            # shared_params may differ: DeepSpeed recorded none for this tied model, the converter
            # records the tie it sees; only zero_to_fp32 reads it, never load_checkpoint
            assert a["buffer_names"] == b["buffer_names"] and set(a["shared_params"]) <= {C.TIED[0]}
            pairs = [(a["frozen_param_fragments"][C.FROZEN], b["frozen_param_fragments"][C.FROZEN])]
        else:
            oa, ob = a["optimizer_state_dict"], b["optimizer_state_dict"]
            pairs = list(zip(oa["fp32_flat_groups"], ob["fp32_flat_groups"], strict=True))
            for sa, sb in zip(oa["optimizer_state_dict"]["state"].values(),
                              ob["optimizer_state_dict"]["state"].values(), strict=True):
                pairs += [(sa[k], sb[k]) for k in ("exp_avg", "exp_avg_sq")]
        for ta, tb in pairs:
            assert ta.dtype == tb.dtype and torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)), name


# --- the torch-free route and the split across processes -----------------------------------------

def _everything(tag_dir: Path) -> dict:
    """Every item of a DCP checkpoint, read by torch's own reader, by flattened key."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner, _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(str(tag_dir)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)  # our own test output: unrestricted is fine
    return flatten_state_dict(state)[0]


def _assert_same_items(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b) and len(a) > 40
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            other = b[key]
            assert value.dtype == other.dtype and value.shape == other.shape, key
            assert torch.equal(value.reshape(-1).view(torch.uint8), other.reshape(-1).view(torch.uint8)), key
        else:
            assert value == b[key] and type(value) is type(b[key]), key


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_converts_without_importing_torch_and_equals_the_source(source, tmp_path):
    """The reader parses the rank files with read_structure and the DCP writer copies byte ranges:
    torch is never imported by the converting process. What it writes, read back by torch's own
    reader, equals the source bit for bit by parameter name (fp32 masters, exp_avg, exp_avg_sq,
    step, frozen and tied weights), and shardkit verify accepts it."""
    import subprocess
    import sys

    out = tmp_path / "bytes"
    code = ("import sys; from shardkit.checkpoint.ops.convert.to_dcp import convert_to_dcp; "
            f"r = convert_to_dcp({str(source[0])!r}, {str(out)!r}, warn=lambda m: None); "
            "print(r.route, sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'numpy')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "bytes []"
    ours, ref = _everything(out / TAG), source[1]["state"]
    assert any(k.startswith("optim.param_groups.1.") for k in ours)
    for name, master in ref["fp32"].items():
        assert torch.equal(ours[f"model.{name}"].view(torch.uint8), master.view(torch.uint8)), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours[f"optim.state.{name}.{key}"].view(torch.uint8), ref[key][name].view(torch.uint8))
        assert float(ours[f"optim.state.{name}.step"]) == C.SAVE_STEPS
    alias, owner = C.TIED
    assert torch.equal(ours[f"model.{alias}"], ref["fp32"][owner])
    assert torch.equal(ours[f"model.{C.FROZEN}"], ref["frozen"][C.FROZEN])
    verify = subprocess.run([sys.executable, "-m", "shardkit", "verify", str(out)], capture_output=True, text=True,
                            timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_failed_write_on_the_byte_route_names_the_file_and_leaves_nothing(source, tmp_path, monkeypatch):
    import errno

    from shardkit.checkpoint.writers import dcp_files

    def full(*_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_files, "write_tensor_file", full)
    out = tmp_path / "full"
    with pytest.raises(CheckpointError, match=r"disk full at .*__0_\d+\.distcp.*nothing written: the staging folder "
                                              r"was removed"):
        convert_to_dcp(source[0], out)
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == []


def test_a_corrupted_source_is_refused_before_anything_is_published(source, tmp_path):
    """A rank file of the right size whose bytes changed fails its digest (each process checks its
    share before copying): refused naming the file, nothing published."""
    src = tmp_path / "src"
    shutil.copytree(source[0], src)
    victim = next((src / TAG).glob("*optim_states.pt"))
    data = bytearray(victim.read_bytes())
    data[-200] ^= 0xFF
    victim.write_bytes(bytes(data))
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=rf"refusing to convert .*{victim.name} fails verification: its blake3 is "
                                              r"[0-9a-f]{64}, its manifest says"):
        convert_to_dcp(src, out)
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == []


def test_a_source_file_rewritten_during_the_copy_is_refused(source, tmp_path, monkeypatch):
    """A run saving the same tag again while the conversion copies (here: a rank file's mtime moves
    once the tensor files are written) is refused naming the file, also with --no-verify, and
    nothing is published."""
    import os

    from shardkit.checkpoint.writers import dcp_files

    src = tmp_path / "src"
    shutil.copytree(source[0], src)
    victim = next((src / TAG).glob("*optim_states.pt"))
    write = dcp_files.write_tensor_files

    def write_then_touch(*args: object, **kwargs: object) -> object:
        done = write(*args, **kwargs)  # type: ignore[arg-type]
        os.utime(victim, ns=(victim.stat().st_atime_ns, victim.stat().st_mtime_ns + 10**9))
        return done

    monkeypatch.setattr(dcp_files, "write_tensor_files", write_then_touch)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=rf"{victim.name}: was modified while the conversion read it .*Nothing "
                                              "was published"):
        convert_to_dcp(src, out, verify=False)
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == []


def _env(**extra: str) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")}
    env.update(extra)
    return env


def _convert_cli(src: Path, out: Path) -> list[str]:
    import sys

    return [sys.executable, "-m", "shardkit", "convert", str(src), "--to", "fsdp2", "-o", str(out), "--workers", "1"]


def test_two_processes_under_torchrun_write_what_one_process_writes(source, tmp_path):
    """Under torchrun every process writes its share of the tensor files and process 0 seals one
    manifest: the same files, byte for byte, as one process writes (``.metadata`` differs only in
    its save id and folder name), and the same items."""
    import re
    import subprocess
    import sys

    from shardkit.checkpoint.dcp.safe_load import read_dcp_metadata
    from shardkit.storage.manifest import read_manifest

    one, two = tmp_path / "one", tmp_path / "two"
    done = subprocess.run(_convert_cli(source[0], one), env=_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "shardkit",
           *_convert_cli(source[0], two)[3:]]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr + done.stdout
    assert re.search(rf"wrote .*two/{TAG} by 2 processes \(torchrun\): zero3 -> fsdp2, 20 parameters", done.stdout), done.stdout
    assert re.search(r"rank 1 of 2 \(torchrun\): wrote its share, [1-9]\d* files", done.stdout), done.stdout

    def files(out: Path) -> dict:
        return {e.path: (e.size, e.digest) for e in read_manifest(out / TAG).files if e.path != ".metadata"}

    assert files(one) == files(two) and len(files(one)) > 40
    a, b = read_dcp_metadata(one / TAG / ".metadata"), read_dcp_metadata(two / TAG / ".metadata")
    assert a.state_dict_metadata == b.state_dict_metadata and a.storage_data == b.storage_data
    assert sorted(p.name for p in two.iterdir()) == [TAG, "latest"]


def _start_rank(rank: int, world: int, src: Path, out: Path, port: str, prefix: str = "", **extra: str):
    import shlex
    import subprocess

    env = _env(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra)
    cmd = prefix + shlex.join(_convert_cli(src, out))
    return subprocess.Popen(["sh", "-c", cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_failed_or_missing_process_fails_the_run_naming_it(source, tmp_path):
    """A process whose writes fail (a file-size limit here: EFBIG) reports it and process 0 fails the
    run naming that rank; a process that never starts is named within the join timeout; nothing is
    published either way."""
    import re

    out, port = tmp_path / "out", job_port()
    r1 = _start_rank(1, 2, source[0], out, port, prefix="ulimit -f 1; exec ")
    r0 = _start_rank(0, 2, source[0], out, port)
    try:
        _, err0 = r0.communicate(timeout=180)
        _, err1 = r1.communicate(timeout=180)
    finally:
        for p in (r0, r1):
            p.kill()
            p.wait()
    assert r1.returncode == 1 and "File too large" in err1, err1
    assert r0.returncode == 1, err0
    assert re.search(r"rank 1 of 2 \(host .*, pid \d+\) failed writing its share: .*File too large", err0), err0
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == []
    r0 = _start_rank(0, 2, source[0], out, job_port(), SHARDKIT_JOIN_TIMEOUT_S="3")
    _, err = r0.communicate(timeout=180)
    assert r0.returncode == 1 and re.search(r"rank 1 of 2 never joined within 3 s", err), err
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == []
