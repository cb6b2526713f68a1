"""accelerate's FSDP2 per-rank files, for real: a tiny Llama with tied embeddings under FSDP2 (one unit per
decoder layer and the root) on 3 gloo ranks (so most tensors split unevenly), two AdamW steps, saved by
accelerate's own ``save_fsdp_model``/``save_fsdp_optimizer`` with ``SHARDED_STATE_DICT`` and
``use_dcp=False`` (``pytorch_model_fsdp_0_rank{R}.bin`` + ``optimizer_0_rank{R}.bin``, DTensors), the
same training saved as DCP folders (the default), and an HSDP model (a 2-D mesh) saved per rank.
export and consolidate of the rank files write the same bytes as of the DCP save; ``convert --to fsdp2``
carries the masters and moments an FSDP2 model then loads at 2 ranks; a lost or extra rank file, a 2-D
mesh, any placement but Shard(0) and a file that would run code are refused, naming what is wrong.
"""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_fsdp1_sources import _materialize, _tree, resume_fsdp2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EXPECTED = "expected_at_save.pt"
WORLD = 3


def _tied_llama() -> Any:
    from shardkit.engines.model_factory import tiny_llama

    config = tiny_llama("tiny", seed=0).config
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(config)


def save_checkpoints(base: str) -> None:
    """Rank target: ``base/{bins,dcp}/checkpoint-2`` (the same FSDP2 training saved per rank and as DCP,
    with the config.json the Trainer saves), ``base/expected_at_save.pt`` (rank 0: the full model and
    optimizer state at save time) and ``base/hsdp/checkpoint-2`` (an HSDP model, mesh (1, 3), per rank)."""
    import torch.distributed as dist
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin, save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardkit.engines.model_factory import synthetic_batch

    rank = dist.get_rank()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(dist.get_world_size()),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(dist.get_world_size()))
    state = PartialState(cpu=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT",
                                            cpu_ram_efficient_loading=False)
    model = _tied_llama()
    config = model.config
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(2):
        ids = synthetic_batch(config.vocab_size, 2, 8, step, rank)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    for label, use_dcp in (("bins", False), ("dcp", True)):
        folder = Path(base) / label / "checkpoint-2"
        save_fsdp_model(plugin, state, model, str(folder), use_dcp=use_dcp)
        save_fsdp_optimizer(plugin, state, opt, model, str(folder), use_dcp=use_dcp)
        if rank == 0:
            config.save_pretrained(folder)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=full)
    optim = get_optimizer_state_dict(model, opt, options=full)
    if rank == 0:
        torch.save({"weights": weights, "optimizer": optim}, Path(base) / EXPECTED)

    hsdp = _tied_llama()
    fully_shard(hsdp, mesh=init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("replicate", "shard")))
    save_fsdp_model(plugin, state, hsdp, str(Path(base) / "hsdp" / "checkpoint-2"), use_dcp=False)
    if rank == 0:
        config.save_pretrained(Path(base) / "hsdp" / "checkpoint-2")
    dist.barrier()


def save_placements(base: str) -> None:
    """Rank target (1 rank): one ``torch.save`` per placement FSDP2 never gives a parameter, each a
    DTensor on a 1-D mesh, named like rank 0's model file of accelerate's per-rank save."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (1,))
    for label, placement in (("shard1", Shard(1)), ("replicate", Replicate()), ("partial", Partial()),
                             ("strided", _StridedShard(0, split_factor=2))):
        folder = Path(base) / label
        folder.mkdir(parents=True)
        torch.save({"w": DTensor.from_local(torch.ones(4, 6), mesh, [placement], run_check=False)},
                   folder / "pytorch_model_fsdp_0_rank0.bin")


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> Path:
    from shardkit.run.spawn.process import run_ranks

    base = tmp_path_factory.mktemp("fsdp2_bins")
    run_ranks(save_checkpoints, WORLD, args=(str(base),), timeout=400, device="cpu")
    return base


def _expected(saves: Path) -> dict[str, Any]:
    return torch.load(saves / EXPECTED, weights_only=True)


def _dcp_optimizer(saves: Path, tmp_path: Path) -> dict[str, Any]:
    """torch's own reading of the DCP save's optimizer folder (the same training)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(saves / "dcp" / "checkpoint-2" / "optimizer_0", tmp_path / "optim.pt")
    return torch.load(tmp_path / "optim.pt", weights_only=True)["optimizer"]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_the_checkpoint_read_is_torchs(saves, tmp_path):
    from shardkit.checkpoint.ops.export.sources import resolve_source
    from shardkit.checkpoint.readers.registry import read_checkpoint

    src = resolve_source(saves / "bins" / "checkpoint-2")
    assert src.kind == "fsdp2-sharded-bins"
    ckpt = read_checkpoint(src.kind, src.tag_dir)
    expected, truth = _expected(saves), _dcp_optimizer(saves, tmp_path)
    assert ckpt.world_size == WORLD and ckpt.optimizer_described and ckpt.uncovered() == []
    # the tied lm_head is listed twice in FSDP2's state dict and once in the optimizer: an alias
    assert ckpt.aliases == {"lm_head.weight": "model.embed_tokens.weight"} and ckpt.frozen == set()
    assert set(ckpt.weights) | {"lm_head.weight"} == set(expected["weights"])
    for name, t in ckpt.weights.items():
        assert torch.equal(_materialize(t), expected["weights"][name]), name
    assert set(ckpt.optimizer) == set(truth["state"]) == set(ckpt.weights)
    for name, states in ckpt.optimizer.items():
        assert set(states) == {"exp_avg", "exp_avg_sq"}, name
        for key, t in states.items():
            assert torch.equal(_materialize(t), truth["state"][name][key]), (name, key)
            assert torch.equal(_materialize(t), expected["optimizer"]["state"][name][key]), (name, key)
    uneven = ckpt.weights["model.embed_tokens.weight"].pieces  # 512 rows over 3 ranks: 171, 171, 170
    assert sorted((p.start, p.numel) for p in uneven) == [(0, 171 * 64), (171 * 64, 171 * 64), (342 * 64, 170 * 64)]


def test_export_and_consolidate_equal_those_of_the_dcp_save(saves, tmp_path, run_cli):
    for source in ("bins", "dcp"):
        code, stdout, err = run_cli("export", saves / source / "checkpoint-2", "-o", tmp_path / f"hf_{source}")
        assert code == 0, err
        code, _, err = run_cli("consolidate", saves / source / "checkpoint-2", "-o", tmp_path / f"{source}.safetensors")
        assert code == 0, err
    exported, from_dcp = _files(tmp_path / "hf_bins"), _files(tmp_path / "hf_dcp")
    assert exported.keys() == from_dcp.keys() and "model.safetensors" in exported
    for name in exported.keys() - {"shardkit_manifest.json"}:  # the manifest names its source and time
        assert exported[name] == from_dcp[name], name
    assert (tmp_path / "bins.safetensors").read_bytes() == (tmp_path / "dcp.safetensors").read_bytes()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_bins", dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, value in _expected(saves)["weights"].items():
        assert torch.equal(model.state_dict()[name], value), name


def test_convert_to_fsdp2_resumes_at_another_world_size_with_masters_and_moments(saves, tmp_path, run_cli):
    from shardkit.run.spawn.process import run_ranks

    ckpt = saves / "bins" / "checkpoint-2"
    before = _tree(ckpt)
    code, stdout, err = run_cli("convert", ckpt, "--to", "fsdp2", "-o", tmp_path / "fsdp2")
    assert code == 0, err
    assert "fsdp2-sharded-bins -> fsdp2, 20 parameters" in stdout
    assert "carried: fp32 masters (20 trainable), exp_avg, exp_avg_sq, step" in stdout
    assert "tied names (lm_head.weight)" in stdout
    got = run_ranks(resume_fsdp2, 2, args=(str(tmp_path / "fsdp2"), True), timeout=300, device="cpu")[0].value
    expected, truth = _expected(saves), _dcp_optimizer(saves, tmp_path)
    assert got["model"].keys() == expected["weights"].keys()
    for name, value in expected["weights"].items():
        assert torch.equal(got["model"][name], value), name
    assert got["optim"]["state"].keys() == truth["state"].keys()
    for name, states in truth["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["optim"]["state"][name][key], states[key]), (name, key)
        assert float(got["optim"]["state"][name]["step"]) == 2.0
    [group] = got["optim"]["param_groups"]
    assert (group["lr"], group["weight_decay"]) == (0.01, 0.1)  # the saved run's, not the resuming optimizer's
    assert _tree(ckpt) == before


@pytest.mark.parametrize("lost", ["pytorch_model_fsdp_0_rank1.bin", "optimizer_0_rank2.bin"])
def test_a_lost_rank_file_is_refused_naming_it(saves, tmp_path, run_cli, lost):
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(saves / "bins" / "checkpoint-2", ckpt)
    (ckpt / lost).unlink()
    what = "model" if lost.startswith("pytorch") else "optimizer"
    for argv in (["export", ckpt, "-o", tmp_path / "hf"], ["convert", ckpt, "--to", "fsdp2", "-o", tmp_path / "fsdp2"],
                 ["consolidate", ckpt, "-o", tmp_path / "model.safetensors"]):
        code, _, err = run_cli(*argv)
        assert code == 1, (argv, err)
        assert (f"{ckpt}: {lost} missing: the {what} was saved by 3 ranks (the DTensors' device mesh records world "
                "size 3)") in err, err
        assert "Nothing was written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


def test_a_rank_file_of_a_larger_save_is_refused_naming_it(saves, tmp_path, run_cli):
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(saves / "bins" / "checkpoint-2", ckpt)
    shutil.copy(ckpt / "optimizer_0_rank1.bin", ckpt / "optimizer_0_rank3.bin")
    code, _, err = run_cli("consolidate", ckpt, "-o", tmp_path / "model.safetensors")
    assert code == 1
    assert (f"{ckpt}: optimizer_0_rank3.bin beyond the 3 ranks the DTensors' device mesh records: files of two saves "
            "at different world sizes are mixed in one folder") in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


def test_a_two_dimensional_mesh_is_refused_naming_it(saves, tmp_path, run_cli):
    ckpt = saves / "hsdp" / "checkpoint-2"
    for argv in (["export", ckpt, "-o", tmp_path / "hf"], ["consolidate", ckpt, "-o", tmp_path / "model.safetensors"]):
        code, _, err = run_cli(*argv)
        assert code == 1, (argv, err)
        assert (f"{ckpt / 'pytorch_model_fsdp_0_rank0.bin'}: 'model.embed_tokens.weight': a DTensor on a 2-D device "
                "mesh of shape [1, 3] with placements (Replicate(), Shard(dim=0))") in err, err
        assert "HSDP" in err and "use_dcp=True" in err and "Nothing was written" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(120)
def test_placements_fsdp2_never_gives_a_parameter_are_refused_naming_them(tmp_path):
    from shardkit.checkpoint.readers.dtensor_pickle import read_dtensor_file
    from shardkit.core.errors import CheckpointError
    from shardkit.run.spawn.process import run_ranks

    run_ranks(save_placements, 1, args=(str(tmp_path),), timeout=100, device="cpu")
    for label, said in (("shard1", "placed Shard(dim=1)"), ("replicate", "placed Replicate()"),
                        ("partial", "placed Partial(reduce_op='sum')"),
                        ("strided", "placed _StridedShard(dim=0, split_factor=2)")):
        path = tmp_path / label / "pytorch_model_fsdp_0_rank0.bin"
        with pytest.raises(CheckpointError, match="with Shard\\(0\\) \\(each rank a run of whole rows\\) only") as info:
            read_dtensor_file(path, 0)
        assert f"{path}: 'w': a DTensor {said} on its 1-D device mesh" in str(info.value)


def test_a_rank_file_that_would_run_code_is_refused_and_runs_nothing(saves, tmp_path, run_cli):
    """A rank file whose pickle names FSDP2's DTensor, then calls os.system: refused before the call."""
    import pickle

    from torch.distributed.tensor import DTensor

    marker = tmp_path / "ran"

    class Hostile:
        def __reduce__(self) -> Any:
            return os.system, (f"touch {marker}",)

    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(saves / "bins" / "checkpoint-2", ckpt)
    rank_file = ckpt / "pytorch_model_fsdp_0_rank0.bin"
    rank_file.unlink()
    with zipfile.ZipFile(rank_file, "w", zipfile.ZIP_STORED) as z:
        z.writestr("pytorch_model_fsdp_0_rank0/data.pkl", pickle.dumps({"kind": DTensor, "w": Hostile()}, protocol=2))
    code, _, err = run_cli("export", ckpt, "-o", tmp_path / "hf")
    assert code == 1
    assert (f"{rank_file}: refused to load: the pickle references global 'posix.system', which is not on shardkit's "
            "allow-list of what FSDP2's per-rank state dict files contain (nothing from the file was run)") in err, err
    assert not marker.exists() and not (tmp_path / "hf").exists()
