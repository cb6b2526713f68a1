"""``convert --to zero3`` from any reader that describes the optimizer (``writers.zero3``), on real
engines: a 2-rank ZeRO-2 save (tests/_ranks_zero12_sources.py: Qwen2 fp32 with biases and two param
groups; a tied Llama in bf16 with two param groups) -> ``convert --to zero3 --world-size 3`` ->
DeepSpeed ZeRO-3 on 3 ranks loads it with its plain ``engine.load_checkpoint``, and its own API
(``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``) gives fp32 masters and both Adam
moments bit-equal, by parameter name, to the ZeRO-2 engine's own at save time; -> ``convert --to
fsdp2`` of that ZeRO-3 output: the DCP checkpoint's masters and moments (read through the DCP reader,
which now describes the optimizer) are still bit-equal. A source whose reader describes weights only
is refused by name with nothing written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import _ranks_zero12_sources as S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parent.parent
VARIANTS = {label: S.VARIANTS[label] for label in ("zero2", "zero2_tied_bf16")}
NEW_WORLD = 3


def zero3_config(dtype: str) -> dict[str, Any]:
    """The resuming ZeRO-3 run's config at NEW_WORLD ranks (the source's optimizer and precision)."""
    cfg = S.ds_config(3, dtype, False, NEW_WORLD)
    cfg.update(train_batch_size=NEW_WORLD, train_micro_batch_size_per_gpu=1)
    return cfg


def load_zero3(ckpt: str, label: str) -> dict[str, Any] | None:
    """Rank target: the source's model and param groups under ZeRO-3 at this world size, plain
    ``engine.load_checkpoint(ckpt)``, then DeepSpeed's own full masters, moments and steps."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    _, dtype, _, kind, groups = VARIANTS[label]
    model = S.build_model(kind)
    deepspeed.init_distributed(dist_backend=None, auto_mpi_discovery=False)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=S._param_groups(model, groups),
                                      config=zero3_config(dtype))
    path, _ = engine.load_checkpoint(ckpt)
    if path is None:
        raise RuntimeError(f"engine.load_checkpoint({ckpt!r}) loaded nothing")
    out: dict[str, Any] = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            out[name] = {"fp32": safe_get_full_fp32_param(p).detach().cpu().clone(),
                         **{k: safe_get_full_optimizer_state(p, k).detach().cpu().clone()
                            for k in ("exp_avg", "exp_avg_sq")}}
    opt = engine.optimizer
    steps = sorted({float(opt.optimizer.state[f]["step"]) for f in opt.fp32_partitioned_groups_flat})
    groups_seen = [{k: g[k] for k in ("lr", "weight_decay")} for g in opt.optimizer.param_groups]
    return {"tensors": out, "steps": steps, "groups": groups_seen} if dist.get_rank() == 0 else None


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _read(t: Any) -> torch.Tensor:
    """A SourceTensor's value, read from its pieces' bytes alone."""
    flat = torch.empty(t.numel, dtype=getattr(torch, t.dtype))
    for p in t.pieces:
        with open(p.file, "rb") as fh:
            fh.seek(p.offset)
            data = bytearray(fh.read(p.numel * flat.element_size()))
        flat[p.start:p.start + p.numel] = torch.frombuffer(data, dtype=flat.dtype)
    return flat.view(t.shape)


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardkit.checkpoint.ops.convert.to_dcp import convert_to_dcp
    from shardkit.checkpoint.ops.convert.to_zero3 import convert_to_zero3
    from shardkit.run.spawn.process import run_ranks

    base = tmp_path_factory.mktemp("zero3_writer")
    run_ranks(S.save_all, 2, args=(str(base / "zero2"), VARIANTS), timeout=600, device="cpu")
    out: dict[str, Any] = {"base": base, "converted": {}, "loaded": {}, "dcp": {}}
    for label, (_, dtype, *_rest) in VARIANTS.items():
        src, dst = base / "zero2" / label, base / "zero3" / label
        cfg = base / f"{label}.json"
        cfg.write_text(json.dumps(zero3_config(dtype)))
        if label == "zero2":  # through the CLI: exit 0, the ZeRO-2 source named in the summary
            done = subprocess.run([sys.executable, "-m", "shardkit", "convert", str(src), "--to", "zero3",
                                   "--world-size", str(NEW_WORLD), "--ds-config", str(cfg), "-o", str(dst)],
                                  capture_output=True, text=True, timeout=300, cwd=REPO)
            assert done.returncode == 0, done.stderr[-3000:]
            out["converted"][label] = done.stdout
        else:
            out["converted"][label] = convert_to_zero3(src, dst, world_size=NEW_WORLD, ds_config=cfg)
        results = run_ranks(load_zero3, NEW_WORLD, args=(str(dst), label), timeout=600, device="cpu")
        out["loaded"][label] = results[0].value
        out["dcp"][label] = convert_to_dcp(dst, base / "dcp" / label)
    return out


@pytest.mark.parametrize("label", list(VARIANTS))
def test_zero2_to_zero3_loads_with_masters_and_moments_bit_equal(chain, label):
    reference = torch.load(chain["base"] / "zero2" / label / "reference.pt", weights_only=True)
    loaded = chain["loaded"][label]
    assert sorted(loaded["tensors"]) == sorted(reference)
    for name, states in reference.items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            got = loaded["tensors"][name][key]
            assert got.dtype == torch.float32 and got.shape == states[key].shape, (name, key)
            assert torch.equal(_bits(got), _bits(states[key])), (label, name, key)
    assert loaded["steps"] == [2.0]
    groups = VARIANTS[label][4]
    assert [g["weight_decay"] for g in loaded["groups"]] == ([0.01, 0.0] if groups == 2 else [0.01])
    assert all(g["lr"] == 1e-2 for g in loaded["groups"])
    tag = chain["base"] / "zero3" / label / S.TAG
    prefix = "bf16_" if VARIANTS[label][1] == "bf16" else ""
    assert sorted(p.name for p in tag.glob("*_optim_states.pt")) == [
        f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(NEW_WORLD)]


def test_the_cli_names_the_zero2_source_and_the_byte_route(chain):
    stdout = chain["converted"]["zero2"]
    assert f"wrote {chain['base'] / 'zero3' / 'zero2' / S.TAG}" in stdout and ": zero2 -> zero3," in stdout, stdout
    assert "written through torch" not in stdout, stdout


@pytest.mark.parametrize("label", list(VARIANTS))
def test_zero3_output_converts_on_to_fsdp2_still_bit_equal(chain, label):
    from shardkit.checkpoint.readers.dcp import read_dcp

    reference = torch.load(chain["base"] / "zero2" / label / "reference.pt", weights_only=True)
    r = chain["dcp"][label]
    ckpt = read_dcp(r.output / r.tag)
    assert ckpt.optimizer_described and sorted(ckpt.optimizer) == sorted(reference)
    for name, states in reference.items():
        assert torch.equal(_bits(_read(ckpt.weights[name])), _bits(states["fp32"])), (label, name)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_bits(_read(ckpt.optimizer[name][key])), _bits(states[key])), (label, name, key)
    assert set(ckpt.scalars["step"].values()) == {2.0}
    if VARIANTS[label][3] == "llama_tied":
        assert ckpt.aliases == {"lm_head.weight": "model.embed_tokens.weight"}


@pytest.fixture(scope="module")
def universal(chain: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's ds_to_universal of the fp32 ZeRO-2 save -> convert --to zero3 at 3 ranks -> loaded."""
    from shardkit.checkpoint.ops.convert.to_zero3 import convert_to_zero3
    from shardkit.run.spawn.process import run_ranks

    base, label = chain["base"], "zero2"
    uni = base / "universal" / label / S.TAG
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    str(base / "zero2" / label / S.TAG), "--output_folder", str(uni), "--num_extract_workers", "1",
                    "--num_merge_workers", "1", "--inject_missing_state"], check=True, capture_output=True, timeout=300)
    dst = base / "zero3_from_universal"
    result = convert_to_zero3(uni, dst, world_size=NEW_WORLD, ds_config=zero3_config("fp32"))
    loaded = run_ranks(load_zero3, NEW_WORLD, args=(str(dst), label), timeout=600, device="cpu")[0].value
    return {"result": result, "loaded": loaded}


def test_a_universal_checkpoint_converts_to_zero3_bit_equal(chain, universal):
    """ds_to_universal output is a source too: the ZeRO-3 files it becomes load with the ZeRO-2 run's masters and moments."""
    reference = torch.load(chain["base"] / "zero2" / "zero2" / "reference.pt", weights_only=True)
    loaded = universal["loaded"]
    assert universal["result"].source_engine == "universal" and sorted(loaded["tensors"]) == sorted(reference)
    for name, states in reference.items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(_bits(loaded["tensors"][name][key]), _bits(states[key])), (name, key)
    assert loaded["steps"] == [2.0]


def load_llama_zero3(ckpt: str) -> dict[str, Any] | None:
    """Rank target: tests/test_fsdp1_sources.py's tiny Llama and AdamW group under ZeRO-3 (fp32) at this
    world size, plain ``engine.load_checkpoint(ckpt)``, then DeepSpeed's own full masters and moments."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from shardkit.engines.model_factory import tiny_llama

    model = tiny_llama("tiny", seed=0)
    deepspeed.init_distributed(dist_backend=None, auto_mpi_discovery=False)
    cfg = {"train_batch_size": NEW_WORLD, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10_000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}, "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    path, _ = engine.load_checkpoint(ckpt)
    if path is None:
        raise RuntimeError(f"engine.load_checkpoint({ckpt!r}) loaded nothing")
    out = {name: {"fp32": safe_get_full_fp32_param(p).detach().cpu().clone(),
                  **{k: safe_get_full_optimizer_state(p, k).detach().cpu().clone() for k in ("exp_avg", "exp_avg_sq")}}
           for name, p in engine.module.named_parameters()}
    return out if dist.get_rank() == 0 else None


@pytest.mark.parametrize("label", ["sharded", "full"])
def test_fsdp1_trainer_saves_convert_to_zero3_bit_equal(tmp_path_factory, label):
    """Accelerate's FSDP1 SHARDED_STATE_DICT (pytorch_model_fsdp_0/ + optimizer_0/) and FULL_STATE_DICT
    (pytorch_model_fsdp.bin + optimizer.bin) saves -> ZeRO-3 at 3 ranks: DeepSpeed loads the weights and
    both Adam moments FSDP held at save time, bit for bit, by name."""
    from shardkit.checkpoint.ops.convert.to_zero3 import convert_to_zero3
    from shardkit.run.spawn.process import run_ranks
    from tests.test_fsdp1_sources import EXPECTED, save_fsdp1_checkpoints

    base = tmp_path_factory.getbasetemp() / "zero3_writer_fsdp1"
    if not (base / label / EXPECTED).is_file():
        run_ranks(save_fsdp1_checkpoints, 2, args=(str(base),), timeout=400, device="cpu")
    dst = base / f"zero3_{label}"
    r = convert_to_zero3(base / label / "checkpoint-2", dst, world_size=NEW_WORLD, ds_config={
        "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}})
    assert r.source_engine.startswith("fsdp1-")
    loaded = run_ranks(load_llama_zero3, NEW_WORLD, args=(str(dst),), timeout=600, device="cpu")[0].value
    expected = torch.load(base / label / EXPECTED, weights_only=True)
    # the moments as torch itself reads the saved optimizer (FSDP1's full optimizer gather at save time
    # returns exp_avg equal to exp_avg_sq with use_orig_params on CPU: tests/test_fsdp1_sources.py)
    if label == "full":
        state = torch.load(base / label / "checkpoint-2" / "optimizer.bin", weights_only=True)["state"]
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(base / label / "checkpoint-2" / "optimizer_0", base / f"{label}_optim.pt")
        state = torch.load(base / f"{label}_optim.pt", weights_only=True)["optimizer"]["state"]
    assert sorted(loaded) == sorted(state)
    for name, got in loaded.items():
        assert torch.equal(_bits(got["fp32"]), _bits(expected["weights"][name].float())), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_bits(got[key]), _bits(state[name][key])), (name, key)


def test_a_weights_only_source_is_refused_by_name_with_nothing_written(tmp_path):
    """A DCP folder holding the model alone (no optimizer state): the DCP reader describes its
    weights only, and convert --to zero3 says so, naming the reader, with exit 1 and nothing written."""
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "model_only"
    dcp.save({"model": {"w": torch.ones(4, 3), "b": torch.zeros(3)}}, checkpoint_id=str(src))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "shardkit", "convert", str(src), "--to", "zero3", "--world-size", "2",
                           "-o", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "dcp reader describes this checkpoint's weights only, not its optimizer state" in done.stderr, done.stderr
    assert not out.exists() or list(out.iterdir()) == []
