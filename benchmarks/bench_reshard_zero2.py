"""`shardkit reshard` of ZeRO-2 checkpoints against `cp -r` + fsync, side by side, over a size series.

A real ZeRO-2 save (DeepSpeed 0.19, bf16, AdamW, a tiny Llama at 2 ranks, one step) is scaled to each size
of the series (``scale_zero2``): every parameter's first dimension times a factor, each rank's fp32 slice and
Adam moments the source's bytes repeated, the partitions, ``group_paddings`` and ``param_slice_mappings``
computed as DeepSpeed lays out a flat group (padded to a multiple of 2 x world size, cut in equal
partitions), at 2 and at 4 ranks. The files are written through shardkit's torch-free writer at disk speed;
the module weights in the model-states file are the source's bytes repeated, as 1-D tensors (the reshard
copies that file's records whole; no load here needs their shapes). Each checkpoint is sealed with a
manifest, so the reshard verifies the source's digests, as it does for a checkpoint shardkit wrote.

Per size, each step a child process (wall time; peak RSS: ``ru_maxrss`` of the child and its waited-for
descendants, through GNU time), the source read once before each so every step starts from a warm page cache:

- ``cp -r`` of the tag folder + ``sync`` of every copied file (the floor for a copy that survives a crash,
  as the reshard's output does);
- ``shardkit reshard`` 2 -> 4 and 4 -> 2 (byte ranges, the default route; the source's digests verified),
  and 2 -> 4 with ``--no-verify`` (sizes checked, digests not: what the verification costs);
- ``shardkit reshard`` 2 -> 4 through the ZeRO-1/2 writer's torch route (each partition built by torch when
  written, as for a source whose bytes cannot express it; forced here by making the writer's byte-range check
  refuse), unless ``--no-torch``.

``--repeat`` rounds each run every step once, the copy first; the table has each step's median time and the
median of its per-round ratios to the copy (a ratio within a round, where other work on a shared machine
weighs on both sides alike); ``--json FILE`` keeps every run's numbers and the load average. The children run
with a bytecode cache in the work folder (``_timing.bench_env``), as an installed package has one.

    python benchmarks/bench_reshard_zero2.py [--sizes 0.25 0.5 1 2] [--repeat 3] [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._timing import Measured, Step, bench_env, dir_bytes, measure_rounds  # noqa: E402 - the repository on the path first

TAG = "global_step1"
SAVE_WORLD = 2


# --- the small real save (spawned ranks) ---------------------------------------------------------


def _config(world: int) -> dict[str, Any]:
    return {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "steps_per_print": 10_000, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}


def rank_save(out: str) -> None:
    import torch.distributed as dist

    from shardkit.engines.deepspeed import initialize, train_step
    from shardkit.engines.model_factory import synthetic_batch, tiny_llama

    engine = initialize(tiny_llama("tiny", seed=0), _config(dist.get_world_size()))
    train_step(engine, synthetic_batch(engine.module.config.vocab_size, 2, 16, 0, dist.get_rank()))
    engine.save_checkpoint(out, tag=TAG)


def small_save(out: Path) -> Path:
    from shardkit.run.spawn.process import run_ranks

    if not (out / TAG).is_dir():
        run_ranks(rank_save, SAVE_WORLD, args=(str(out),), timeout=600, device="cpu")
    return out / TAG


# --- scaling a ZeRO-2 checkpoint (torch-free) ------------------------------------------------------


def scale_zero2(src_tag: Path, dst: Path, factor: int, world: int) -> Path:
    """``src_tag`` (a ZeRO-1/2 tag folder) with every parameter ``factor`` times larger, laid out for
    ``world`` ranks, written as ``dst/<tag>`` + ``dst/latest`` and sealed with a manifest."""
    from shardkit.checkpoint.readers.zero12 import open_zero12_checkpoint
    from shardkit.checkpoint.writers.zero12 import ALIGNMENT_FACTOR, FRAGMENT_ADDRESS
    from shardkit.checkpoint.zero12.files import MODEL_FILE, OPTIMIZER_KEY
    from shardkit.storage.manifest import seal
    from shardkit.storage.torch_load import TensorRef, TorchSize, deepspeed_stub
    from shardkit.storage.torch_pickle import NewTensor, pickle_structure
    from shardkit.storage.torch_zip import Segment, write_torch_zip

    ckpt = open_zero12_checkpoint(src_tag)
    rank0 = ckpt.optim_states[0]
    osd = rank0[OPTIMIZER_KEY]
    if any(any(pads) for pads in osd.get("param_alignment_paddings") or []):
        raise SystemExit(f"{src_tag}: parameters with alignment padding; scaling them is not implemented")

    def repeat(ref: TensorRef, numel: int) -> NewTensor:
        """``numel`` elements of ``ref``'s bytes over and over."""
        assert ref.path is not None and ref.file_offset is not None
        segs = [Segment(ref.path, ref.file_offset, min(ref.numel, numel - at) * ref.itemsize)
                for at in range(0, numel, ref.numel)]
        return NewTensor(ref.dtype, numel, segs)

    def cyclic(refs: list[TensorRef], sizes: list[int], start: int, end: int, total: int) -> NewTensor:
        """[start, end) of the scaled flat buffer, whose element i is element i mod N of the small one
        (the small ranks' unpadded slices ``refs[:sizes]``, concatenated), then zeros up to ``total``: the same
        values at every world size, so a reshard of the 2-rank copy equals the 4-rank copy."""
        small, itemsize = sum(sizes), refs[0].itemsize
        segs, at = [], start
        while at < end:
            pos, base = at % small, 0
            for ref, size in zip(refs, sizes):
                if pos < base + size:
                    n = min(base + size - pos, end - at)
                    assert ref.path is not None and ref.file_offset is not None
                    segs.append(Segment(ref.path, ref.file_offset + (pos - base) * itemsize, n * itemsize))
                    at += n
                    break
                base += size
        if total > end - start:
            segs.append(Segment(None, 0, (total - (end - start)) * itemsize))
        return NewTensor(refs[0].dtype, total, segs)

    shapes = [OrderedDict((name, TorchSize((shape[0] * factor, *shape[1:]) if shape else (factor,)))
                          for name, shape in group.items()) for group in ckpt.model_state["param_shapes"]]
    out = dst / TAG
    shutil.rmtree(dst, ignore_errors=True)
    out.mkdir(parents=True)
    base = osd["base_optimizer_state"]
    small = [s[OPTIMIZER_KEY] for s in ckpt.optim_states]
    for r in range(world):
        sd = dict(osd)
        fp32, paddings, mappings, states = [], [], [], {}
        for g, group in enumerate(shapes):
            numel = sum(math.prod(s) for s in group.values())
            align = ALIGNMENT_FACTOR * world
            part = math.ceil(numel / align) * align // world
            start, end = min(r * part, numel), min((r + 1) * part, numel)
            fp32_refs = [o["single_partition_of_fp32_groups"][g] for o in small]
            sizes = [ref.numel for ref in fp32_refs]
            fp32.append(cyclic(fp32_refs, sizes, start, end, end - start))
            paddings.append(part - (end - start))
            mapping, offset = OrderedDict(), 0
            for name, shape in group.items():
                lo, hi = max(start, offset), min(end, offset + math.prod(shape))
                if lo < hi:
                    mapping[name] = deepspeed_stub(FRAGMENT_ADDRESS, numel=hi - lo, start=lo - start)
                offset += math.prod(shape)
            mappings.append(mapping)
            pid = base["param_groups"][g]["params"][0]
            states[pid] = {k: cyclic([o["base_optimizer_state"]["state"][pid][k] for o in small], sizes, start, end, part)
                           if isinstance(v, TensorRef) and len(v.shape) == 1 and v.numel > 1 else v
                           for k, v in base["state"].get(pid, {}).items()}
        sd.update({"base_optimizer_state": {"state": states, "param_groups": base["param_groups"]},
                   "single_partition_of_fp32_groups": fp32, "group_paddings": paddings,
                   "partition_count": [world] * len(shapes), "param_slice_mappings": mappings})
        write_torch_zip(out / f"{ckpt.prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
                        *pickle_structure({**rank0, OPTIMIZER_KEY: sd}), fsync=True)
    model = dict(ckpt.model_state)
    model["module"] = OrderedDict((k, repeat(v, v.numel * factor) if isinstance(v, TensorRef) else v)
                                  for k, v in model["module"].items())
    model["param_shapes"], model["dp_world_size"] = shapes, world
    write_torch_zip(out / MODEL_FILE, *pickle_structure(model), fsync=True)
    (dst / "latest").write_text(TAG)
    seal(out, engine="deepspeed", world_size=world, zero_stage=ckpt.stage, dtype=ckpt.precision)
    return out


# --- measuring (benchmarks/_timing.py) -----------------------------------------------------------


def _reshard(src: Path, world: int, out: Path, torch_route: bool, *extra: str) -> list[str]:
    if torch_route:
        return [sys.executable, __file__, "--child-torch-route", str(src), str(world), str(out)]
    return [sys.executable, "-m", "shardkit", "reshard", str(src), "--world-size", str(world), "-o", str(out), *extra]


def child_torch_route(src: str, world: str, out: str) -> None:
    """The reshard with the writer's byte-range check refusing: every optimizer file built with torch."""
    from shardkit.checkpoint.ops.reshard import reshard_checkpoint
    from shardkit.checkpoint.writers.zero12 import Zero12Files

    Zero12Files._first_not_byte_ranges = lambda self: "the benchmark's torch-route row"  # type: ignore[method-assign]
    result = reshard_checkpoint(src, out, int(world))
    assert result.notes and "torch" in result.notes[0], result.notes


def run(sizes: list[float], repeat: int, workdir: Path, torch_route: bool) -> list[dict[str, Any]]:
    env = bench_env(workdir)
    small = small_save(workdir / "small")
    unit = dir_bytes(small)
    rows = []
    for gb in sizes:
        factor = max(1, round(gb * 1e9 / unit))
        src2 = workdir / f"src_{gb}_ws2"
        src4 = workdir / f"src_{gb}_ws4"
        t0 = time.perf_counter()
        scale_zero2(small, src2, factor, 2)
        scale_zero2(small, src4, factor, 4)
        size = dir_bytes(src2 / TAG)
        print(f"[bench] {gb} GB: x{factor}, {size / 1e9:.2f} GB at 2 ranks, generated in {time.perf_counter() - t0:.1f} s",
              flush=True)
        copy, out = workdir / "copy", workdir / "out"
        row: dict[str, Any] = {"size_gb": gb, "bytes": size, "factor": factor}
        steps = [Step("copy_fsync", "cp -r + sync", ["sh", "-c", f'cp -r "{src2 / TAG}" "{copy}" && '
                                                     f'find "{copy}" -type f -exec sync {{}} +'], src2, copy),
                 Step("reshard_2to4", "reshard 2 -> 4", _reshard(src2, 4, out, False), src2, out),
                 Step("reshard_2to4_no_verify", "reshard 2 -> 4 --no-verify", _reshard(src2, 4, out, False, "--no-verify"),
                      src2, out),
                 Step("reshard_4to2", "reshard 4 -> 2", _reshard(src4, 2, out, False), src4, out)]
        if torch_route:
            steps.append(Step("torch_2to4", "torch route 2 -> 4", _reshard(src2, 4, out, True), src2, out))
        row.update(measure_rounds(steps, repeat, env))
        rows.append({k: asdict(v) if isinstance(v, Measured) else v for k, v in row.items()})
        shutil.rmtree(src2, ignore_errors=True)
        shutil.rmtree(src4, ignore_errors=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| checkpoint | `cp -r` + sync (s) | reshard 2 -> 4 (s) | ratio | 2 -> 4 --no-verify (s) | ratio | "
             "reshard 4 -> 2 (s) | ratio | torch route 2 -> 4 (s) | ratio | peak RSS cp / 2->4 / no-verify / 4->2 / torch "
             "(MiB) | CPU s, same order |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cp = r["copy_fsync"]["wall_s"]
        t = r.get("torch_2to4")
        cells = [f"{r['bytes'] / 1e9:.2f} GB", f"{cp:.2f}"]
        for key in ("reshard_2to4", "reshard_2to4_no_verify", "reshard_4to2"):
            cells += [f"{r[key]['wall_s']:.2f}", f"{r[key]['vs_copy']:.2f}x"]
        cells += [f"{t['wall_s']:.2f}", f"{t['vs_copy']:.2f}x"] if t else ["-", "-"]
        peaks = [r[k]["peak_rss_mib"] for k in ("copy_fsync", "reshard_2to4", "reshard_2to4_no_verify", "reshard_4to2",
                                                "torch_2to4") if k in r]
        cells.append(" / ".join(f"{p:,.0f}" for p in peaks))
        cells.append(" / ".join(f"{r[k].get('cpu_s', 0):.2f}" for k in ("copy_fsync", "reshard_2to4",
                                                                        "reshard_2to4_no_verify", "reshard_4to2",
                                                                        "torch_2to4") if k in r))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0], help="checkpoint sizes, GB")
    parser.add_argument("--repeat", type=int, default=3, help="runs per step (the median is reported)")
    parser.add_argument("--workdir", type=Path, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch-route rows")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    parser.add_argument("--child-torch-route", nargs=3, metavar=("SRC", "WORLD", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_torch_route:
        child_torch_route(*args.child_torch_route)
        return 0
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_reshard_zero2_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        rows = run(args.sizes, args.repeat, workdir, not args.no_torch)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}; medians of {args.repeat} rounds; "
          "ratio: median of the per-round ratios to `cp -r` + sync\n")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
