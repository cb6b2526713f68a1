"""`shardkit export`: ZeRO-3, FSDP2/DCP and Trainer checkpoints as folders `from_pretrained` loads,
with the trained weights bit for bit (in the chosen dtype) and the same logits; sharding, tied
weights, refusals. Real DeepSpeed ZeRO-3 and FSDP2 on 2 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardkit.run.spawn.process import run_ranks
from tests import _ranks_ckpt

pytestmark = pytest.mark.slow

PROMPT = [[1, 5, 9, 33, 2, 7, 11, 64]]


def tied_llama() -> Any:
    """A tiny Llama with tie_word_embeddings (lm_head shares model.embed_tokens.weight)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def zero3_train_save(root: str, offload: bool, bf16: bool = False) -> dict[str, Any] | None:
    """Rank target: 2 ZeRO-3 steps on the tied Llama, save; rank 0 returns the gathered state dict
    (the module's own weights: bf16 ones when training in bf16) and logits."""
    import deepspeed

    from shardkit.engines.deepspeed import initialize, train_step

    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "steps_per_print": 10_000}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    engine = initialize(tied_llama(), cfg)
    for step in range(2):
        g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        train_step(engine, torch.randint(0, 128, (2, 8), generator=g))
    engine.save_checkpoint(root, tag="global_step2")
    model = engine.module
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor(PROMPT)).logits.clone()
    return {"state": state, "logits": logits} if dist.get_rank() == 0 else None


def _config_folder(model: Any, folder: Path) -> Path:
    """What --model-config points at: the config, generation config and a (word-level) tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    model.config.save_pretrained(folder)
    GenerationConfig.from_model_config(model.config).save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(model.config.vocab_size)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="w0"))).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    base = tmp_path_factory.mktemp("export_zero3")
    root = base / "ckpt"
    ref = run_ranks(zero3_train_save, 2, args=(str(root), True), timeout=300, device="cpu")[0].value
    return root, _config_folder(tied_llama(), base / "config"), ref


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    base = tmp_path_factory.mktemp("export_fsdp")
    root, export = base / "root", base / "model.safetensors"
    ref = run_ranks(_ranks_ckpt.fsdp_train_save_continue, 2, args=(str(root), str(export)), timeout=300,
                    backend="gloo")[0].value
    from shardkit.engines.model_factory import tiny_llama

    return root, _config_folder(tiny_llama("tiny"), base / "config"), ref["state"]["model"]


def _load(folder: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)


def _assert_weights(model: Any, ref: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    got = model.state_dict()
    assert got.keys() == ref.keys()
    for k, v in ref.items():
        assert got[k].dtype == dtype, k
        assert torch.equal(got[k], v.to(dtype)), k


def test_zero3_export_loads_bit_for_bit_with_the_same_logits(zero3, tmp_path, run_cli):
    root, config, ref = zero3
    out = tmp_path / "hf"
    code, stdout, err = run_cli("export", root, "-o", out, "--model-config", config)
    assert code == 0, err
    assert "LlamaForCausalLM, 20 tensors" in stdout and "model.safetensors;" in stdout
    # tied: lm_head.weight is left out, as save_pretrained leaves it out
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                    "shardkit_manifest.json", "tokenizer.json", "tokenizer_config.json"]
    assert (out / "tokenizer.json").read_bytes() == (config / "tokenizer.json").read_bytes()
    model = _load(out, torch.float32)
    _assert_weights(model, ref["state"], torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(torch.tensor(PROMPT)).logits
    torch.testing.assert_close(logits, ref["logits"], rtol=1e-5, atol=1e-5)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".shardkit-tmp-")]


def test_zero3_bf16_sharded_index(zero3, tmp_path, run_cli):
    root, config, ref = zero3
    out = tmp_path / "hf"
    code, stdout, err = run_cli("export", root / "global_step2", "-o", out, "--model-config", config,
                                "--dtype", "bf16", "--max-shard-size", "20KB", "--workers", "3")
    assert code == 0, err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert all((out / s).stat().st_size <= 20_000 + 4096 for s in shards)
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for k, v in ref["state"].items() if k != "lm_head.weight")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    _assert_weights(_load(out, torch.bfloat16), ref["state"], torch.bfloat16)


def test_zero3_bf16_training_exports_the_modules_bf16_weights_bit_for_bit(tmp_path, run_cli):
    root = tmp_path / "ckpt"
    ref = run_ranks(zero3_train_save, 2, args=(str(root), False, True), timeout=300, device="cpu")[0].value
    assert all(v.dtype == torch.bfloat16 for v in ref["state"].values())
    config = _config_folder(tied_llama(), tmp_path / "config")
    code, stdout, err = run_cli("export", root, "-o", tmp_path / "hf", "--model-config", config, "--dtype", "bf16")
    assert code == 0, err
    assert "bf16 training): fp32 masters exported" in stdout
    _assert_weights(_load(tmp_path / "hf", torch.bfloat16), ref["state"], torch.bfloat16)


def test_zero3_at_another_world_size(zero3, tmp_path, run_cli):
    """The same weights from the checkpoint resharded to 3 ranks (other partition boundaries)."""
    root, config, ref = zero3
    assert run_cli("reshard", root, "--world-size", "3", "-o", tmp_path / "ws3")[0] == 0
    code, stdout, err = run_cli("export", tmp_path / "ws3", "-o", tmp_path / "hf", "--model-config", config)
    assert code == 0, err
    assert "saved by 3 rank(s)" in stdout and "sizes and content digests (blake3 or sha256, as its manifest lists them) match its manifest" in stdout
    _assert_weights(_load(tmp_path / "hf", torch.float32), ref["state"], torch.float32)


def test_same_split_as_save_pretrained(zero3, tmp_path, run_cli):
    root, config, ref = zero3
    out = tmp_path / "hf"
    assert run_cli("export", root, "-o", out, "--model-config", config, "--max-shard-size", "20KB")[0] == 0
    model = tied_llama()  # a fresh model holding the trained weights (a loaded one's tensors share mmap storages)
    model.load_state_dict(ref["state"])
    model.save_pretrained(tmp_path / "theirs", max_shard_size="20KB")
    ours = json.loads((out / "model.safetensors.index.json").read_text())
    theirs = json.loads((tmp_path / "theirs" / "model.safetensors.index.json").read_text())
    assert ours == theirs
    for shard in set(ours["weight_map"].values()):
        assert (out / shard).read_bytes() == (tmp_path / "theirs" / shard).read_bytes(), shard


def test_fsdp2_dcp_export(fsdp, tmp_path, run_cli):
    root, config, ref = fsdp
    out = tmp_path / "hf"
    code, stdout, err = run_cli("export", root, "-o", out, "--model-config", config, "--dtype", "fp16")
    assert code == 0, err
    assert "(dcp)" in stdout
    _assert_weights(_load(out, torch.float16), ref, torch.float16)


def test_refusals(zero3, tmp_path, run_cli):
    root, config, _ = zero3
    code, _, err = run_cli("export", root, "-o", tmp_path / "a")
    assert code == 2 and "no config.json found" in err and "--model-config DIR" in err
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    code, _, err = run_cli("export", root, "-o", taken, "--model-config", config)
    assert code == 2 and "was not written by shardkit export" in err and "never replaced" in err
    assert (taken / "notes.txt").read_text() == "mine"
    ours = tmp_path / "ours"
    assert run_cli("export", root, "-o", ours, "--model-config", config)[0] == 0
    code, _, err = run_cli("export", root, "-o", ours, "--model-config", config)
    assert code == 2 and "already holds a shardkit export; pass --force" in err
    assert run_cli("export", root, "-o", ours, "--model-config", config, "--force", "--dtype", "bf16")[0] == 0
    assert json.loads((ours / "config.json").read_text())["dtype"] == "bfloat16"
    code, _, err = run_cli("export", root, "-o", tmp_path / "b", "--model-config", config, "--max-shard-size", "5XB")
    assert code == 2 and "--max-shard-size '5XB'" in err
    code, _, err = run_cli("export", root, "-o", root / "hf", "--model-config", config)
    assert code == 2 and "is inside the checkpoint being read" in err and not (root / "hf").exists()


def test_missing_rank_file_and_wrong_config(zero3, tmp_path, run_cli):
    import shutil

    from shardkit.engines.model_factory import tiny_llama

    root, config, _ = zero3
    broken = tmp_path / "broken"
    shutil.copytree(root, broken)
    victim = broken / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.unlink()
    code, _, err = run_cli("export", broken, "-o", tmp_path / "x", "--model-config", config)
    assert code == 1 and f"{victim}: missing" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()
    other = tmp_path / "other_config"
    tiny_llama("tiny").config.save_pretrained(other)
    code, _, err = run_cli("export", root, "-o", tmp_path / "y", "--model-config", other)
    assert code == 1 and "does not match the model config (LlamaForCausalLM)" in err
    assert "shape differs" in err and "model.embed_tokens.weight: [128, 32] in the checkpoint, [512, 64]" in err
    assert not (tmp_path / "y").exists()


# ---- Hugging Face Trainer checkpoints -------------------------------------------------------------


def fsdp_trainer_save(folder: str) -> dict[str, Any] | None:
    """Rank target: the tied Llama under FSDP2 (``fully_shard``), one AdamW step, saved into ``folder``
    (a checkpoint-N) by accelerate's ``save_fsdp_model``/``save_fsdp_optimizer`` with
    SHARDED_STATE_DICT, as the Trainer saves FSDP (its Accelerator refuses FSDP without a GPU: the
    save functions are called with a ``PartialState`` over this process group, as
    tests/test_trainer_checkpoint.py does), with the config files the Trainer writes beside them.
    Rank 0 returns the full state dict and the logits of PROMPT."""
    import os

    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin, save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()),
                      LOCAL_RANK=str(dist.get_rank()), LOCAL_WORLD_SIZE=str(dist.get_world_size()))
    state = PartialState(cpu=True)
    model = tied_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, 128, (2, 8), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT",
                                            cpu_ram_efficient_loading=False)
    save_fsdp_model(plugin, state, model, folder)
    save_fsdp_optimizer(plugin, state, opt, model, folder)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor(PROMPT)).logits.clone()
    if dist.get_rank() != 0:
        return None
    _config_folder(tied_llama(), Path(folder))
    return {"state": {k: v.clone() for k, v in full.items()}, "logits": logits}


def test_fsdp_trainer_checkpoint(tmp_path, run_cli):
    ckpt = tmp_path / "out" / "checkpoint-2"
    ref = run_ranks(fsdp_trainer_save, 2, args=(str(ckpt),), timeout=300, device="cpu")[0].value
    assert (ckpt / "pytorch_model_fsdp_0" / ".metadata").is_file()
    out = tmp_path / "hf"
    code, stdout, err = run_cli("export", tmp_path / "out", "-o", out)  # the output_dir: its newest checkpoint-N
    assert code == 0, err
    assert "exporting checkpoint-2, its newest checkpoint" in stdout
    assert "not written, as save_pretrained leaves them out: lm_head.weight" in stdout
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    model = _load(out, torch.float32)
    _assert_weights(model, ref["state"], torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model(torch.tensor(PROMPT)).logits, ref["logits"], rtol=1e-5, atol=1e-5)


def test_deepspeed_trainer_checkpoint(tmp_path, run_cli):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from tests.test_trainer_checkpoint import _torchrun

    _torchrun(2, ["--out", str(tmp_path / "run"), "--max-steps", "2", "--save-steps", "2"], tmp_path / "log")
    ckpt = tmp_path / "run" / "checkpoint-2"
    out = tmp_path / "hf"
    code, stdout, err = run_cli("export", ckpt, "-o", out, "--dtype", "bf16")
    assert code == 0, err
    assert "saved by 2 rank(s)" in stdout and "copied config.json, generation_config.json" in stdout
    assert "has no shardkit_manifest.json" in err  # a Trainer's own save cannot be verified, and says so
    ref = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))  # DeepSpeed's own reading of the trained weights
    model = _load(out, torch.bfloat16)
    _assert_weights(model, ref, torch.bfloat16)
    from transformers import AutoConfig, AutoModelForCausalLM

    # the trained weights in a model built the way from_pretrained builds it (bf16 parameters, fp32 rotary buffers)
    trained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt), dtype=torch.bfloat16).eval()
    trained.load_state_dict(ref)  # copies cast to the parameters' bf16
    with torch.no_grad():
        assert torch.equal(model(torch.tensor(PROMPT)).logits, trained(torch.tensor(PROMPT)).logits)


def test_sigterm_mid_write_leaves_nothing(zero3, tmp_path, python_exe):
    """SIGTERM while the writer threads run: exit 143, the staging folder removed, no output."""
    import subprocess

    root, config, _ = zero3
    out = tmp_path / "hf"
    code = (
        "import os, signal, sys\n"
        "import shardkit.checkpoint.ops.export.writer as w\n"
        "import itertools\n"
        "real, calls = w.write_shard, itertools.count()\n"
        "def first_then_term(path, job, stop):\n"
        "    n = real(path, job, stop)\n"
        "    if next(calls) == 0:  # one SIGTERM (next() is atomic), after the first shard file is complete\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return n\n"
        "w.write_shard = first_then_term\n"
        "from shardkit.cli import main\n"
        f"sys.exit(main(['export', {str(root)!r}, '-o', {str(out)!r}, '--model-config', {str(config)!r}, "
        "'--max-shard-size', '20KB', '--workers', '2']))\n"
    )
    proc = subprocess.run([python_exe, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 143, proc.stderr
    assert "terminated (SIGTERM); nothing was published" in proc.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


# ---- PEFT adapters --------------------------------------------------------------------------------


def lora_config() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def zero3_lora_train_save(root: str) -> dict[str, Any] | None:
    """Rank target: LoRA on the tied Llama under ZeRO-3 (base weights frozen), 2 steps, saved with the
    adapter_config.json beside the DeepSpeed root; rank 0 returns the adapter state dict (as
    get_peft_model_state_dict names it) and the logits of PROMPT."""
    import deepspeed
    from peft import get_peft_model, get_peft_model_state_dict

    from shardkit.engines.deepspeed import initialize, train_step

    model = get_peft_model(tied_llama(), lora_config())
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "steps_per_print": 10_000}
    engine = initialize(model, cfg)
    for step in range(2):
        g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        train_step(engine, torch.randint(0, 128, (2, 8), generator=g))
    engine.save_checkpoint(root, tag="global_step2")
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(PROMPT)).logits.clone()
    if dist.get_rank() != 0:
        return None
    model.peft_config["default"].save_pretrained(root)
    return {"adapter": adapter, "logits": logits}


def test_zero3_lora_adapter_export(tmp_path, run_cli):
    pytest.importorskip("peft")
    from peft import PeftModel

    root = tmp_path / "ckpt"
    ref = run_ranks(zero3_lora_train_save, 2, args=(str(root),), timeout=300, device="cpu")[0].value
    config = _config_folder(tied_llama(), tmp_path / "base")
    out = tmp_path / "adapter"
    code, stdout, err = run_cli("export", root, "-o", out, "--model-config", config)
    assert code == 0, err
    assert "PEFT LORA adapter: 8 tensors written as adapter_model.safetensors" in stdout
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                    "generation_config.json", "shardkit_manifest.json",
                                                    "tokenizer.json", "tokenizer_config.json"]
    from safetensors.torch import load_file

    saved = load_file(out / "adapter_model.safetensors")
    assert saved.keys() == ref["adapter"].keys()
    for k, v in ref["adapter"].items():
        assert torch.equal(saved[k], v), k
    model = PeftModel.from_pretrained(tied_llama(), out).eval()  # the same base weights (seed 0)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=torch.tensor(PROMPT)).logits, ref["logits"], rtol=1e-5, atol=1e-5)
    # without the adapter's config the export is refused, naming what to pass
    bare = tmp_path / "bare"
    import shutil

    shutil.copytree(root, bare, ignore=shutil.ignore_patterns("adapter_config.json"))
    code, _, err = run_cli("export", bare, "-o", tmp_path / "x", "--model-config", config)
    assert code == 1 and "holds PEFT adapter tensors" in err and "--model-config DIR holding adapter_config.json" in err


def test_zero3_frozen_parameters_are_read_from_every_ranks_fragments(tmp_path):
    """The LoRA run's base weights are ZeRO-3 frozen parameters (frozen_param_fragments, one per rank):
    streamed with a cast, they equal the untouched initial weights."""
    pytest.importorskip("peft")
    import threading

    from safetensors.torch import load_file

    from shardkit.checkpoint.ops.export.shard_plan import Shard
    from shardkit.checkpoint.ops.export.writer import ShardJob, write_shard
    from shardkit.checkpoint.readers.zero3 import read_zero3

    root = tmp_path / "ckpt"
    run_ranks(zero3_lora_train_save, 2, args=(str(root),), timeout=300, device="cpu")
    z = read_zero3(root / "global_step2")
    base = tied_llama().state_dict()
    frozen = {n.removeprefix("base_model.model.").replace(".base_layer", ""): t for n, t in z.weights.items()
              if "lora_" not in n}
    assert sorted(frozen) == sorted(k for k in base if k != "lm_head.weight")
    assert all(len(t.pieces) == 2 for t in frozen.values())  # one fragment per rank
    job = ShardJob(Shard("f.safetensors", tuple(frozen), 0), frozen, "bfloat16")
    write_shard(tmp_path / "f.safetensors", job, threading.Event())
    got = load_file(tmp_path / "f.safetensors")
    for k, t in got.items():
        assert torch.equal(t, base[k].to(torch.bfloat16)), k
