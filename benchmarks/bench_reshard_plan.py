"""What one process of a distributed `shardkit reshard` computes before it copies a byte, at 64 to
1,024 source ranks of a 70B Llama (723 parameters, ~1 TB of ZeRO-3 files with Adam).

A real checkpoint of that size cannot be generated here, so the source is simulated where the
planner meets it: the ZeRO-3 reader (``readers.zero3.describe_zero3``, lazy, as ``reshard`` opens it) reads
each source rank's structure through its ``read``; here that returns what ``read_structure`` returns for a real
0.19.8 save of that shape (flat fp32 partitions and Adam moments as TensorRefs at file offsets), with the
parameter layout, the sub-group rule and the same-run ZeRO-3 writer (``writers.zero3_same_run``) all
shardkit's own. Per world size it builds
the share of one process among ``world / 8`` processes (8 GPUs a node: one process per node),
resharding to half and to double the world, and prints: files in the share, seconds to build them
(pickle + byte segments), segments per file, source structures read, and the pickle size. The
claim it backs: a process's planning cost depends on its share of files, not on ranks x tensors.

    python benchmarks/bench_reshard_plan.py [--worlds 64 256 1024] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._llama_reports import llama70b_params  # noqa: E402
from shardkit.checkpoint.ops.reshard import split_by_bytes  # noqa: E402
from shardkit.checkpoint.readers.zero3 import describe_zero3  # noqa: E402
from shardkit.checkpoint.writers.zero3_same_run import Zero3SameRun  # noqa: E402
from shardkit.checkpoint.zero3.checkpoint import ParamSlot, Zero3Checkpoint  # noqa: E402
from shardkit.checkpoint.zero3.layout import DEFAULT_SUB_GROUP_SIZE, partition_numel  # noqa: E402
from shardkit.checkpoint.zero3.repartition import plan_layout  # noqa: E402
from shardkit.storage.torch_load import DeepSpeedObjectStub, TensorRef, TorchSize  # noqa: E402

GPUS_PER_NODE = 8


def _ref(path: str, offset: int, numel: int) -> TensorRef:
    t = TensorRef("0", "float32", 0, (numel,), (1,))
    t.path, t.file_offset, t.record_offset, t.record_nbytes = path, offset, offset, numel * 4
    return t


def synthetic_checkpoint(world: int) -> tuple[Zero3Checkpoint, Any]:
    """A 70B ZeRO-3 checkpoint at ``world`` ranks as the reader describes it, and the source structures."""
    params = llama70b_params()
    # DeepSpeed's sub-group split on partition numels (1e9 default)
    slots, sub_numel, size, j, offset = [], [], 0, 0, 0
    for name, numel in params:
        pn = partition_numel(numel, world)
        slots.append(ParamSlot(name, (numel,), numel, 0, j, offset, pn))
        offset += pn
        size += pn
        if size >= DEFAULT_SUB_GROUP_SIZE:
            sub_numel.append(offset)
            j, offset, size = j + 1, 0, 0
    if offset:
        sub_numel.append(offset)
    shapes = [OrderedDict((s.name, TorchSize(s.shape)) for s in slots if s.sub_group == g) for g in range(len(sub_numel))]
    tag = Path("/ckpt/global_step1")
    model_state = {"param_shapes": shapes, "dp_world_size": world, "mp_world_size": 1, "ds_version": "0.19.8",
                   "global_steps": 1, "module": {}, "buffer_names": [], "frozen_param_shapes": None, "shared_params": {}}
    ckpt = Zero3Checkpoint(
        tag_dir=tag, tag="global_step1", world_size=world,
        model_files=[tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)],
        optim_files=[tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)],
        slots=slots, sub_group_numel=sub_numel, sub_group_param_group=[0] * len(sub_numel),
        param_groups=[{"lr": 1e-4}], state_keys=["exp_avg", "exp_avg_sq"], precision="bf16", ds_version="0.19.8",
        ds_config={"zero_optimization": {"stage": 3}}, model_state=model_state)

    def optim(rank: int) -> dict[str, Any]:
        path, at = str(ckpt.optim_files[rank]), 4096
        flats, state = [], {}
        for g, n in enumerate(sub_numel):
            flats.append(_ref(path, at, n))
            state[g] = {"step": 1, "exp_avg": _ref(path, at + n * 4, n), "exp_avg_sq": _ref(path, at + n * 8, n)}
            at += n * 12
        stage = type("ZeroStageEnumStub", (DeepSpeedObjectStub,), {"deepspeed_name": "deepspeed.runtime.zero.config.ZeroStageEnum"})(3)
        return {"optimizer_state_dict": {"zero_stage": stage, "partition_count": world, "fp32_flat_groups": flats,
                                         "optimizer_state_dict": {"state": state, "param_groups": [{"lr": 1e-4, "params": list(range(len(sub_numel)))}]}},
                "ds_config": ckpt.ds_config, "ds_version": "0.19.8"}

    return ckpt, optim


def measure(world: int, target: int) -> dict[str, Any]:
    ckpt, optim = synthetic_checkpoint(world)
    reads: list[int] = []

    by_path = {p: r for r, p in enumerate(ckpt.optim_files)}

    def read(path: Path) -> dict[str, Any]:
        reads.append(by_path[path])
        return optim(by_path[path])

    t0 = time.perf_counter()
    files = Zero3SameRun(describe_zero3(ckpt, lazy=True, read=read), plan_layout(ckpt, target)).files()
    processes = max(1, target // GPUS_PER_NODE)
    share = split_by_bytes([f.nbytes for f in files], processes)[0]
    setup = time.perf_counter() - t0
    segments, pickle_bytes = 0, 0
    t1 = time.perf_counter()
    for i in share:
        data, records = files[i].build()
        pickle_bytes = max(pickle_bytes, len(data))
        segments += sum(len(r.segments) for _, r in records if hasattr(r, "segments"))
    build = time.perf_counter() - t1
    return {"world": world, "target": target, "processes": processes, "share_files": len(share),
            "setup_s": round(setup, 3), "build_s": round(build, 3),
            "build_ms_per_file": round(1000 * build / max(1, len(share)), 2),
            "segments_per_file": round(segments / max(1, len(share)), 1), "source_structures_read": len(set(reads)),
            "max_pickle_bytes": pickle_bytes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = [measure(w, t) for w in args.worlds for t in (w // 2, w * 2)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("| source ranks -> new | processes (1 per node of 8) | files per process | plan setup (s) | build per file (ms) "
          "| segments per file | source structures read | largest pickle (bytes) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['world']:,} -> {r['target']:,} | {r['processes']} | {r['share_files']} | {r['setup_s']:.3f} | "
              f"{r['build_ms_per_file']:.1f} | {r['segments_per_file']:,.0f} | {r['source_structures_read']} | "
              f"{r['max_pickle_bytes']:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
