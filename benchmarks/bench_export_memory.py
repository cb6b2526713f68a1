"""`shardkit export` peak memory from every source format, over model sizes, side by side with the tool a user
would otherwise run.

Per size (``--sizes``, Llama sizes of ``shardkit.engines.model_factory``), real checkpoints of the same model
on 2 CPU ranks, one AdamW step each:

- ZeRO-2 and ZeRO-3 (DeepSpeed, bf16 + fp32 masters): vs ``zero_to_fp32`` + ``save_pretrained``;
- DeepSpeed universal (``ds_to_universal`` of the ZeRO-2 save): shardkit only (DeepSpeed has no universal ->
  Hugging Face route; its loader needs an engine);
- FSDP2 (shardkit's ``save_fsdp_checkpoint``, DCP): vs torch's ``dcp_to_torch_save`` + ``torch.load`` +
  ``save_pretrained``;
- FSDP1 SHARDED_STATE_DICT (accelerate's ``save_fsdp_model``: ``pytorch_model_fsdp_0/``, DCP): vs the same
  ``dcp_to_torch_save`` route;
- FSDP1 FULL_STATE_DICT (``pytorch_model_fsdp.bin``): vs ``torch.load`` + ``save_pretrained``.

Every route writes fp32 shards of at most ``--max-shard-size``; peak RSS is ``ru_maxrss`` through GNU time
(``_timing.run_timed``), inputs read once before each run. "Flat" means shardkit's peak RSS above the imports
every route pays (``import torch, transformers``) does not grow with the checkpoint beyond the largest tensor:
the table prints the peak, the largest fp32 tensor and the checkpoint size per row. Outputs of shardkit and the other route are compared file by file
(index and shard bytes) where the other route exists.

    python benchmarks/bench_export_memory.py [--sizes small 40m 160m] [--sources zero2 fsdp1-full ...]
                                             [--workdir DIR] [--keep] [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._timing import bench_env, dir_bytes, run_timed, warm  # noqa: E402 - the repository first
from benchmarks.bench_export import (  # noqa: E402
    DCP_TO_TORCH_SAVE,
    SEQ,
    ZERO_TO_FP32_SAVE,
    _same_folder,
    rank_fsdp_save,
    rank_zero3_save,
)

WORLD = 2
TAG = "global_step1"
SOURCES = ("zero2", "zero3", "universal", "fsdp2", "fsdp1-sharded", "fsdp1-full")

FULL_BIN_SAVE = """
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
bin_file, config, out, shard = sys.argv[1:5]
sd = torch.load(bin_file, weights_only=True)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config), dtype=torch.float32)
model.load_state_dict(sd)
model.save_pretrained(out, max_shard_size=shard)
"""


# --- the saves (rank targets, spawned) ----------------------------------------------------------------------


def rank_zero2_save(size: str, out: str) -> None:
    import torch.distributed as dist

    from shardkit.engines.deepspeed import initialize, train_step
    from shardkit.engines.model_factory import synthetic_batch, tiny_llama

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 2},
           "steps_per_print": 10_000}
    engine = initialize(tiny_llama(size, seed=0), cfg)
    train_step(engine, synthetic_batch(engine.module.config.vocab_size, 2, SEQ, 0, dist.get_rank()))
    engine.save_checkpoint(out, tag=TAG)


def rank_fsdp1_save(size: str, out: str) -> None:
    """FSDP1 (one unit per decoder layer), one AdamW step, saved by accelerate's ``save_fsdp_model`` under
    SHARDED_STATE_DICT (``out/sharded``) and FULL_STATE_DICT (``out/full``), as tests/test_fsdp1_sources.py."""
    import torch
    import torch.distributed as dist
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin, save_fsdp_model
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from shardkit.engines.model_factory import synthetic_batch, tiny_llama

    rank = dist.get_rank()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    state = PartialState(cpu=True)
    model = FSDP(tiny_llama(size, seed=0), use_orig_params=True, device_id=torch.device("cpu"),
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = synthetic_batch(model.config.vocab_size, 2, SEQ, 0, rank)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    for label, kind in (("sharded", "SHARDED_STATE_DICT"), ("full", "FULL_STATE_DICT")):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type=kind, cpu_ram_efficient_loading=False)
        saver: Any = state
        if kind == "FULL_STATE_DICT":
            # FSDP1's offload_to_cpu gather fails on CPU ranks (tests/test_fsdp1_sources.py says why); a
            # gather on every rank without offload writes the same file, from rank 0 only.
            plugin.state_dict_config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
            plugin.optim_state_dict_config = FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False)
            saver = SimpleNamespace(num_processes=1, process_index=rank)
        save_fsdp_model(plugin, saver, model, f"{out}/{label}/checkpoint-1")
        dist.barrier()


def _spawn(target: Any, size: str, out: Path) -> None:
    from shardkit.run.spawn.process import run_ranks

    print(f"[bench] saving {out.name} ({size}, {WORLD} ranks)", flush=True)
    run_ranks(target, WORLD, args=(size, str(out)), timeout=1800, device="cpu")


def build(size: str, base: Path, sources: list[str]) -> dict[str, Path]:
    """source name -> the path ``shardkit export`` takes (saving what is not there yet)."""
    paths: dict[str, Path] = {}
    if {"zero2", "universal"} & set(sources) and not (base / "zero2" / TAG).is_dir():
        _spawn(rank_zero2_save, size, base / "zero2")
    if "zero2" in sources:
        paths["zero2"] = base / "zero2"
    if "universal" in sources:
        uni = base / "universal"
        if not (uni / TAG).is_dir():
            subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                            str(base / "zero2" / TAG), "--output_folder", str(uni / TAG), "--num_extract_workers", "1",
                            "--num_merge_workers", "1", "--inject_missing_state"], check=True, capture_output=True)
        paths["universal"] = uni
    if "zero3" in sources:
        if not (base / "zero3" / TAG).is_dir():
            _spawn(rank_zero3_save, size, base / "zero3")
        paths["zero3"] = base / "zero3"
    if "fsdp2" in sources:
        if not (base / "fsdp2").is_dir():
            _spawn(rank_fsdp_save, size, base / "fsdp2")
        paths["fsdp2"] = base / "fsdp2"
    if {"fsdp1-sharded", "fsdp1-full"} & set(sources):
        if not (base / "fsdp1" / "full" / "checkpoint-1").is_dir():
            _spawn(rank_fsdp1_save, size, base / "fsdp1")
        for label in ("sharded", "full"):
            if f"fsdp1-{label}" in sources:
                paths[f"fsdp1-{label}"] = base / "fsdp1" / label / "checkpoint-1"
    return paths


def other_route(source: str, path: Path, config: Path, out: Path, shard: str) -> tuple[str, list[str]] | None:
    """The tool a user runs without shardkit: its name and argv, or None where there is none."""
    py = sys.executable
    if source in ("zero2", "zero3"):
        return "zero_to_fp32 + save_pretrained", [py, "-c", ZERO_TO_FP32_SAVE, str(path), str(config), str(out), shard]
    if source == "fsdp2":
        dcp = next(p for p in path.iterdir() if (p / ".metadata").is_file())
        return "dcp_to_torch_save + save_pretrained", [py, "-c", DCP_TO_TORCH_SAVE, str(dcp), str(config), str(out), shard]
    if source == "fsdp1-sharded":
        return ("dcp_to_torch_save + save_pretrained",
                [py, "-c", DCP_TO_TORCH_SAVE, str(path / "pytorch_model_fsdp_0"), str(config), str(out), shard])
    if source == "fsdp1-full":
        return ("torch.load + save_pretrained",
                [py, "-c", FULL_BIN_SAVE, str(path / "pytorch_model_fsdp.bin"), str(config), str(out), shard])
    return None


def _largest_fp32_tensor(size: str) -> int:
    from shardkit.engines.model_factory import LLAMA_SIZES

    kw = LLAMA_SIZES[size]
    return 4 * max(kw["vocab_size"] * kw["hidden_size"], kw["intermediate_size"] * kw["hidden_size"])


def run(sizes: list[str], sources: list[str], workdir: Path, shard: str) -> list[dict[str, Any]]:
    from shardkit.engines.model_factory import tiny_llama

    env = bench_env(workdir)
    # what every route here pays first: export builds the model on the meta device, so it imports both
    baseline = run_timed([sys.executable, "-c", "import torch, transformers"], env)[1]
    rows = []
    for size in sizes:
        base = workdir / size
        config = base / "config"
        if not (config / "config.json").is_file():
            model: Any = tiny_llama(size)
            model.config.save_pretrained(config)
        paths = build(size, base, sources)
        for source in sources:
            path = paths[source]
            row: dict[str, Any] = {"size": size, "source": source, "ckpt_bytes": dir_bytes(path),
                                   "largest_tensor_bytes": _largest_fp32_tensor(size), "imports_rss_mib": baseline}
            ours, theirs = workdir / "out_shardkit", workdir / "out_other"
            for out in (ours, theirs):
                shutil.rmtree(out, ignore_errors=True)
            warm(path)
            row["shardkit_s"], row["shardkit_rss_mib"] = run_timed(
                [sys.executable, "-m", "shardkit", "export", str(path), "-o", str(ours), "--model-config", str(config),
                 "--dtype", "fp32", "--max-shard-size", shard], env)
            row["model_bytes"] = sum(f.stat().st_size for f in ours.glob("model*.safetensors"))
            other = other_route(source, path, config, theirs, shard)
            if other is not None:
                warm(path)
                row["other"] = other[0]
                row["other_s"], row["other_rss_mib"] = run_timed(other[1], env)
                row["same_files"] = _same_folder(ours, theirs)
            print(f"[bench] {size} {source}: shardkit {row['shardkit_rss_mib']:,.0f} MiB, "
                  f"{row.get('other', 'no other route')} {row.get('other_rss_mib', 0):,.0f} MiB "
                  f"(same files: {row.get('same_files', '-')}; load average {os.getloadavg()[0]:.1f})", flush=True)
            rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
    lines = ["| source | model | checkpoint (MiB) | fp32 model (MiB) | largest tensor (MiB) | shardkit export peak RSS "
             "(MiB) | above the imports (MiB) | other route | its peak RSS (MiB) | same files |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in sorted(rows, key=lambda r: (SOURCES.index(r["source"]), r["ckpt_bytes"])):
        other = [r["other"], f"{r['other_rss_mib']:,.0f}", str(r["same_files"])] if "other" in r else ["-", "-", "-"]
        lines.append("| " + " | ".join([
            r["source"], r["size"], mib(r["ckpt_bytes"]), mib(r["model_bytes"]), mib(r["largest_tensor_bytes"]),
            f"{r['shardkit_rss_mib']:,.0f}", f"{r['shardkit_rss_mib'] - r['imports_rss_mib']:,.0f}", *other]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["small", "40m", "160m"], choices=["tiny", "small", "40m", "160m"],
                    help="Llama sizes (shardkit.engines.model_factory.LLAMA_SIZES)")
    ap.add_argument("--sources", nargs="+", default=list(SOURCES), choices=SOURCES, help="source formats")
    ap.add_argument("--max-shard-size", default="50MB", help="max_shard_size of every route (default 50MB)")
    ap.add_argument("--workdir", type=Path, default=None, help="where checkpoints and outputs go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the workdir (its checkpoints are reused next time)")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw numbers here")
    args = ap.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shardkit-bench-export-memory-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        rows = run(args.sizes, args.sources, workdir, args.max_shard_size)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}; peak RSS: ru_maxrss (GNU time); "
          f"the imports: `import torch, transformers`, {rows[0]['imports_rss_mib']:,.0f} MiB\n")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
