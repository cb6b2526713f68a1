"""The checkpoints of the layout and inspect tests: small real DeepSpeed saves at ZeRO-1, -2 and -3
(``save_all``, a rank target: spawned processes import it by module name; each variant trains one step
of the tiny Llama, so the optimizer state is real), and ``build_layouts``, which adds a real universal
checkpoint and the layouts no command converts correctly, built from copies of those files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

GLOBAL_BATCH = 2
SEQ_LEN = 8


def ds_config(stage: int, dtype: str, offload: bool, world_size: int) -> dict[str, Any]:
    """An AdamW config for ZeRO ``stage`` whose global batch is GLOBAL_BATCH at 1 or 2 ranks."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    cfg: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 10_000,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def train_and_save(save_dir: str, stage: int, dtype: str, offload: bool) -> None:
    """One step of the tiny Llama under ZeRO ``stage``, then ``engine.save_checkpoint(save_dir)``."""
    import torch.distributed as dist

    from shardkit.engines.deepspeed import initialize, train_step
    from shardkit.engines.model_factory import synthetic_batch, tiny_llama

    world, rank = dist.get_world_size(), dist.get_rank()
    engine = initialize(tiny_llama("tiny", seed=0), ds_config(stage, dtype, offload, world))
    rows = synthetic_batch(engine.module.config.vocab_size, GLOBAL_BATCH, SEQ_LEN, 0, rank=0)
    per = GLOBAL_BATCH // world
    train_step(engine, rows[rank * per:(rank + 1) * per])
    engine.save_checkpoint(save_dir, tag="global_step1")


#: label -> (ZeRO stage, precision, CPU optimizer offload): the real saves the layout tests read.
VARIANTS = {
    "zero1": (1, "fp32", False),
    "zero2_bf16": (2, "bf16", False),
    "zero2_offload": (2, "fp32", True),
    "zero3": (3, "bf16", False),
}


def save_all(base: str) -> None:
    """Every VARIANTS save under ``base/<label>`` in one spawn (one process group, one engine each)."""
    for label, (stage, dtype, offload) in VARIANTS.items():
        train_and_save(f"{base}/{label}", stage, dtype, offload)


# --- the layouts built from those real saves (in the test process) -------------------------------



def _resave(file: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Load a real DeepSpeed file, apply ``change``, save it back (torch.save, as DeepSpeed does)."""
    import torch

    state = torch.load(file, map_location="cpu", weights_only=False)
    change(state)
    torch.save(state, file)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _set_nvme(state: dict[str, Any]) -> None:
    state["ds_config"]["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/local_nvme"}


def build_layouts(base: Path) -> dict[str, Path]:
    """label -> checkpoint root, built once per session under ``base``.

    Real saves: ``zero1``, ``zero2_bf16``, ``zero2_offload``, ``zero3`` (2 gloo ranks, one AdamW
    step) and ``universal`` (DeepSpeed's own ds_to_universal of ``zero2_offload``). The layouts no
    command converts correctly are DeepSpeed's markers added to copies of those real files, since
    AutoEP, native MoE, tensor/pipeline parallelism and NVMe offload do not run on this CPU-only
    machine: ``autoep`` (``ds_autoep_layers`` in ZeRO-3 model states, as engine.py writes it),
    ``tensor_parallel`` (``mp_world_size`` 2 and an ``mp_rank_01`` file), ``pipeline`` (a
    ``layer_01-model_00-model_states.pt``), ``moe`` (``expp_rank_0`` and ``layer_0_expert_0`` files),
    ``nvme`` (``offload_optimizer.device`` nvme and the ``offloaded_tensors/`` DeepSpeed copies).
    ``mixed_stages``: the ZeRO-3 save's files copied into a copy of the ZeRO-2 one's tag folder.
    ``trainer_zero2``: the ZeRO-2 root as a Trainer ``checkpoint-4``.
    """
    from tests._fixtures_shared import across_workers, built_once

    # built once per run, read by both xdist workers (asked each time: built_once checks no test changed it)
    built = built_once(across_workers(base), _build)
    return {label: Path(path) for label, path in built.items()}


def _build(base: Path) -> dict[str, str]:
    from shardkit.run.spawn.process import run_ranks

    real = base / "real"
    run_ranks(save_all, 2, args=(str(real),), timeout=300, device="cpu")
    out = {label: real / label for label in VARIANTS}
    uni = base / "universal"
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    str(out["zero2_offload"] / "global_step1"), "--output_folder", str(uni / "global_step1"),
                    "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"],
                   check=True, capture_output=True, timeout=300)
    out["universal"] = uni
    tag = "global_step1"
    autoep = _copy(out["zero3"], base / "autoep")
    for f in sorted((autoep / tag).glob("zero_pp_rank_*_model_states.pt")):
        _resave(f, lambda s: s.update(ds_autoep_layers=[{"layer_name": "model.layers.0.mlp", "num_experts": 4}]))
    tp = _copy(out["zero3"], base / "tensor_parallel")
    for f in sorted((tp / tag).glob("zero_pp_rank_*_model_states.pt")):
        _resave(f, lambda s: s.update(mp_world_size=2))
    shutil.copy(tp / tag / "zero_pp_rank_0_mp_rank_00_model_states.pt", tp / tag / "zero_pp_rank_0_mp_rank_01_model_states.pt")
    pipe = _copy(out["zero1"], base / "pipeline")
    shutil.copy(pipe / tag / "mp_rank_00_model_states.pt", pipe / tag / "layer_01-model_00-model_states.pt")
    moe = _copy(out["zero2_bf16"], base / "moe")
    shutil.copy(moe / tag / "mp_rank_00_model_states.pt", moe / tag / "layer_0_expert_0_mp_rank_00_model_states.pt")
    shutil.copy(moe / tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", moe / tag / "expp_rank_0_mp_rank_00_optim_states.pt")
    nvme = _copy(out["zero3"], base / "nvme")
    for f in sorted((nvme / tag).glob("zero_pp_rank_*_model_states.pt")):
        _resave(f, _set_nvme)
    (nvme / tag / "offloaded_tensors" / "rank0").mkdir(parents=True)
    (nvme / tag / "offloaded_tensors" / "rank0" / "optimizer.swp").write_bytes(b"\0" * 64)
    # two real saves of different stages copied into one tag folder: ZeRO-3's files over a ZeRO-2 save's
    mixed = _copy(out["zero2_bf16"], base / "mixed_stages")
    for f in sorted((out["zero3"] / tag).iterdir()):
        shutil.copy(f, mixed / tag / f.name)
    out.update(autoep=autoep, tensor_parallel=tp, pipeline=pipe, moe=moe, nvme=nvme, mixed_stages=mixed)
    trainer = _copy(out["zero2_bf16"], base / "trainer" / "checkpoint-4")
    (trainer / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    out["trainer_zero2"] = trainer
    return {label: str(path) for label, path in out.items()}
