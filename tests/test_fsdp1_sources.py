"""FSDP1 checkpoints the Trainer and Accelerate write, read as sources: real FSDP1 saves by
accelerate's own ``save_fsdp_model``/``save_fsdp_optimizer`` on 2 gloo ranks, exported and compared
with the model's and the optimizer's state at save time."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

#: label: (fsdp_state_dict_type, use_orig_params, how the optimizer is saved: "accelerate" or "ids"
#: (torch's own optimizer.state_dict(), keyed by parameter ids, as a hand-written save does), whether
#: the embedding and lm_head are tied).
FSDP1_SAVES = {
    "sharded": ("SHARDED_STATE_DICT", True, "accelerate", False),
    "sharded_flat": ("SHARDED_STATE_DICT", False, "accelerate", False),
    "full": ("FULL_STATE_DICT", False, "accelerate", False),
    "local": ("LOCAL_STATE_DICT", False, "accelerate", False),
    "sharded_ids": ("SHARDED_STATE_DICT", True, "ids", False),
    "full_ids": ("FULL_STATE_DICT", True, "ids", False),
    "sharded_tied": ("SHARDED_STATE_DICT", False, "accelerate", True),
    "full_tied": ("FULL_STATE_DICT", False, "accelerate", True),
}
EXPECTED = "expected_at_save.pt"


def save_fsdp1_checkpoints(base: str) -> dict[str, list[str]]:
    """Rank target: a tiny LlamaForCausalLM under FSDP1 (one unit per decoder layer, as accelerate's
    TRANSFORMER_BASED_WRAP wraps it), two AdamW steps, saved into ``base/<label>/checkpoint-2`` by
    accelerate's ``save_fsdp_model``/``save_fsdp_optimizer``, with the config the Trainer saves beside
    it and, by rank 0, ``expected_at_save.pt``: the full model state dict and the full, name-keyed
    optimizer state at save time (FSDP's FULL_STATE_DICT gathers), outside the checkpoint."""
    import functools

    import torch.distributed as dist
    import torch.distributed.checkpoint as dist_cp
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin, save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from shardkit.engines.model_factory import synthetic_batch, tiny_llama

    rank = dist.get_rank()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(dist.get_world_size()),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(dist.get_world_size()))
    state = PartialState(cpu=True)
    out = {}
    for label, (kind, orig_params, optim_save, tied) in FSDP1_SAVES.items():
        plugin = FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type=kind, cpu_ram_efficient_loading=False)
        saver: Any = state
        if kind == "FULL_STATE_DICT":
            # FSDP1's full gather with offload_to_cpu (what accelerate sets for more than one process)
            # fails on CPU ranks (the unsharded storage it copies from is the one it frees); gathering on
            # every rank without offload writes the same file. accelerate overrides the gather config
            # when it sees several processes, so it is shown one with this rank's index.
            plugin.state_dict_config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
            plugin.optim_state_dict_config = FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False)
            saver = SimpleNamespace(num_processes=1, process_index=rank)
        model = tiny_llama("tiny", seed=0)
        config = model.config
        if tied:
            config.tie_word_embeddings = True
            torch.manual_seed(0)
            model = type(model)(config)
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
        model = FSDP(model, use_orig_params=orig_params, auto_wrap_policy=policy, device_id=torch.device("cpu"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(2):
            ids = synthetic_batch(config.vocab_size, 2, 8, step, rank)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        folder = Path(base) / label / "checkpoint-2"
        save_fsdp_model(plugin, saver, model, str(folder))
        if optim_save == "accelerate":
            save_fsdp_optimizer(plugin, saver, opt, model, str(folder))
        elif kind == "FULL_STATE_DICT":
            if rank == 0:
                torch.save(opt.state_dict(), folder / "optimizer.bin")
        else:
            dist_cp.save({"optimizer": opt.state_dict()}, storage_writer=dist_cp.FileSystemWriter(folder / "optimizer_0"))
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False),
                                  FullOptimStateDictConfig(rank0_only=False)):
            weights = model.state_dict()
            optim = FSDP.optim_state_dict(model, opt)
        if rank == 0:
            config.save_pretrained(folder)
            torch.save({"weights": weights, "optimizer": optim}, Path(base) / label / EXPECTED)
        dist.barrier()
        out[label] = sorted(e.name + ("/" if e.is_dir() else "") for e in folder.iterdir())
    return out


def resume_fsdp2(root: str, tied: bool) -> dict[str, Any] | None:
    """Rank target: FSDP2 (one unit per decoder layer) over a differently initialized model, AdamW with
    other hyperparameters, loading ``root`` with shardkit's ``load_fsdp_checkpoint``; rank 0 returns the
    full model and optimizer state right after the load."""
    import torch.distributed as dist

    from shardkit.checkpoint.ops.fsdp_checkpoint import (
        full_model_state_dict,
        full_optimizer_state_dict,
        load_fsdp_checkpoint,
    )
    from shardkit.config.fsdp import fsdp_config_from_dict
    from shardkit.engines.fsdp import apply_fsdp
    from shardkit.engines.model_factory import tiny_llama

    cfg = fsdp_config_from_dict({"fsdp": {"wrap": ["LlamaDecoderLayer"], "mixed_precision": "none",
                                          "cpu_offload": False, "pin_memory": False}})
    model = tiny_llama("tiny", seed=1)
    if tied:
        model.config.tie_word_embeddings = True
        model = type(model)(model.config)
    model = apply_fsdp(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    load_fsdp_checkpoint(model, opt, root)
    state = {"model": full_model_state_dict(model), "optim": full_optimizer_state_dict(model, opt)}
    return state if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> Path:
    from shardkit.run.spawn.process import run_ranks

    base = tmp_path_factory.mktemp("fsdp1")
    run_ranks(save_fsdp1_checkpoints, 2, args=(str(base),), timeout=400, device="cpu")
    return base


def _expected(saves: Path, label: str) -> dict[str, Any]:
    return torch.load(saves / label / EXPECTED, weights_only=True)


def _tree(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


def _materialize(t: Any) -> torch.Tensor:
    """A SourceTensor's value from the byte ranges its reader named (or its loader)."""
    if t.load is not None:
        return t.load()
    dtype = getattr(torch, t.dtype)
    flat = torch.empty(t.numel, dtype=dtype)
    itemsize = flat.element_size()
    for p in t.pieces:
        with open(p.file, "rb") as fh:
            fh.seek(p.offset)
            raw = bytearray(fh.read(p.numel * itemsize))
        flat[p.start:p.start + p.numel] = torch.frombuffer(raw, dtype=dtype)
    return flat.reshape(t.shape)


@pytest.mark.parametrize("label", ["sharded", "sharded_flat", "full", "sharded_tied", "full_tied"])
def test_export_equals_the_model_at_save_time(saves, tmp_path, run_cli, label):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ckpt = saves / label / "checkpoint-2"
    before = _tree(ckpt)
    out = tmp_path / "hf"
    code, stdout, err = run_cli("export", ckpt, "-o", out)
    assert code == 0, err
    kind = FSDP1_SAVES[label][0]
    assert f"accelerate FSDP checkpoint {ckpt} saved with {kind}" in stdout
    assert f"source (fsdp1-{kind.split('_')[0].lower()})" in stdout
    expected = _expected(saves, label)["weights"]
    written = load_file(out / "model.safetensors")
    if FSDP1_SAVES[label][3]:  # tied: stored once, under the name save_pretrained keeps
        assert "not written, as save_pretrained leaves them out: lm_head.weight" in stdout
        expected = {k: v for k, v in expected.items() if k != "lm_head.weight"}
    assert written.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(written[name], value), name
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, value in model.state_dict().items():
        assert torch.equal(value, _expected(saves, label)["weights"][name]), name
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is FSDP1_SAVES[label][3]
    assert _tree(ckpt) == before  # the source is only read


@pytest.mark.parametrize("label", ["sharded", "sharded_flat", "full", "sharded_tied", "full_tied"])
def test_the_optimizer_state_described_is_torchs(saves, tmp_path, label):
    from shardkit.checkpoint.ops.export.sources import resolve_source
    from shardkit.checkpoint.readers.registry import read_checkpoint

    src = resolve_source(saves / label / "checkpoint-2")
    ckpt = read_checkpoint(src.kind, src.tag_dir)
    expected = _expected(saves, label)
    # FSDP1's full optimizer gather with use_orig_params=True on CPU ranks (torch 2.13) returns every exp_avg
    # equal to exp_avg_sq, so that save's moments are held against the same training with flat parameters
    moments = _expected(saves, "sharded_flat" if label == "sharded" else label)["optimizer"]["state"]
    if label.startswith("full"):
        truth = torch.load(saves / label / "checkpoint-2" / "optimizer.bin", weights_only=True)
    else:  # torch's own reading of the optimizer folder
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(saves / label / "checkpoint-2" / "optimizer_0", tmp_path / "optim.pt")
        truth = torch.load(tmp_path / "optim.pt", weights_only=True)["optimizer"]
    assert ckpt.optimizer_described and ckpt.uncovered() == []
    assert set(ckpt.optimizer) == set(truth["state"]) == set(moments) == set(ckpt.weights)
    for name, states in ckpt.optimizer.items():
        assert set(states) == {"exp_avg", "exp_avg_sq"}, name
        for key, t in states.items():
            got = _materialize(t)
            assert torch.equal(got, truth["state"][name][key]), (name, key)
            torch.testing.assert_close(got, moments[name][key], rtol=1e-6, atol=0, msg=f"{name} {key}")
    assert ckpt.scalars["step"] == {n: 2.0 for n in ckpt.weights}
    [group] = ckpt.scalars["param_groups"]
    [want] = expected["optimizer"]["param_groups"]
    assert group["params"] == want["params"] and (group["lr"], group["weight_decay"]) == (0.01, 0.1)
    assert tuple(group["betas"]) == tuple(want["betas"])
    for name, t in ckpt.weights.items():
        assert torch.equal(_materialize(t), expected["weights"][name]), name
    # a tied lm_head is the embedding's alias (its state dict lists it twice), not a frozen parameter
    tied = FSDP1_SAVES[label][3]
    assert ckpt.aliases == ({"lm_head.weight": "model.embed_tokens.weight"} if tied else {}) and ckpt.frozen == set()


@pytest.mark.parametrize("label", ["sharded_ids", "full_ids"])
def test_an_optimizer_keyed_by_ids_is_refused_by_name(saves, tmp_path, run_cli, label):
    ckpt = saves / label / "checkpoint-2"
    where = ckpt / ("optimizer_0" if label == "sharded_ids" else "optimizer.bin")
    code, _, err = run_cli("export", ckpt, "-o", tmp_path / "hf")
    assert code == 1
    assert f"{where}: the optimizer state is keyed by parameter ids (0, 1, 2, 3, ...), not by parameter names" in err
    assert "FSDP.optim_state_dict(model, optimizer)" in err and "Nothing was written" in err
    assert not (tmp_path / "hf").exists() and list(tmp_path.iterdir()) == []


def test_local_state_dict_is_refused_naming_the_fix(saves, tmp_path, run_cli):
    ckpt = saves / "local" / "checkpoint-2"
    code, _, err = run_cli("export", ckpt, "-o", tmp_path / "hf")
    assert code == 1
    assert f"{ckpt}: an FSDP Trainer checkpoint saved with LOCAL_STATE_DICT (pytorch_model_fsdp_rank0.bin" in err
    assert "FSDP saves neither which parameters were flattened into it, nor their shapes" in err
    assert "Load it with FSDP1 at the same world size and wrapping, and save again with fsdp_state_dict_type " \
           "SHARDED_STATE_DICT" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("label", ["sharded", "full", "full_tied"])
def test_convert_to_fsdp2_resumes_with_masters_and_moments(saves, tmp_path, run_cli, label):
    from shardkit.run.spawn.process import run_ranks

    ckpt = saves / label / "checkpoint-2"
    before = _tree(ckpt)
    code, stdout, err = run_cli("convert", ckpt, "--to", "fsdp2", "-o", tmp_path / "fsdp2")
    assert code == 0, err
    tied = FSDP1_SAVES[label][3]
    assert f"fsdp1-{label.split('_')[0]} -> fsdp2, {20 if tied else 21} parameters" in stdout
    assert f"carried: fp32 masters ({20 if tied else 21} trainable), exp_avg, exp_avg_sq, step" in stdout
    assert "pytorch_model_fsdp" not in stdout.split("not carried:", 1)[-1]  # what was converted is not listed as left
    if tied:
        assert "tied names (lm_head.weight)" in stdout
    got = run_ranks(resume_fsdp2, 3, args=(str(tmp_path / "fsdp2"), tied), timeout=300, device="cpu")[0].value
    expected = _expected(saves, label)
    moments = _expected(saves, "sharded_flat" if label == "sharded" else label)["optimizer"]  # see the test above
    assert got["model"].keys() == expected["weights"].keys()
    for name, value in expected["weights"].items():
        assert torch.equal(got["model"][name], value), name
    for name, states in moments["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got["optim"]["state"][name][key], states[key], rtol=1e-6, atol=0,
                                       msg=f"{name} {key}")
        assert float(got["optim"]["state"][name]["step"]) == 2.0
    [group] = got["optim"]["param_groups"]
    assert (group["lr"], group["weight_decay"]) == (0.01, 0.1)  # the saved run's, not the resuming optimizer's
    assert _tree(ckpt) == before


@pytest.mark.parametrize("label", ["sharded", "full"])
def test_consolidate_writes_the_weights_at_save_time(saves, tmp_path, run_cli, label):
    from safetensors.torch import load_file

    code, stdout, err = run_cli("consolidate", saves / label / "checkpoint-2", "-o", tmp_path / "model.safetensors")
    assert code == 0, err
    written, expected = load_file(tmp_path / "model.safetensors"), _expected(saves, label)["weights"]
    assert written.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(written[name], value), name


def test_reshard_still_refuses_an_fsdp_folder_naming_what_takes_it(saves, tmp_path, run_cli):
    ckpt = saves / "sharded" / "checkpoint-2"
    code, _, err = run_cli("reshard", ckpt, "--world-size", "3", "-o", tmp_path / "x")
    assert code == 1 and "nothing to reshard" in err
    assert "export, consolidate and convert --to fsdp2 read its SHARDED_STATE_DICT and FULL_STATE_DICT layouts" in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("damage, said", [
    ("shape", "optimizer.bin: exp_avg of 'lm_head.weight' has shape [3], the parameter [512, 64]; the optimizer and "
              "model files come from different saves"),
    ("name", "optimizer.bin: optimizer state for 'lm_head.weight.renamed', a name the model's state dict does not "
             "hold; the optimizer and model files come from different saves"),
])
def test_an_optimizer_from_another_save_is_refused_naming_the_tensor(saves, tmp_path, run_cli, damage, said):
    import shutil

    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(saves / "full" / "checkpoint-2", ckpt)
    optim = torch.load(ckpt / "optimizer.bin", weights_only=True)
    if damage == "shape":
        optim["state"]["lm_head.weight"]["exp_avg"] = torch.zeros(3)
    else:
        optim["state"]["lm_head.weight.renamed"] = optim["state"].pop("lm_head.weight")
    torch.save(optim, ckpt / "optimizer.bin")
    code, _, err = run_cli("convert", ckpt, "--to", "fsdp2", "-o", tmp_path / "fsdp2")
    assert code == 1 and f"{ckpt / said}" in err, err
    assert not (tmp_path / "fsdp2").exists()
