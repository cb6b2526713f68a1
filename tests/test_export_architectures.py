"""`shardkit export` of the Hugging Face architectures people train beyond the tied Llama: MoE models
whose experts transformers fuses in memory and splits on disk (Mixtral, Qwen2-MoE, Qwen3-MoE), biases
(Qwen2), a frozen embedding, tied embeddings. Each is trained one step under real DeepSpeed ZeRO-3 on
2 gloo ranks (and Mixtral under FSDP2), exported, and compared with what a user gets without
shardkit: DeepSpeed's zero_to_fp32 state dict loaded into the model and written by save_pretrained."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from shardkit.run.spawn.process import run_ranks

pytestmark = pytest.mark.slow

PROMPT = [[1, 5, 9, 33, 2, 7, 11, 64]]
SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
KINDS = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen2_frozen_embedding", "llama_tied")


def build(kind: str) -> Any:
    """The tiny model of ``kind``, seeded (the same weights in every process)."""
    import transformers as tf

    torch.manual_seed(0)
    if kind == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2))
    elif kind == "qwen2_moe":  # shared expert, attention biases, 3-D fused experts
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2,
                                                         moe_intermediate_size=16, shared_expert_intermediate_size=32))
    elif kind == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2,
                                                         moe_intermediate_size=16))
    elif kind == "qwen2_frozen_embedding":  # q/k/v biases; the input embedding trained with requires_grad=False
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**SMALL, tie_word_embeddings=False))
        model.model.embed_tokens.weight.requires_grad_(False)
    elif kind == "llama_tied":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, tie_word_embeddings=True))
    else:
        raise ValueError(kind)
    return model


def zero3_train_save_all(base: str) -> dict[str, Any] | None:
    """Rank target: for every kind, one ZeRO-3 step and a save under ``base/kind``."""
    from shardkit.engines.deepspeed import initialize, train_step

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "steps_per_print": 10_000}
    for kind in KINDS:
        engine = initialize(build(kind), cfg)
        g = torch.Generator().manual_seed(dist.get_rank())
        train_step(engine, torch.randint(0, 128, (2, 8), generator=g))
        engine.save_checkpoint(str(Path(base, kind)), tag="global_step1")
    return None


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    base = tmp_path_factory.mktemp("arch")
    run_ranks(zero3_train_save_all, 2, args=(str(base / "ckpt"),), timeout=420, device="cpu")
    for kind in KINDS:
        build(kind).config.save_pretrained(base / "config" / kind)
    return base


def _reference(kind: str, root: Path, out: Path, **save: Any) -> Any:
    """zero_to_fp32's state dict in the model, written by save_pretrained (its own --safe_serialization
    refuses tied weights: "Some tensors share memory")."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    model = build(kind)
    state = get_fp32_state_dict_from_zero_checkpoint(str(root))
    model.load_state_dict(state, strict=True)
    model.save_pretrained(out, **save)
    return model


def _tensors(folder: Path) -> dict[str, tuple[str, torch.dtype, tuple[int, ...], torch.Tensor]]:
    got = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                got[k] = (f.name, t.dtype, tuple(t.shape), t)
    return got


def _assert_same_folder(out: Path, ref: Path) -> None:
    got, want = _tensors(out), _tensors(ref)
    assert want, f"save_pretrained wrote no safetensors file in {ref}"
    assert sorted(got) == sorted(want), (sorted(set(got) ^ set(want)))[:8]
    for k, (f, dtype, shape, t) in want.items():
        assert got[k][:3] == (f, dtype, shape), k
        assert torch.equal(got[k][3], t), k
    for f in ref.glob("*.safetensors"):  # same header (names, order, offsets, metadata) and bytes
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.mark.parametrize("kind", KINDS)
def test_zero3_export_equals_zero_to_fp32_plus_save_pretrained(trained, kind, tmp_path, run_cli):
    from transformers import AutoModelForCausalLM

    root, out = trained / "ckpt" / kind, tmp_path / "hf"
    code, stdout, err = run_cli("export", root, "-o", out, "--model-config", trained / "config" / kind)
    assert code == 0, err
    reference = _reference(kind, root, tmp_path / "ref")
    _assert_same_folder(out, tmp_path / "ref")
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(torch.tensor(PROMPT)).logits, reference(torch.tensor(PROMPT)).logits,
                                   rtol=0, atol=0)
    moe = kind in ("mixtral", "qwen2_moe", "qwen3_moe")
    assert ("transformers' save-time conversion: Chunk, SplitModulelist" in stdout + err) == moe
    names = set(_tensors(out))
    if kind == "mixtral":  # the fused in-memory names are gone, the per-expert file names are there
        assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in names
        assert not any("gate_up_proj" in n or ".mlp." in n for n in names)
    if moe and kind != "mixtral":
        assert "model.layers.1.mlp.experts.0.up_proj.weight" in names and not any("gate_up_proj" in n for n in names)
    if kind == "qwen2_frozen_embedding":  # the frozen embedding (frozen_param_fragments) is the untouched initial one
        assert torch.equal(loaded.model.embed_tokens.weight, build(kind).model.embed_tokens.weight)
        assert "model.layers.0.self_attn.q_proj.bias" in names
    if kind == "llama_tied":
        assert "lm_head.weight" not in names
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_mixtral_sharded_as_save_pretrained_shards_it(trained, tmp_path, run_cli):
    """save_pretrained's shard split follows the converted order (names sorted naturally, experts
    split): the same files, index and bytes."""
    root = trained / "ckpt" / "mixtral"
    code, _, err = run_cli("export", root, "-o", tmp_path / "hf", "--model-config", trained / "config" / "mixtral",
                           "--max-shard-size", "40KB", "--workers", "2")
    assert code == 0, err
    _reference("mixtral", root, tmp_path / "ref", max_shard_size="40KB")
    index = "model.safetensors.index.json"
    got, want = (json.loads((d / index).read_text()) for d in (tmp_path / "hf", tmp_path / "ref"))
    assert got["weight_map"] == want["weight_map"] and len(set(want["weight_map"].values())) > 2
    assert got["metadata"] == want["metadata"]
    _assert_same_folder(tmp_path / "hf", tmp_path / "ref")


def fsdp2_mixtral_train_save(root: str) -> dict[str, Any] | None:
    """Rank target: Mixtral under FSDP2 (the fused experts sharded along dim 0), one step, a DCP save;
    rank 0 returns the full module state dict."""
    from shardkit.checkpoint.ops.fsdp_checkpoint import full_model_state_dict, save_fsdp_checkpoint
    from shardkit.engines.fsdp import apply_fsdp, train_step

    model = build("mixtral")
    apply_fsdp(model, {"fsdp": {"wrap": ["MixtralDecoderLayer"], "mixed_precision": "none", "cpu_offload": False,
                                "pin_memory": False}})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(dist.get_rank())))
    save_fsdp_checkpoint(model, opt, root, step=1)
    state = full_model_state_dict(model)
    return state if dist.get_rank() == 0 else None


def test_fsdp2_mixtral_export_equals_save_pretrained(tmp_path, run_cli):
    from transformers import AutoModelForCausalLM

    root = tmp_path / "fsdp"
    state = run_ranks(fsdp2_mixtral_train_save, 2, args=(str(root),), timeout=300, device="cpu")[0].value
    reference = build("mixtral")
    reference.config.save_pretrained(tmp_path / "config")
    code, _, err = run_cli("export", root, "-o", tmp_path / "hf", "--model-config", tmp_path / "config")
    assert code == 0, err
    reference.load_state_dict(state, strict=True)
    reference.save_pretrained(tmp_path / "ref")
    _assert_same_folder(tmp_path / "hf", tmp_path / "ref")
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert torch.equal(loaded.model.layers[1].mlp.experts.gate_up_proj, state["model.layers.1.mlp.experts.gate_up_proj"])


# ---- the conversion alone, on one process: a byte-moving operation and an unknown one ---------------


def _pieces_of(path: Path) -> dict[str, Any]:
    """Every tensor of a safetensors file as one Piece of it (what a reader hands export)."""
    from shardkit.checkpoint.model.tensors import Piece, SourceTensor

    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return {k: SourceTensor(k, "float32", tuple(v["shape"]), [Piece(path, 8 + n + v["data_offsets"][0], 0,
                                                                      (v["data_offsets"][1] - v["data_offsets"][0]) // 4)])
            for k, v in header.items()}


def _with_mapping(monkeypatch, transforms: list[Any]) -> None:
    """The class's conversion mapping replaced (what a model type registering its own would have)."""
    import transformers.conversion_mapping as cm

    monkeypatch.setattr(cm, "get_model_conversion_mapping", lambda model, **_: [*transforms])


def test_a_transpose_is_built_in_memory_by_transformers(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file
    from transformers.core_model_loading import Transpose, WeightConverter

    from shardkit.checkpoint.ops.export.conversion import apply_conversion
    from shardkit.checkpoint.ops.export.model_spec import model_spec
    from shardkit.checkpoint.ops.export.shard_plan import Shard
    from shardkit.checkpoint.ops.export.writer import ShardJob, write_shard

    _with_mapping(monkeypatch, [WeightConverter("mlp.down_proj.weight", "mlp.down_proj.weight",
                                                operations=[Transpose(0, 1)])])
    model = build("qwen2_frozen_embedding")
    model.save_pretrained(tmp_path / "ref")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "module.safetensors")
    spec = model_spec(tmp_path / "ref")
    assert spec.conversion is not None
    written, notes = apply_conversion(spec.conversion, {k: v for k, v in _pieces_of(tmp_path / "module.safetensors").items()
                                                        if k in spec.shapes})
    assert any("2 tensor(s) are not byte ranges" in n and "Transpose" in n for n in notes), notes
    write_shard(tmp_path / "x.safetensors", ShardJob(Shard("x", tuple(written), 0), written, "float32"),
                threading.Event())
    got, want = load_file(tmp_path / "x.safetensors"), load_file(tmp_path / "ref" / "model.safetensors")
    assert list(got) == list(want) and got["model.layers.1.mlp.down_proj.weight"].shape == (64, 32)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_an_unknown_conversion_operation_is_refused_by_name(trained, tmp_path, monkeypatch, run_cli):
    from transformers.core_model_loading import ConversionOps, WeightConverter

    class Fp8Pack(ConversionOps):
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):  # pragma: no cover - never run
            return input_dict

        @property
        def reverse_op(self) -> ConversionOps:
            return self

    _with_mapping(monkeypatch, [WeightConverter("mlp.up_proj.weight", "mlp.up_proj.weight", operations=[Fp8Pack()])])
    code, _, err = run_cli("export", trained / "ckpt" / "llama_tied", "-o", tmp_path / "hf", "--model-config",
                           trained / "config" / "llama_tied")
    assert code == 1
    assert "converts 'model.layers.0.mlp.up_proj.weight' with Fp8Pack, an operation shardkit export does not" in err
    assert "nothing was written" in err and not (tmp_path / "hf").exists()
