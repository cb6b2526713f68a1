"""``convert --to zero2|zero1`` (``writers.zero12``) on real engines (CPU, gloo).

- A real 2-rank DeepSpeed ZeRO-3 save (Qwen2 with biases, two param groups) -> ``convert --to zero2
  --world-size 3`` (and ``--to zero1``) -> DeepSpeed ZeRO-2 (ZeRO-1) on 3 ranks loads it with its plain
  ``engine.load_checkpoint``: masters and both Adam moments, by parameter name, bit-equal to a ZeRO-3 resume of
  the same save at 2 ranks (DeepSpeed's ``safe_get_full_*``), and the next losses equal that resume's within the
  all-reduce's summation order (the same global batch is split 2 or 3 ways).
- The chain ZeRO-2 (DeepSpeed's save) -> ``--to zero3`` -> ``--to fsdp2`` -> ``--to zero2 --world-size 3``:
  masters and moments bit-equal to the ZeRO-2 engine's own at save time (fp32 Qwen2, and a tied Llama in bf16).
- The writer at the source's own world size reproduces a DeepSpeed ZeRO-2 save's files value for value.
- A ZeRO-1/2 source is refused naming reshard; a weights-only source by its reader, nothing written.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from shardkit.storage.torch_load import safe_torch_load
from tests import _ranks_zero12_sources as S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

VARIANTS: dict[str, tuple[int, str, bool, str, int]] = {
    "zero2": S.VARIANTS["zero2"], "zero2_tied_bf16": S.VARIANTS["zero2_tied_bf16"],
    "zero3": (3, "fp32", False, "qwen2", 2)}
NEW_WORLD = 3
BATCH = 6  # the global batch: split 2 and 3 ways alike
STEPS = 2


def config(stage: int, dtype: str, world: int) -> dict[str, Any]:
    cfg = S.ds_config(stage, dtype, False, world)
    cfg.update(train_batch_size=BATCH, train_micro_batch_size_per_gpu=BATCH // world)
    return cfg


def resume(plans: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Rank target: per plan, the model and param groups under ``plan['stage']`` at this world size, plain
    ``engine.load_checkpoint``, then every trainable parameter's full master and moments and the next losses."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from shardkit.engines.model_factory import synthetic_batch

    deepspeed.init_distributed(dist_backend=None, auto_mpi_discovery=False)
    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, Any] = {}
    for plan in plans:
        _, dtype, _, kind, groups = VARIANTS[plan["source"]]
        model = S.build_model(kind)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=S._param_groups(model, groups),
                                          config=config(plan["stage"], dtype, world))
        path, _ = engine.load_checkpoint(plan["ckpt"])
        if path is None:
            raise RuntimeError(f"engine.load_checkpoint({plan['ckpt']!r}) loaded nothing")
        loaded_steps = engine.global_steps
        if plan["stage"] == 3:
            states = {n: {"fp32": safe_get_full_fp32_param(p).detach().cpu().clone(),
                          **{k: safe_get_full_optimizer_state(p, k).detach().cpu().clone()
                             for k in ("exp_avg", "exp_avg_sq")}}
                      for n, p in engine.module.named_parameters() if p.requires_grad}
        else:
            states = S._engine_view(engine)
        losses = []
        per = BATCH // world
        for step in range(STEPS):
            rows = synthetic_batch(203, BATCH, S.SEQ_LEN, 10 + step, rank=0)[rank * per:(rank + 1) * per]
            loss = engine(input_ids=rows, labels=rows).loss
            engine.backward(loss)
            engine.step()
            t = loss.detach().float().reshape(1).clone()
            dist.all_reduce(t)
            losses.append(float(t.item()) / world)
        out[plan["label"]] = {"states": states, "losses": losses, "global_steps": loaded_steps}
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardkit.checkpoint.ops.convert.to_dcp import convert_to_dcp
    from shardkit.checkpoint.ops.convert.to_zero3 import convert_to_zero3
    from shardkit.checkpoint.ops.convert.to_zero12 import convert_to_zero12
    from shardkit.run.spawn.process import run_ranks

    base = tmp_path_factory.mktemp("zero12_writer")
    run_ranks(S.save_all, 2, args=(str(base / "src"), VARIANTS), timeout=600, device="cpu")
    quiet = {"warn": lambda note: None}
    out: dict[str, Any] = {"base": base, "results": {}}
    for stage in (2, 1):
        out["results"][f"zero3_to_zero{stage}"] = convert_to_zero12(
            base / "src" / "zero3", base / f"zero3_to_zero{stage}", stage=stage, world_size=NEW_WORLD, **quiet)
    for label in ("zero2", "zero2_tied_bf16"):  # ZeRO-2 -> ZeRO-3 -> FSDP2 -> ZeRO-2
        dtype = VARIANTS[label][1]
        cfg = base / f"{label}.json"
        cfg.write_text(json.dumps(config(2, dtype, NEW_WORLD)))
        convert_to_zero3(base / "src" / label, base / "chain3" / label, world_size=2, **quiet)
        convert_to_dcp(base / "chain3" / label, base / "chain_dcp" / label, **quiet)
        out["results"][f"chain_{label}"] = convert_to_zero12(base / "chain_dcp" / label, base / "chain2" / label,
                                                             stage=2, world_size=NEW_WORLD, ds_config=cfg, **quiet)
    plans = [{"label": "zero3_to_zero2", "source": "zero3", "stage": 2, "ckpt": str(base / "zero3_to_zero2")},
             {"label": "zero3_to_zero1", "source": "zero3", "stage": 1, "ckpt": str(base / "zero3_to_zero1")},
             *({"label": f"chain_{label}", "source": label, "stage": 2, "ckpt": str(base / "chain2" / label)}
               for label in ("zero2", "zero2_tied_bf16"))]
    out["loaded"] = run_ranks(resume, NEW_WORLD, args=(plans,), timeout=600, device="cpu")[0].value
    baseline = [{"label": "zero3", "source": "zero3", "stage": 3, "ckpt": str(base / "src" / "zero3")}]
    out["baseline"] = run_ranks(resume, 2, args=(baseline,), timeout=600, device="cpu")[0].value["zero3"]
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _assert_states_equal(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name, states in want.items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            a, b = got[name][key], states[key]
            assert a.dtype == torch.float32 and a.shape == b.shape, (what, name, key)
            assert torch.equal(_bits(a), _bits(b)), f"{what}: {key} of {name} differs"


@pytest.mark.parametrize("stage", [2, 1])
def test_zero3_save_resumes_under_zero12_at_three_ranks_as_a_zero3_resume(runs, stage):
    got = runs["loaded"][f"zero3_to_zero{stage}"]
    want = runs["baseline"]
    assert got["global_steps"] == 2
    _assert_states_equal(got["states"], want["states"], f"ZeRO-3 -> ZeRO-{stage}")
    # the same global batches: only the gradient all-reduce's summation order differs (3 ranks vs 2)
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    r = runs["results"][f"zero3_to_zero{stage}"]
    assert r.route == "bytes" and r.target_engine == f"zero{stage}" and r.world_size == NEW_WORLD
    # DeepSpeed restores clip_grad from the file: the resuming config's gradient_clipping (DeepSpeed's default 1.0
    # here); a 0.0 there turned clipping off and the next loss moved by 2e-4
    optim = safe_torch_load(r.output / r.tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert optim["optimizer_state_dict"]["clip_grad"] == 1.0
    files = sorted(p.name for p in (r.output / r.tag).glob("*_optim_states.pt"))
    assert files == [f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt" for i in range(NEW_WORLD)]


@pytest.mark.parametrize("label", ["zero2", "zero2_tied_bf16"])
def test_zero2_through_zero3_and_fsdp2_back_to_zero2_is_bit_equal(runs, label):
    reference = torch.load(runs["base"] / "src" / label / "reference.pt", weights_only=True)
    got = runs["loaded"][f"chain_{label}"]
    _assert_states_equal(got["states"], reference, f"ZeRO-2 -> ZeRO-3 -> FSDP2 -> ZeRO-2 ({label})")
    assert got["global_steps"] == 2
    if label == "zero2":
        # the same model, data and (to float32 rounding) state as the ZeRO-3 save's resume: the same next losses
        assert got["losses"] == pytest.approx(runs["baseline"]["losses"], rel=1e-5)
    else:
        assert all(torch.isfinite(torch.tensor(got["losses"])))
    r = runs["results"][f"chain_{label}"]
    prefix = "bf16_" if VARIANTS[label][1] == "bf16" else ""
    assert (r.output / r.tag / f"{prefix}zero_pp_rank_2_mp_rank_00_optim_states.pt").is_file()


def _values_equal(a: Any, b: Any, where: str) -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)), where
        for k in a:
            _values_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _values_equal(x, y, f"{where}[{i}]")
    elif hasattr(a, "deepspeed_name"):
        assert (a.deepspeed_name, a.args, vars(a)) == (b.deepspeed_name, b.args, vars(b)), where
    else:
        assert a == b, where


@pytest.mark.parametrize("label", ["zero2", "zero2_tied_bf16"])
def test_writer_at_the_source_world_size_reproduces_deepspeeds_files(runs, tmp_path, label):
    """The ZeRO-2 reader's model of a DeepSpeed save, written back at its own 2 ranks: every value of every file
    equals DeepSpeed's (partitions, padded moments, paddings, slice mappings, module in bf16, tied names)."""
    from shardkit.checkpoint.ops.convert.to_zero12 import plan_zero12_target
    from shardkit.checkpoint.readers.zero12 import read_zero12
    from shardkit.checkpoint.writers.zero12 import Zero12Files, write_files

    tag = runs["base"] / "src" / label / S.TAG
    ckpt = read_zero12(tag)
    cfg = ckpt.scalars["source"]["ds_config"]
    target, not_carried = plan_zero12_target(ckpt, cfg, 2, 2, {}, [], given=True)
    files = Zero12Files(ckpt, target)
    assert files.plain and not_carried == []
    written = write_files(tmp_path, files, "nothing was written")
    assert sorted(e.path for e in written) == sorted(p.name for p in tag.iterdir())
    for e in written:
        _values_equal(safe_torch_load(tag / e.path), safe_torch_load(tmp_path / e.path), e.path)


def test_same_format_and_weights_only_sources_are_refused_with_nothing_written(runs, tmp_path, run_cli):
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "out"
    code, _, err = run_cli("convert", runs["base"] / "src" / "zero2", "--to", "zero2", "--world-size", "3", "-o", out)
    assert code == 2 and "is a DeepSpeed ZeRO-1/2 checkpoint already" in err and "shardkit reshard" in err, err
    assert not out.exists()
    code, _, err = run_cli("convert", runs["base"] / "src" / "zero3", "--to", "zero1", "-o", out)
    assert code == 2 and "--to zero1 needs --world-size N" in err, err
    src = tmp_path / "model_only"
    dcp.save({"model": {"w": torch.ones(4, 3)}}, checkpoint_id=str(src))
    code, _, err = run_cli("convert", src, "--to", "zero2", "--world-size", "2", "-o", out)
    assert code == 1 and "dcp reader describes this checkpoint's weights only" in err, err
    assert not out.exists() or list(out.iterdir()) == []


#: layouts with a marker no command converts correctly (tests/_ranks_layouts.py) -> what the refusal names
MARKED = {
    "autoep": "'ds_autoep_layers' in the model states (DeepSpeed AutoEP)",
    "tensor_parallel": "tensor/model-parallel ranks (mp_world_size 2",
    "pipeline": "pipeline-parallel layer files (layer_01-model_00-model_states.pt)",
    "moe": "native DeepSpeed MoE expert files",
    "nvme": "offloaded_tensors/ (the NVMe swap folder",
}


@pytest.fixture(scope="module")
def marked_layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests import _ranks_layouts as L

    return L.build_layouts(tmp_path_factory.mktemp("layouts"))


@pytest.mark.parametrize("label", sorted(MARKED))
@pytest.mark.parametrize("to", ["zero2", "zero1"])
def test_marked_layouts_are_refused_by_name_with_nothing_written(marked_layouts, tmp_path, run_cli, label, to):
    src = marked_layouts[label]
    out = tmp_path / "out"
    code, stdout, err = run_cli("convert", src, "--to", to, "--world-size", "2", "-o", out)
    assert code == 1, (stdout, err)
    assert f"shardkit convert --to {to} refuses {src}" in err and MARKED[label] in err, err
    assert "Nothing was written" in err and not out.exists()


def test_cli_writes_a_verified_zero2_checkpoint_and_reports_it(runs, tmp_path, run_cli):
    """Through the CLI: exit 0, the result as JSON (engines, world size, the byte route), and `shardkit verify`
    accepts the output's manifest; --dry-run writes nothing."""
    out, report = tmp_path / "ws4", tmp_path / "result.json"
    src = runs["base"] / "src" / "zero3"
    code, _, err = run_cli("convert", src, "--to", "zero2", "--world-size", "4", "-o", out, "--dry-run")
    assert code == 0 and not out.exists(), err
    code, stdout, err = run_cli("convert", src, "--to", "zero2", "--world-size", "4", "-o", out, "--json-file", report)
    assert code == 0, err
    assert f"wrote {out / S.TAG}: deepspeed -> zero2" in stdout and "on 4 rank(s)" in stdout, stdout
    data = json.loads(report.read_text())
    assert data["engines"] == {"from": "deepspeed", "to": "zero2"} and data["world_size"] == 4
    assert data["route"] == "bytes"
    assert (out / "latest").read_text().strip() == S.TAG
    assert sorted(p.name for p in (out / S.TAG).glob("*_optim_states.pt")) == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)]
    code, _, err = run_cli("verify", out)
    assert code == 0, err


def test_universal_checkpoint_converts_to_the_files_reshard_writes(runs, tmp_path):
    """DeepSpeed's ds_to_universal of the ZeRO-2 save, converted --to zero2 at 3 ranks: every file holds the values
    `shardkit reshard` writes from the ZeRO-2 save itself at 3 ranks (whose loads tests/test_reshard_zero2.py checks)."""
    import subprocess
    import sys

    from shardkit.checkpoint.ops.convert.to_zero12 import convert_to_zero12
    from shardkit.checkpoint.ops.reshard import reshard_checkpoint

    src = runs["base"] / "src" / "zero2"
    universal = tmp_path / "universal" / f"{S.TAG}_universal"
    done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(src / S.TAG), "--output_folder", str(universal), "--inject_missing_state"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    r = convert_to_zero12(universal, tmp_path / "converted", stage=2, world_size=NEW_WORLD, warn=lambda note: None)
    assert r.route == "bytes"
    reshard_checkpoint(src, tmp_path / "resharded", NEW_WORLD, warn=lambda note: None)
    names = [*(f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt" for i in range(NEW_WORLD)), "mp_rank_00_model_states.pt"]
    for name in names:
        _values_equal(safe_torch_load(tmp_path / "resharded" / S.TAG / name),
                      safe_torch_load(r.output / r.tag / name), name)
