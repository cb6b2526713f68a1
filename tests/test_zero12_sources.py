"""``consolidate`` and ``export`` of ZeRO-1/2 checkpoints through ``readers.zero12``, on real 2-rank DeepSpeed
saves (tests/_ranks_zero12_sources.py: ZeRO-1 and ZeRO-2, fp32/bf16/fp16, CPU offload, a frozen embedding,
tied embeddings, Qwen2's biases, two param groups).

- the reader's pieces, read byte by byte, equal the live engine's own fp32 masters and Adam moments
  (DeepSpeed's ``_hp_mapping`` of each parameter, summed over the ranks) and ``base_optimizer_state``
  as ``torch.load`` reads it with the padding cut; the scalars are the run's;
- ``consolidate`` writes the tensors of DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``,
  bit-equal by name (under ZeRO-1, which records no frozen parameters, DeepSpeed drops them: the
  module's own values are written);
- the ``export`` folder loads with ``from_pretrained`` and equals zero_to_fp32's state dict loaded
  into the model and ``save_pretrained``;
- a Trainer ``output_dir``/``checkpoint-N`` wrapping ZeRO-2 is taken; the layouts the reader would read
  wrongly are refused by name with nothing written.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests import _ranks_zero12_sources as S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _variants() -> dict[str, Any]:
    variants = dict(S.VARIANTS)
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():  # fp16 CPU kernels: not on every CPU
        variants.update(S.FP16_VARIANT)
    return variants


@pytest.fixture(scope="session")
def saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from shardkit.run.spawn.process import run_ranks

    base = tmp_path_factory.getbasetemp() / "zero12_sources"
    variants = _variants()
    run_ranks(S.save_all, 2, args=(str(base), variants), timeout=600, device="cpu")
    out = {label: base / label for label in variants}
    trainer = base / "trainer" / "checkpoint-4"
    shutil.copytree(out["zero2_bf16"], trainer)
    (trainer / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    out["trainer_output_dir"] = trainer.parent
    return out


def _read(t: Any) -> torch.Tensor:
    """A SourceTensor's value, read from its pieces' bytes alone."""
    flat = torch.empty(t.numel, dtype=getattr(torch, t.dtype))
    for p in t.pieces:
        with open(p.file, "rb") as fh:
            fh.seek(p.offset)
            data = bytearray(fh.read(p.numel * flat.element_size()))
        flat[p.start:p.start + p.numel] = torch.frombuffer(data, dtype=flat.dtype)
    return flat.view(t.shape)


def _zero_to_fp32(root: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(str(root))


def _label_variants() -> list[str]:
    return [label for label in _variants()]


@pytest.mark.parametrize("label", _label_variants())
def test_the_reader_describes_the_engines_masters_and_moments(saves, label):
    from shardkit.checkpoint.readers.zero12 import read_zero12

    stage, precision, _, kind, groups = _variants()[label]
    ckpt = read_zero12(saves[label] / S.TAG)
    assert (ckpt.format, ckpt.world_size, ckpt.precision, ckpt.optimizer_described) == (f"zero{stage}", 2, precision, True)
    assert ckpt.uncovered() == []
    reference = torch.load(saves[label] / "reference.pt")
    assert sorted(reference) == sorted(ckpt.trainable) == sorted(ckpt.optimizer)
    for name, states in reference.items():
        assert torch.equal(_read(ckpt.weights[name]), states["fp32"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_read(ckpt.optimizer[name][key]), states[key]), f"{name} {key}"
    assert set(ckpt.scalars["step"].values()) == {2.0}
    assert [g["lr"] for g in ckpt.scalars["param_groups"]] == [1e-2] * groups
    assert all(g["betas"] == [0.9, 0.98] and g["eps"] == 1e-8 for g in ckpt.scalars["param_groups"])
    assert ckpt.scalars["optimizer_type"] == "AdamW"
    assert sorted(n for g in ckpt.scalars["param_groups"] for n in g["params"]) == sorted(ckpt.trainable)
    if precision == "fp16":
        assert ckpt.scalars["loss_scaler"]["dynamic"] is True and ckpt.scalars["loss_scaler"]["cur_scale"] > 0
    assert ckpt.frozen == ({"model.embed_tokens.weight"} if kind == "llama_frozen" else set())
    assert ckpt.aliases == ({"lm_head.weight": "model.embed_tokens.weight"} if kind == "llama_tied" else {})


def test_the_moments_equal_base_optimizer_state_unpadded(saves):
    """The same moments from torch.load of the rank files: each group's flat state per rank, its padding cut,
    concatenated, and cut at the param_shapes offsets (plus param_alignment_paddings)."""
    from shardkit.checkpoint.readers.zero12 import read_zero12

    tag = saves["zero2_bf16"] / S.TAG
    ckpt = read_zero12(tag)
    model = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)
    ranks = [torch.load(tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt", weights_only=False)["optimizer_state_dict"]
             for r in range(2)]
    for g, shapes in enumerate(model["param_shapes"]):
        pid = ranks[0]["base_optimizer_state"]["param_groups"][g]["params"][0]
        for key in ("exp_avg", "exp_avg_sq"):
            parts = []
            for sd in ranks:
                state = sd["base_optimizer_state"]["state"][pid][key]
                parts.append(state[:state.numel() - sd["group_paddings"][g]])
            flat, offset = torch.cat(parts), 0
            for (name, shape), pad in zip(shapes.items(), ranks[0]["param_alignment_paddings"][g]):
                expected = flat[offset:offset + math.prod(shape)].view(shape)
                assert torch.equal(_read(ckpt.optimizer[name][key]), expected), f"{name} {key}"
                offset += math.prod(shape) + pad


@pytest.mark.parametrize("label", _label_variants())
def test_consolidate_equals_zero_to_fp32(saves, tmp_path, run_cli, label):
    out = tmp_path / "model.safetensors"
    code, stdout, err = run_cli("consolidate", saves[label], "-o", out, "--json")
    assert code == 0, err
    report = json.loads(stdout[stdout.index("{"):])
    ours, theirs = load_file(out), _zero_to_fp32(saves[label])
    frozen = {"model.embed_tokens.weight"} if _variants()[label][3] == "llama_frozen" else set()
    if label.startswith("zero1"):  # DeepSpeed records frozen parameters only when gradients are partitioned
        assert sorted(ours) == sorted([*theirs, *frozen])
        module = torch.load(saves[label] / S.TAG / "mp_rank_00_model_states.pt", weights_only=False)["module"]
        for name in frozen:
            assert torch.equal(ours[name], module[name].float())
    else:
        assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        assert ours[name].dtype == torch.float32, name
        assert torch.equal(ours[name], value.float()), name  # zero_to_fp32 keeps a frozen bf16 tensor bf16
    assert report["wrote"]["tensors"] == len(ours) and report["source_world_size"] == 2
    assert report["tag"] == S.TAG and report["wrote"]["bytes"] == out.stat().st_size


def test_consolidate_casts_on_request_and_refuses_to_overwrite(saves, tmp_path, run_cli):
    out = tmp_path / "model.safetensors"
    code, _, err = run_cli("consolidate", saves["zero2_tied_bf16"], "-o", out, "--dtype", "bf16", "--exclude-frozen")
    assert code == 0, err
    theirs = _zero_to_fp32(saves["zero2_tied_bf16"])
    ours = load_file(out)
    assert sorted(ours) == sorted(theirs)  # the tied lm_head written under its own name too
    assert all(torch.equal(ours[n], v.to(torch.bfloat16)) for n, v in theirs.items())
    before = out.stat().st_mtime_ns
    code, _, err = run_cli("consolidate", saves["zero2_tied_bf16"], "-o", out)
    assert code == 2 and "already exists; pass --force" in err and out.stat().st_mtime_ns == before
    code, _, err = run_cli("consolidate", saves["zero2_frozen_bf16"], "-o", out, "--force", "--exclude-frozen")
    assert code == 0, err
    assert "model.embed_tokens.weight" not in load_file(out)


@pytest.mark.parametrize("label", ["zero2", "zero2_tied_bf16", "zero1_frozen", "zero2_frozen_bf16", "zero2_offload"])
def test_export_loads_and_equals_zero_to_fp32_and_save_pretrained(saves, tmp_path, run_cli, label):
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path / "export"
    code, stdout, err = run_cli("export", saves[label], "-o", out, "--dtype", "fp32")
    assert code == 0, err
    state = _zero_to_fp32(saves[label])
    if label.startswith("zero1"):
        module = torch.load(saves[label] / S.TAG / "mp_rank_00_model_states.pt", weights_only=False)["module"]
        state["model.embed_tokens.weight"] = module["model.embed_tokens.weight"].float()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(saves[label]), dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    model.save_pretrained(tmp_path / "reference")
    ours = load_file(out / "model.safetensors")
    reference = load_file(tmp_path / "reference" / "model.safetensors")
    assert sorted(ours) == sorted(reference)
    assert all(torch.equal(ours[n], reference[n]) for n in reference)
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(loaded[n], v) for n, v in model.state_dict().items())


def test_a_trainer_output_dir_wrapping_zero2(saves, tmp_path, run_cli):
    out = tmp_path / "model.safetensors"
    code, stdout, err = run_cli("consolidate", saves["trainer_output_dir"], "-o", out)
    assert code == 0, err
    assert "checkpoint-4" in stdout + err
    theirs = _zero_to_fp32(saves["zero2_bf16"])
    ours = load_file(out)
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[n], v) for n, v in theirs.items())
    code, stdout, err = run_cli("export", saves["trainer_output_dir"] / "checkpoint-4", "-o", tmp_path / "hf")
    assert code == 0, err
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()


def _copy_tag(saves: dict[str, Path], label: str, dst: Path) -> Path:
    root = dst / label
    shutil.copytree(saves[label], root)
    return root


def _resave(path: Path, change: Any) -> None:
    state = torch.load(path, map_location="cpu", weights_only=False)
    change(state)
    torch.save(state, path)


def _round_robin(root: Path) -> None:
    def change(s: dict[str, Any]) -> None:
        s["ds_config"]["zero_optimization"]["round_robin_gradients"] = True
    _resave(root / S.TAG / "mp_rank_00_model_states.pt", change)


def _elastic(root: Path) -> None:
    def change(s: dict[str, Any]) -> None:
        s["optimizer_state_dict"]["base_optimizer_state"] = [{}]
    _resave(root / S.TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt", change)


def _disagree(root: Path) -> None:
    def change(s: dict[str, Any]) -> None:
        s["optimizer_state_dict"]["partition_count"] = [3, 3]
    _resave(root / S.TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt", change)


def _mixed_stages(root: Path) -> None:
    def change(s: dict[str, Any]) -> None:
        s["optimizer_state_dict"]["zero_stage"] = 1
    _resave(root / S.TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt", change)


def _bf16_optimizer(root: Path) -> None:
    for r in range(2):
        _resave(root / S.TAG / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
                lambda s: s["optimizer_state_dict"].pop("zero_stage"))


#: case -> (change to a copy of the ZeRO-2 fp32 save, what the refusal names)
BROKEN = {
    "round_robin_gradients": (_round_robin, "round_robin_gradients: true"),
    "elastic": (_elastic, "base_optimizer_state is a per-group list (an elastic_checkpoint save"),
    "ranks_disagree": (_disagree, "partition_count is [3, 3], but the folder holds 2 rank files"),
    "mixed_stages": (_mixed_stages, "zero_stage is ['1', '2'] across the rank files"),
    "bf16_optimizer": (_bf16_optimizer, "no optimizer_state_dict.zero_stage: a BF16_Optimizer save"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_layout_the_reader_would_misread_is_refused_by_name(saves, tmp_path, run_cli, case):
    from shardkit.checkpoint.readers.zero12 import read_zero12
    from shardkit.core.errors import CheckpointError

    change, said = BROKEN[case]
    root = _copy_tag(saves, "zero2", tmp_path / "src")
    change(root)
    with pytest.raises(CheckpointError, match=r"zero_stage|round_robin|partition_count|elastic"):
        read_zero12(root / S.TAG)
    out = tmp_path / "out"
    for argv in (["consolidate", root, "-o", out / "model.safetensors"], ["export", root, "-o", out]):
        code, _, err = run_cli(*argv)
        assert code == 1, err
        assert said in err, err
        assert not out.exists()


def test_zero3_files_beside_zero2_files_are_refused(saves, tmp_path):
    from shardkit.checkpoint.readers.zero12 import read_zero12
    from shardkit.core.errors import CheckpointError

    root = _copy_tag(saves, "zero2", tmp_path / "src")
    shutil.copy(root / S.TAG / "mp_rank_00_model_states.pt", root / S.TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_0_mp_rank_00_model_states\.pt beside the ZeRO-1/2 files"):
        read_zero12(root / S.TAG)


@pytest.mark.parametrize("case", ["middle", "naming"])
def test_a_missing_or_renamed_rank_file_is_named(saves, tmp_path, case):
    from shardkit.checkpoint.readers.zero12 import read_zero12
    from shardkit.core.errors import CheckpointError

    root = _copy_tag(saves, "zero2", tmp_path / "src")
    tag = root / S.TAG
    rank1 = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if case == "middle":  # 3 ranks' files with rank 1's gone
        shutil.copy(rank1, tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
        rank1.unlink()
        said = "2 optimizer file(s), rank(s) [1] missing"
    else:  # every rank present, but one file named as another save's (bf16_ prefix)
        rank1.rename(tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
        said = "2 optimizer file(s), every rank present (prefixes ['', 'bf16_'])"
    with pytest.raises(CheckpointError) as err:
        read_zero12(tag)
    assert said in str(err.value) and "Re-copy the tag folder" in str(err.value)


def test_fp32_consolidation_of_zero2_never_imports_torch_or_deepspeed(saves, tmp_path, python_exe):
    import subprocess

    out = tmp_path / "m.safetensors"
    code = (
        "import sys; from shardkit.cli import main\n"
        f"assert main(['consolidate', {str(saves['zero2_bf16'])!r}, '-o', {str(out)!r}]) == 0\n"
        "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules, 'heavy import'\n"
    )
    proc = subprocess.run([python_exe, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(load_file(out)) == sorted(_zero_to_fp32(saves["zero2_bf16"]))
