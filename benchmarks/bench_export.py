"""`shardkit export` against what users run today to get a `from_pretrained` folder, side by side.

Builds two checkpoints of the same Llama (``--size``, default ``40m``: ~40M parameters) on 2 CPU
ranks, one AdamW step each: DeepSpeed ZeRO-3 (bf16, fp32 masters) and FSDP2 saved through
torch.distributed.checkpoint (shardkit's ``save_fsdp_checkpoint``). Then, each in its own process,
wall time and peak RSS (``bench_resume.measure``: the process tree sampled every 20 ms, and the
kernel's VmHWM) of:

- ``import torch, transformers``: the fixed cost every route below pays;
- ZeRO-3: DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` (zero_to_fp32) + a model built
  from the config + ``load_state_dict`` + ``save_pretrained``, vs ``shardkit export``;
- FSDP2/DCP: torch's ``dcp_to_torch_save`` + ``torch.load`` + ``load_state_dict`` +
  ``save_pretrained``, vs ``shardkit export``.

Every route writes fp32 with the same ``max_shard_size``; the script then checks that shardkit's
folder and ``save_pretrained``'s hold the same index and byte-identical shard files. Inputs are read
once before each step (warm page cache), so the order of the steps does not decide the winner.

    python benchmarks/bench_export.py [--size tiny|small|40m|160m] [--max-shard-size 50MB]
                                      [--workdir DIR] [--keep] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_resume import Measured, measure  # noqa: E402

WORLD = 2
SEQ = 32


# --- building the checkpoints (rank targets, spawned) --------------------------------------------


def rank_zero3_save(size: str, out: str) -> None:
    import torch.distributed as dist

    from shardkit.engines.deepspeed import initialize, train_step
    from shardkit.engines.model_factory import synthetic_batch, tiny_llama

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 3},
           "steps_per_print": 10_000}
    engine = initialize(tiny_llama(size, seed=0), cfg)
    train_step(engine, synthetic_batch(engine.module.config.vocab_size, 2, SEQ, 0, dist.get_rank()))
    engine.save_checkpoint(out, tag="global_step1")


def rank_fsdp_save(size: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from shardkit.checkpoint.ops.fsdp_checkpoint import save_fsdp_checkpoint
    from shardkit.engines.fsdp import apply_fsdp, train_step
    from shardkit.engines.model_factory import synthetic_batch, tiny_llama

    model = tiny_llama(size, seed=0)
    apply_fsdp(model, {"fsdp": {"wrap": ["LlamaDecoderLayer"], "mixed_precision": "none", "pin_memory": False}})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, opt, synthetic_batch(model.config.vocab_size, 2, SEQ, 0, dist.get_rank()))
    save_fsdp_checkpoint(model, opt, out, step=1)


def _build(target: str, size: str, out: str) -> None:
    from shardkit.run.spawn.process import run_ranks

    run_ranks(globals()[target], WORLD, args=(size, out), timeout=1500, device="cpu")


# --- the routes users have without shardkit (each run as its own process) -----------------------

ZERO_TO_FP32_SAVE = """
import sys, torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM
ckpt, config, out, shard = sys.argv[1:5]
sd = get_fp32_state_dict_from_zero_checkpoint(ckpt)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config), dtype=torch.float32)
model.load_state_dict(sd)
model.save_pretrained(out, max_shard_size=shard)
"""

DCP_TO_TORCH_SAVE = """
import os, sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoConfig, AutoModelForCausalLM
dcp_dir, config, out, shard = sys.argv[1:5]
tmp = out + ".pt"
dcp_to_torch_save(dcp_dir, tmp)
sd = torch.load(tmp, weights_only=False)["model"]
os.unlink(tmp)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config), dtype=torch.float32)
model.load_state_dict(sd)
model.save_pretrained(out, max_shard_size=shard)
"""


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


def _same_folder(ours: Path, theirs: Path) -> bool:
    """The same index (or single file) and byte-identical weight files."""
    names = sorted(p.name for p in theirs.iterdir() if p.name.startswith("model"))
    if names != sorted(p.name for p in ours.iterdir() if p.name.startswith("model")):
        return False
    for name in names:
        a, b = (ours / name).read_bytes(), (theirs / name).read_bytes()
        if name.endswith(".json"):
            if json.loads(a)["weight_map"] != json.loads(b)["weight_map"]:
                return False
        elif a != b:
            return False
    return True


def run(workdir: Path, size: str, shard: str) -> dict[str, Any]:
    from shardkit.engines.model_factory import tiny_llama

    config = workdir / "config"
    if not (config / "config.json").is_file():
        tiny_llama(size).config.save_pretrained(config)
    z3, dcp = workdir / "zero3", workdir / "fsdp2"
    for target, path in (("rank_zero3_save", z3), ("rank_fsdp_save", dcp)):
        if not path.exists():
            print(f"[bench] building {path.name} ({size}, {WORLD} ranks)", flush=True)
            _build(target, size, str(path))
    dcp_tag = next(p for p in dcp.iterdir() if (p / ".metadata").is_file())
    r: dict[str, Any] = {"size": size, "max_shard_size": shard,
                         "params": sum(p.numel() for p in tiny_llama(size).parameters())}
    r["imports"] = measure("import torch, transformers", _py("-c", "import torch, transformers"))
    outs = {k: workdir / k for k in ("ds_route", "sk_zero3", "dcp_route", "sk_dcp")}
    for out in outs.values():
        shutil.rmtree(out, ignore_errors=True)
    r["ds_route"] = measure("zero_to_fp32 + save_pretrained",
                            _py("-c", ZERO_TO_FP32_SAVE, str(z3), str(config), str(outs["ds_route"]), shard), inputs=z3)
    r["sk_zero3"] = measure("shardkit export (ZeRO-3)",
                            _py("-m", "shardkit", "export", str(z3), "-o", str(outs["sk_zero3"]), "--model-config",
                                str(config), "--dtype", "fp32", "--max-shard-size", shard), inputs=z3)
    r["dcp_route"] = measure("dcp_to_torch_save + save_pretrained",
                             _py("-c", DCP_TO_TORCH_SAVE, str(dcp_tag), str(config), str(outs["dcp_route"]), shard),
                             inputs=dcp)
    r["sk_dcp"] = measure("shardkit export (FSDP2/DCP)",
                          _py("-m", "shardkit", "export", str(dcp), "-o", str(outs["sk_dcp"]), "--model-config",
                              str(config), "--dtype", "fp32", "--max-shard-size", shard), inputs=dcp)
    r["zero3_same"] = _same_folder(outs["sk_zero3"], outs["ds_route"])
    r["dcp_same"] = _same_folder(outs["sk_dcp"], outs["dcp_route"])
    r["ckpt_bytes"] = sum(f.stat().st_size for f in z3.rglob("*") if f.is_file())
    r["model_bytes"] = sum(f.stat().st_size for f in outs["sk_zero3"].glob("model*.safetensors"))
    r["shards"] = len(list(outs["sk_zero3"].glob("model*.safetensors")))
    return r


def table(r: dict[str, Any]) -> str:
    mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
    base = r["imports"].peak_rss

    def row(label: str, m: Measured, ref: Measured | None = None) -> str:
        vs = "" if ref is None else (f"{ref.wall_s / m.wall_s:.1f}x faster, {m.peak_rss / ref.peak_rss:.2f}x the RSS "
                                     f"({(m.peak_rss - base) / max(ref.peak_rss - base, 1):.2f}x above the imports)")
        return f"| {label} | {m.wall_s:.1f} | {mib(m.peak_rss)} | {vs} |"

    return "\n".join([
        f"Llama {r['size']} ({r['params'] / 1e6:.1f}M parameters), fp32 output {mib(r['model_bytes'])} MiB in "
        f"{r['shards']} shard(s) of at most {r['max_shard_size']}; ZeRO-3 checkpoint {mib(r['ckpt_bytes'])} MiB "
        f"({WORLD} ranks, bf16 + fp32 masters + Adam)",
        "",
        "| step | wall (s) | peak RSS (MiB) | shardkit vs the other route |",
        "|---|---:|---:|---|",
        row("`import torch, transformers` (every route pays it)", r["imports"]),
        row("ZeRO-3: `zero_to_fp32` + `save_pretrained`", r["ds_route"]),
        row(f"ZeRO-3: `shardkit export` (same files: {r['zero3_same']})", r["sk_zero3"], r["ds_route"]),
        row("FSDP2: `dcp_to_torch_save` + `save_pretrained`", r["dcp_route"]),
        row(f"FSDP2: `shardkit export` (same files: {r['dcp_same']})", r["sk_dcp"], r["dcp_route"]),
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="40m", choices=["tiny", "small", "40m", "160m"],
                    help="Llama size (shardkit.engines.model_factory.LLAMA_SIZES); default 40m (~40M parameters)")
    ap.add_argument("--max-shard-size", default="50MB", help="max_shard_size of every route (default 50MB)")
    ap.add_argument("--workdir", type=Path, default=None, help="where checkpoints and outputs go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the workdir (its checkpoints are reused next time)")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw numbers here")
    args = ap.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shardkit-bench-export-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        results = run(workdir, args.size, args.max_shard_size)
        print()
        print(table(results))
        if args.json:
            args.json.write_text(json.dumps({k: (v.__dict__ if isinstance(v, Measured) else v)
                                             for k, v in results.items()}, indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
