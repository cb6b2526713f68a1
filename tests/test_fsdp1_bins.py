"""accelerate's FSDP1 per-rank files, for real: a tiny Llama under FSDP1 on 2 gloo ranks, two AdamW
steps, saved by accelerate's own ``save_fsdp_model``/``save_fsdp_optimizer`` with
``SHARDED_STATE_DICT`` and ``use_dcp=False`` (``pytorch_model_fsdp_0_rank{R}.bin`` +
``optimizer_0_rank{R}.bin``, with and without ``use_orig_params``), the same model saved as DCP
folders (the default), and with ``LOCAL_STATE_DICT``. export and consolidate of the per-rank files
write the same bytes as of the DCP save; ``convert --to fsdp2`` carries the masters and moments an
FSDP2 model then loads; a lost rank file and LOCAL_STATE_DICT are refused, naming what is missing.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_fsdp1_sources import resume_fsdp2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

#: label: (fsdp_state_dict_type, use_dcp, use_orig_params)
SAVES = {
    "bins": ("SHARDED_STATE_DICT", False, True),
    "bins_flat": ("SHARDED_STATE_DICT", False, False),
    "dcp": ("SHARDED_STATE_DICT", True, True),
    "local": ("LOCAL_STATE_DICT", True, False),
}
EXPECTED = "expected_at_save.pt"


def save_checkpoints(base: str) -> None:
    """Rank target: each label's save into ``base/<label>/checkpoint-2`` (with the model's config.json,
    as the Trainer saves it) and, by rank 0, the full state dict and name-keyed optimizer state at save
    time (FSDP's FULL_STATE_DICT gathers) in ``base/<label>/expected_at_save.pt``."""
    import torch.distributed as dist
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
    for label, (kind, use_dcp, orig_params) in SAVES.items():
        plugin = FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type=kind, cpu_ram_efficient_loading=False)
        model = tiny_llama("tiny", seed=0)
        config = model.config
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
        model = FSDP(model, use_orig_params=orig_params, auto_wrap_policy=policy, device_id=torch.device("cpu"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(2):
            ids = synthetic_batch(config.vocab_size, 2, 8, step, rank)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        folder = Path(base) / label / "checkpoint-2"
        save_fsdp_model(plugin, state, model, str(folder), use_dcp=use_dcp)
        save_fsdp_optimizer(plugin, state, opt, model, str(folder), use_dcp=use_dcp)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False),
                                  FullOptimStateDictConfig(rank0_only=False)):
            weights = model.state_dict()
            optim = FSDP.optim_state_dict(model, opt)
        if rank == 0:
            config.save_pretrained(folder)
            torch.save({"weights": weights, "optimizer": optim}, Path(base) / label / EXPECTED)
        dist.barrier()


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> Path:
    from shardkit.run.spawn.process import run_ranks

    base = tmp_path_factory.mktemp("fsdp1_bins")
    run_ranks(save_checkpoints, 2, args=(str(base),), timeout=400, device="cpu")
    return base


def _expected(saves: Path, label: str) -> dict[str, Any]:
    return torch.load(saves / label / EXPECTED, weights_only=True)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("label", ["bins", "bins_flat"])
def test_export_and_consolidate_of_the_rank_files_equal_those_of_the_dcp_save(saves, tmp_path, run_cli, label):
    for source in (label, "dcp"):
        code, stdout, err = run_cli("export", saves / source / "checkpoint-2", "-o", tmp_path / f"hf_{source}")
        assert code == 0, err
        code, _, err = run_cli("consolidate", saves / source / "checkpoint-2", "-o", tmp_path / f"{source}.safetensors")
        assert code == 0, err
    exported, from_dcp = _files(tmp_path / f"hf_{label}"), _files(tmp_path / "hf_dcp")
    assert exported.keys() == from_dcp.keys() and "model.safetensors" in exported
    for name in exported.keys() - {"shardkit_manifest.json"}:  # the manifest names its source and time
        assert exported[name] == from_dcp[name], name
    assert (tmp_path / f"{label}.safetensors").read_bytes() == (tmp_path / "dcp.safetensors").read_bytes()

    from safetensors.torch import load_file

    written, expected = load_file(tmp_path / f"{label}.safetensors"), _expected(saves, label)["weights"]
    assert written.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(written[name], value), name


@pytest.mark.parametrize("label", ["bins", "bins_flat"])
def test_convert_to_fsdp2_carries_the_masters_and_moments(saves, tmp_path, run_cli, label):
    from shardkit.run.spawn.process import run_ranks

    ckpt = saves / label / "checkpoint-2"
    before = _files(ckpt)
    code, stdout, err = run_cli("convert", ckpt, "--to", "fsdp2", "-o", tmp_path / "fsdp2")
    assert code == 0, err
    assert "fsdp1-sharded-bins -> fsdp2, 21 parameters" in stdout
    assert "carried: fp32 masters (21 trainable), exp_avg, exp_avg_sq, step" in stdout
    got = run_ranks(resume_fsdp2, 3, args=(str(tmp_path / "fsdp2"), False), timeout=300, device="cpu")[0].value
    expected = _expected(saves, label)
    assert got["model"].keys() == expected["weights"].keys()
    for name, value in expected["weights"].items():
        assert torch.equal(got["model"][name], value), name
    # the same training saved as DCP, read by torch: the source's moments for use_orig_params=True (FSDP1's
    # full optimizer gather, in expected_at_save.pt, returns exp_avg equal to exp_avg_sq there on CPU ranks,
    # torch 2.13); with flat parameters that gather is right and is the source's
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(saves / "dcp" / "checkpoint-2" / "optimizer_0", tmp_path / "optim.pt")
    from_dcp = torch.load(tmp_path / "optim.pt", weights_only=True)["optimizer"]["state"]
    source = from_dcp if label == "bins" else expected["optimizer"]["state"]
    assert got["optim"]["state"].keys() == source.keys() == expected["weights"].keys()
    for name, states in source.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["optim"]["state"][name][key], states[key]), (name, key)
            torch.testing.assert_close(got["optim"]["state"][name][key], from_dcp[name][key], rtol=1e-6, atol=0)
        assert float(got["optim"]["state"][name]["step"]) == 2.0
    [group] = got["optim"]["param_groups"]
    assert (group["lr"], group["weight_decay"]) == (0.01, 0.1)  # the saved run's, not the resuming optimizer's
    assert _files(ckpt) == before


@pytest.mark.parametrize("lost", ["pytorch_model_fsdp_0_rank1.bin", "optimizer_0_rank0.bin"])
def test_a_lost_rank_file_is_refused_naming_it(saves, tmp_path, run_cli, lost):
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(saves / "bins" / "checkpoint-2", ckpt)
    (ckpt / lost).unlink()
    what = "model" if lost.startswith("pytorch") else "optimizer"
    for argv in (["export", ckpt, "-o", tmp_path / "hf"], ["convert", ckpt, "--to", "fsdp2", "-o", tmp_path / "fsdp2"],
                 ["consolidate", ckpt, "-o", tmp_path / "model.safetensors"]):
        code, _, err = run_cli(*argv)
        assert code == 1, (argv, err)
        assert f"{ckpt}: {lost} missing: the {what} was saved by 2 ranks" in err, err
        assert "Nothing was written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


def test_local_state_dict_is_refused_saying_what_the_files_lack(saves, tmp_path, run_cli):
    ckpt = saves / "local" / "checkpoint-2"
    for argv in (["export", ckpt, "-o", tmp_path / "hf"], ["convert", ckpt, "--to", "fsdp2", "-o", tmp_path / "fsdp2"],
                 ["consolidate", ckpt, "-o", tmp_path / "model.safetensors"]):
        code, _, err = run_cli(*argv)
        assert code == 1, (argv, err)
        assert "LOCAL_STATE_DICT" in err and "pytorch_model_fsdp_rank0.bin" in err, err
        assert ("FSDP saves neither which parameters were flattened into it, nor their shapes, nor the alignment "
                "padding between them") in err, err
        assert "Load it with FSDP1 at the same world size and wrapping, and save again with fsdp_state_dict_type " \
               "SHARDED_STATE_DICT" in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_rank_file_of_a_larger_save_is_refused_naming_it(saves, tmp_path, run_cli):
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(saves / "bins" / "checkpoint-2", ckpt)
    shutil.copy(ckpt / "pytorch_model_fsdp_0_rank1.bin", ckpt / "pytorch_model_fsdp_0_rank2.bin")
    code, _, err = run_cli("export", ckpt, "-o", tmp_path / "hf")
    assert code == 1
    assert (f"{ckpt}: pytorch_model_fsdp_0_rank2.bin beyond the 2 ranks the ShardedTensor metadata records: files of "
            "two saves at different world sizes are mixed in one folder") in err, err
    assert not (tmp_path / "hf").exists()


def test_inspect_says_which_commands_take_each_layout(saves, run_cli):
    import json

    for label, applies in (("bins", True), ("bins_flat", True), ("local", False)):
        code, stdout, err = run_cli("inspect", saves / label / "checkpoint-2", "--json")
        assert code == 0, err
        d = json.loads(stdout)
        said = {c["command"]: (c["applies"], c["why"]) for c in d["commands"]}
        assert said["reshard"][0] is False
        assert {c: said[c][0] for c in ("convert --to fsdp2", "convert --to zero3", "consolidate", "export")} == \
            dict.fromkeys(("convert --to fsdp2", "convert --to zero3", "consolidate", "export"), applies), said
        if not applies:
            assert "FSDP saves neither which parameters were flattened into it" in said["export"][1]
