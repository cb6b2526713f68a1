"""DeepSpeed universal checkpoints as a source (``readers.universal``): DeepSpeed's own ds_to_universal
of real 2-rank ZeRO-1 (fp32), ZeRO-2 (bf16), ZeRO-3 (bf16, fp32) saves of a tiny Llama with tied
embeddings and a frozen parameter. ``export`` and ``consolidate`` write what zero_to_fp32 reads from
the original checkpoint; the reader and ``convert --to fsdp2`` carry the masters and moments
DeepSpeed's universal files hold; a partial or re-laid-out universal folder is refused by name
before anything is written."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardkit.run.spawn.process import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TAG = "global_step2"
FROZEN = "model.layers.0.input_layernorm.weight"
#: label -> (ZeRO stage, training precision)
VARIANTS = {"zero1_fp32": (1, "fp32"), "zero2_bf16": (2, "bf16"), "zero3_bf16": (3, "bf16"), "zero3_fp32": (3, "fp32")}


def tied_frozen_llama() -> Any:
    """A tiny Llama with tie_word_embeddings and one frozen parameter (seed 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.get_parameter(FROZEN).requires_grad_(False)
    return model


def train_and_save_all(base: str) -> None:
    """Rank target: two AdamW steps of every VARIANTS config, each saved under ``base/<label>``."""
    from shardkit.engines.deepspeed import initialize, train_step

    for label, (stage, precision) in VARIANTS.items():
        zero: dict[str, Any] = {"stage": stage}
        if stage == 3:
            zero["stage3_param_persistence_threshold"] = 0
        cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                               "zero_optimization": zero, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                               "steps_per_print": 10_000}
        if precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        engine = initialize(tied_frozen_llama(), cfg)
        for step in range(2):
            g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
            train_step(engine, torch.randint(0, 128, (2, 8), generator=g))
        engine.save_checkpoint(f"{base}/{label}", tag=TAG)


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> dict[str, Any]:
    """label -> (original ZeRO root, universal root holding latest_universal); plus the model config folder."""
    base = tmp_path_factory.mktemp("universal")
    run_ranks(train_and_save_all, 2, args=(str(base / "zero"),), timeout=600, device="cpu")
    out: dict[str, Any] = {}
    for label in VARIANTS:
        uni = base / "universal" / label
        subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                        str(base / "zero" / label / TAG), "--output_folder", str(uni / TAG), "--num_extract_workers",
                        "1", "--num_merge_workers", "1", "--inject_missing_state"],
                       check=True, capture_output=True, timeout=300)
        out[label] = (base / "zero" / label, uni)
    config = base / "config"
    tied_frozen_llama().config.save_pretrained(config)
    out["config"] = config
    return out


def _zero_to_fp32(root: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(root), tag=TAG)


def _expected(label: str, root: Path) -> dict[str, torch.Tensor]:
    """zero_to_fp32's state dict of the original save, in fp32. DeepSpeed records no frozen parameters
    in a ZeRO-1 save (engine.py saves them only when gradients are partitioned), so zero_to_fp32 lacks
    that one there; it never trained, so it is the initial model's value."""
    sd = {k: v.float() for k, v in _zero_to_fp32(root).items()}
    if label.startswith("zero1"):
        assert FROZEN not in sd
        sd[FROZEN] = tied_frozen_llama().get_parameter(FROZEN).detach().float()
    return sd


@pytest.mark.parametrize("label", sorted(VARIANTS))
def test_export_equals_zero_to_fp32_and_loads(saves, tmp_path, run_cli, label):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root, uni = saves[label]
    src = uni if label != "zero3_fp32" else uni / TAG  # the root (its latest_universal) or the folder itself
    out = tmp_path / "hf"
    code, stdout, err = run_cli("export", src, "-o", out, "--model-config", saves["config"], "--dtype", "fp32")
    assert code == 0, err
    assert "source (universal)" in stdout and f"ZeRO-{VARIANTS[label][0]} save at 2 rank(s)" in stdout
    expected = _expected(label, root)
    written = load_file(out / "model.safetensors")
    assert set(written) == set(expected) - {"lm_head.weight"}  # the tied alias, as save_pretrained leaves it out
    for name, tensor in written.items():
        assert torch.equal(tensor, expected[name]), name
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    loaded = model.state_dict()
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("label", ["zero2_bf16", "zero3_bf16"])
def test_consolidate_equals_zero_to_fp32(saves, tmp_path, run_cli, label):
    from safetensors.torch import load_file

    root, uni = saves[label]
    out = tmp_path / "model.safetensors"
    code, stdout, err = run_cli("consolidate", uni, "-o", out)
    assert code == 0, err
    # a universal folder does not record how many ranks saved it: no made-up "saved by 1 rank(s)"
    assert f"wrote {out}:" in stdout and "rank(s)" not in stdout, stdout
    expected, written = _expected(label, root), load_file(out)
    assert set(written) == set(expected)
    for name, tensor in expected.items():
        assert written[name].dtype == torch.float32 and torch.equal(written[name], tensor), name


@pytest.mark.parametrize("label", ["zero2_bf16", "zero3_fp32"])
def test_convert_to_fsdp2_carries_masters_and_moments(saves, tmp_path, run_cli, label):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _, uni = saves[label]
    code, _, err = run_cli("convert", uni, "--to", "fsdp2", "-o", tmp_path / "fsdp2")
    assert code == 0, err
    dcp_to_torch_save(tmp_path / "fsdp2" / TAG, tmp_path / "whole.pt")  # torch's own DCP reader
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    model, state = whole["model"], whole["optim"]["state"]
    assert torch.equal(model[FROZEN].float(), tied_frozen_llama().get_parameter(FROZEN).detach().float())
    trainable = [n for g in whole["optim"]["param_groups"] for n in g["params"]]
    assert len(trainable) == 19 and FROZEN not in trainable
    for name in trainable:
        for key, atom in (("fp32", model[name]), ("exp_avg", state[name]["exp_avg"]),
                          ("exp_avg_sq", state[name]["exp_avg_sq"])):
            held = torch.load(uni / TAG / "zero" / name / f"{key}.pt", weights_only=False)
            held = held["param"] if isinstance(held, dict) else held
            assert torch.equal(atom, held.view(atom.shape)), (name, key)
        assert float(state[name]["step"]) == 2.0


def _read(t: Any) -> torch.Tensor:
    """A SourceTensor's bytes, read piece by piece from its files (what every writer copies)."""
    dtype = getattr(torch, t.dtype)
    flat = torch.empty(t.numel, dtype=dtype)
    size = flat.element_size()
    for p in t.pieces:
        with open(p.file, "rb") as fh:
            fh.seek(p.offset)
            raw = bytearray(fh.read(p.numel * size))
        flat[p.start:p.start + p.numel] = torch.frombuffer(raw, dtype=dtype)
    return flat.view(t.shape)


@pytest.mark.parametrize("label", sorted(VARIANTS))
def test_masters_and_moments_are_the_bytes_deepspeed_wrote(saves, label):
    from shardkit.checkpoint.readers.registry import read_checkpoint

    _, uni = saves[label]
    ckpt = read_checkpoint("universal", uni / TAG)
    trainable = ckpt.trainable
    assert len(trainable) == 19 and FROZEN not in trainable and ckpt.frozen == {FROZEN}
    assert ckpt.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert ckpt.optimizer_described and ckpt.uncovered() == []
    assert ckpt.precision == VARIANTS[label][1] and ckpt.scalars["step"] == dict.fromkeys(trainable, 2.0)
    assert [g["lr"] for g in ckpt.scalars["param_groups"]] == [1e-2]
    assert sorted(n for g in ckpt.scalars["param_groups"] for n in g["params"]) == sorted(trainable)
    for name in trainable:
        assert sorted(ckpt.optimizer[name]) == ["exp_avg", "exp_avg_sq"], name
        for state, t in {"fp32": ckpt.weights[name], **ckpt.optimizer[name]}.items():
            held = torch.load(uni / TAG / "zero" / name / f"{state}.pt", weights_only=False)
            held = held["param"] if isinstance(held, dict) else held  # ZeRO-1/2: {"param", "cat_dim"}; ZeRO-3: flat
            assert torch.equal(_read(t), held.view(t.shape)), (name, state)
    frozen = _read(ckpt.weights[FROZEN]).float()
    assert torch.equal(frozen, tied_frozen_llama().get_parameter(FROZEN).detach().float())


def _copy(saves: dict[str, Any], label: str, dst: Path) -> Path:
    shutil.copytree(saves[label][1], dst)
    return dst


@pytest.mark.parametrize("command", ["export", "consolidate"])
def test_a_missing_parameter_folder_is_refused_by_name(saves, tmp_path, run_cli, command):
    src = _copy(saves, "zero3_bf16", tmp_path / "src")
    shutil.rmtree(src / TAG / "zero" / "model.norm.weight")
    out = tmp_path / "out"
    argv = [command, src, "-o", out / "model.safetensors" if command == "consolidate" else out]
    code, _, err = run_cli(*argv, "--model-config", saves["config"]) if command == "export" else run_cli(*argv)
    assert code == 1, err
    assert "no fp32.pt for 1 trainable parameter(s)" in err and "model.norm.weight" in err and "nothing was written" in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_missing_state_file_is_refused_by_name(saves, tmp_path, run_cli):
    src = _copy(saves, "zero2_bf16", tmp_path / "src")
    (src / TAG / "zero" / "model.layers.1.mlp.up_proj.weight" / "exp_avg_sq.pt").unlink()
    code, _, err = run_cli("export", src, "-o", tmp_path / "out", "--model-config", saves["config"])
    assert code == 1
    assert "model.layers.1.mlp.up_proj.weight (no exp_avg_sq)" in err and "lack optimizer state the others have" in err
    assert not (tmp_path / "out").exists()


def test_a_re_laid_out_parameter_and_a_tensor_parallel_conversion_are_refused(saves, tmp_path):
    from shardkit.checkpoint.readers.registry import read_checkpoint
    from shardkit.core.errors import CheckpointError

    src = _copy(saves, "zero2_bf16", tmp_path / "vocab") / TAG
    atom = src / "zero" / "model.embed_tokens.weight" / "fp32.pt"
    state = torch.load(atom, weights_only=False)
    torch.save({**state, "vocab_tensor": True}, atom)  # what ds_to_universal adds when it strips vocabulary padding
    with pytest.raises(CheckpointError, match=r"parameter 'model.embed_tokens.weight' carries vocab_tensor"):
        read_checkpoint("universal", src)
    src = _copy(saves, "zero3_fp32", tmp_path / "tp") / TAG
    for f in src.glob("zero_pp_rank_*_model_states.pt"):
        state = torch.load(f, weights_only=False)
        state["checkpoint_parallel_dimensions"] = {"pp_degree": 1, "tp_degree": 2}
        torch.save(state, f)
    with pytest.raises(CheckpointError, match=r"converted from a tensor-parallel run \(tp_degree 2"):
        read_checkpoint("universal", src)


def test_inspect_says_which_commands_take_it(saves, run_cli):
    import json

    code, stdout, err = run_cli("inspect", saves["zero3_bf16"][1], "--json")
    assert code == 0, err
    d = json.loads(stdout)
    assert d["format"] == "deepspeed-universal" and d["parameters"] == 20
    assert d["optimizer_state_keys"] == ["exp_avg", "exp_avg_sq"]
    applies = {c["command"]: c["applies"] for c in d["commands"]}
    assert applies == {"reshard": False, "convert --to zero1": True, "convert --to zero2": True,
                       "convert --to zero3": True, "convert --to fsdp2": True, "convert --to universal": False,
                       "consolidate": True, "export": True, "verify": True}


def load_universal_and_report(root: str, stage: int, precision: str, universal: bool = True) -> dict[str, Any] | None:
    """Rank target: a fresh engine of ``stage`` loads ``root`` (with checkpoint.load_universal, or
    DeepSpeed's plain load); rank 0 returns every trainable parameter's fp32 master and Adam moments
    as DeepSpeed's API reports them."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from shardkit.engines.deepspeed import initialize

    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                           "zero_optimization": {"stage": stage}, "steps_per_print": 10_000,
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "checkpoint": {"load_universal": universal}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine = initialize(tied_frozen_llama(), cfg)
    engine.load_checkpoint(root)
    values = {n: {"fp32": safe_get_full_fp32_param(p).clone(), "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
                  "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone()}
              for n, p in engine.module.named_parameters() if p.requires_grad}
    lr = engine.optimizer.param_groups[0]["lr"]
    return {"values": values, "lr": lr, "global_steps": engine.global_steps} if dist.get_rank() == 0 else None


@pytest.mark.parametrize("label,kind,stage,world", [("zero3_bf16", "zero3", 2, 1), ("zero1_fp32", "zero12", 3, 2)])
def test_the_universal_writer_is_loaded_by_deepspeed(saves, tmp_path, label, kind, stage, world):
    """A ZeRO-3 (or ZeRO-1) save read by its reader and written by ``writers.universal``: every file
    equals DeepSpeed's own ds_to_universal of that save, and a ZeRO-2 (ZeRO-3) engine at another world
    size loads it with load_universal, masters and moments bit-equal, lr and step carried."""
    from shardkit.checkpoint.readers.registry import read_checkpoint
    from shardkit.checkpoint.writers.universal import write_universal

    root, theirs = saves[label]
    ckpt = read_checkpoint(kind, root / TAG)
    ours = write_universal(ckpt, tmp_path / "universal", TAG)
    assert (tmp_path / "universal" / "latest_universal").read_text() == TAG
    for name in ckpt.trainable:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            held = torch.load(theirs / TAG / "zero" / name / f"{state}.pt", weights_only=False)
            held = held["param"] if isinstance(held, dict) else held
            written = torch.load(ours / "zero" / name / f"{state}.pt", weights_only=False)
            assert written["cat_dim"] == 0 and torch.equal(written["param"], held.view(written["param"].shape))
    assert read_checkpoint("universal", ours).trainable == ckpt.trainable  # shardkit reads its own output back
    got = run_ranks(load_universal_and_report, world, args=(str(tmp_path / "universal"), stage, VARIANTS[label][1]),
                    timeout=600, device="cpu")[0].value
    assert got["lr"] == 1e-2 and got["global_steps"] == 2
    assert sorted(got["values"]) == sorted(ckpt.trainable)
    for name, states in got["values"].items():
        for state, value in states.items():
            written = torch.load(ours / "zero" / name / f"{state}.pt", weights_only=False)["param"]
            assert torch.equal(value, written), (name, state)


def test_convert_to_zero3_is_loaded_by_deepspeed(saves, tmp_path, run_cli):
    """convert --to zero3 of a universal checkpoint: DeepSpeed's plain load_checkpoint of the output at
    2 ranks gives the masters and moments DeepSpeed's universal files hold, bit for bit."""
    _, uni = saves["zero2_bf16"]
    code, _, err = run_cli("convert", uni, "--to", "zero3", "--world-size", "2", "-o", tmp_path / "zero3")
    assert code == 0, err
    got = run_ranks(load_universal_and_report, 2, args=(str(tmp_path / "zero3"), 3, "bf16", False), timeout=600,
                    device="cpu")[0].value
    assert got["lr"] == 1e-2 and got["global_steps"] == 2 and len(got["values"]) == 19
    for name, states in got["values"].items():
        for state, value in states.items():
            held = torch.load(uni / TAG / "zero" / name / f"{state}.pt", weights_only=False)["param"]
            assert torch.equal(value, held), (name, state)
