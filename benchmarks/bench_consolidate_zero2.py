"""`shardkit consolidate` of ZeRO-2 checkpoints against DeepSpeed's `zero_to_fp32.py`, side by side, over a size
series.

The checkpoints are benchmarks/bench_reshard_zero2.py's: a real ZeRO-2 save (DeepSpeed 0.19, bf16, AdamW, a tiny
Llama at 2 ranks, one step) scaled to each size of the series (every parameter's first dimension times a
factor, laid out as DeepSpeed lays out a flat group at 2 ranks) and sealed with a manifest, so consolidate
verifies the source's digests.

Per size, each step a child process (wall time; peak RSS: ``ru_maxrss`` of the child, through GNU time, as
bench_reshard_zero2 measures it), the source read once before each so every step starts from a warm page cache:

- ``python -m deepspeed.utils.zero_to_fp32 ROOT OUT --safe_serialization`` (what DeepSpeed saves beside every
  checkpoint as ``zero_to_fp32.py``: the whole fp32 state dict built in memory, then written);
- ``shardkit consolidate ROOT -o OUT/model.safetensors`` (``readers.zero12`` + the streaming writer: every
  piece copied file to file; the source's digests verified first), and with ``--no-verify`` (sizes only).

After the rounds the two outputs are compared tensor by tensor (``torch.equal``, same names), so the rows
time the same result. ``--repeat`` rounds run every step once, zero_to_fp32 first; the table has each step's
median time, the median of its per-round speedups over zero_to_fp32, and peak RSS ratios.

    python benchmarks/bench_consolidate_zero2.py [--sizes 0.25 0.5 1] [--repeat 3] [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._timing import Measured, Step, bench_env, dir_bytes, measure_rounds  # noqa: E402 - the repository first
from benchmarks.bench_reshard_zero2 import TAG, scale_zero2, small_save  # noqa: E402


def _same_tensors(ours: Path, theirs_dir: Path) -> int:
    """Tensors compared (torch.equal, same names) between shardkit's file and zero_to_fp32's output."""
    import torch
    from safetensors import safe_open

    files = sorted(theirs_dir.glob("*.safetensors"))
    theirs: dict[str, Path] = {}
    for f in files:
        with safe_open(f, "pt") as fh:
            theirs.update({k: f for k in fh.keys()})
    with safe_open(ours, "pt") as mine:
        names = sorted(mine.keys())
        if names != sorted(theirs):
            raise SystemExit(f"[bench] names differ: {sorted(set(names) ^ set(theirs))[:5]}")
        for name in names:
            with safe_open(theirs[name], "pt") as other:
                if not torch.equal(mine.get_tensor(name), other.get_tensor(name)):
                    raise SystemExit(f"[bench] {name} differs between shardkit consolidate and zero_to_fp32")
    return len(names)


def run(sizes: list[float], repeat: int, workdir: Path) -> list[dict[str, Any]]:
    env = bench_env(workdir)
    small = small_save(workdir / "small")
    unit = dir_bytes(small)
    rows = []
    for gb in sizes:
        factor = max(1, round(gb * 1e9 / unit))
        src = workdir / f"src_{gb}"
        t0 = time.perf_counter()
        scale_zero2(small, src, factor, 2)
        size = dir_bytes(src / TAG)
        print(f"[bench] {gb} GB: x{factor}, {size / 1e9:.2f} GB at 2 ranks, generated in {time.perf_counter() - t0:.1f} s",
              flush=True)
        ds_out, sk_out = workdir / "zero_to_fp32_out", workdir / "shardkit_out"
        consolidate = [sys.executable, "-m", "shardkit", "consolidate", str(src), "-o", str(sk_out / "model.safetensors")]
        steps = [Step("zero_to_fp32", "zero_to_fp32.py", [sys.executable, "-m", "deepspeed.utils.zero_to_fp32", str(src),
                                                           str(ds_out), "--safe_serialization"], src, ds_out),
                 Step("consolidate", "shardkit consolidate", consolidate, src, sk_out),
                 Step("consolidate_no_verify", "shardkit consolidate --no-verify", [*consolidate, "--no-verify"], src,
                      sk_out)]
        measured = measure_rounds(steps, repeat, env)
        # the outputs compared once, outside the timed rounds (measure_rounds removes each output after its run)
        subprocess.run(steps[0].argv, env=env, check=True, capture_output=True)
        subprocess.run(steps[1].argv, env=env, check=True, capture_output=True)
        compared = _same_tensors(sk_out / "model.safetensors", ds_out)
        print(f"[bench] {gb} GB: {compared} tensors equal between the two outputs", flush=True)
        shutil.rmtree(ds_out, ignore_errors=True)
        shutil.rmtree(sk_out, ignore_errors=True)
        row: dict[str, Any] = {"size_gb": gb, "bytes": size, "factor": factor, "tensors_equal": compared,
                               **{k: asdict(v) for k, v in measured.items()}}
        ref = measured["zero_to_fp32"]
        for key in ("consolidate", "consolidate_no_verify"):
            m: Measured = measured[key]
            row[key]["speedup"] = sorted(r / w for r, w in zip(ref.walls, m.walls))[repeat // 2]
            row[key]["rss_ratio"] = m.peak_rss_mib / ref.peak_rss_mib
        rows.append(row)
        shutil.rmtree(src, ignore_errors=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| checkpoint | zero_to_fp32.py (s) | consolidate (s) | speedup | --no-verify (s) | speedup | "
             "peak RSS zero_to_fp32 / consolidate / --no-verify (MiB) | RSS ratio |",
             "|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        z, c, n = r["zero_to_fp32"], r["consolidate"], r["consolidate_no_verify"]
        lines.append(f"| {r['bytes'] / 1e9:.2f} GB | {z['wall_s']:.2f} | {c['wall_s']:.2f} | {c['speedup']:.1f}x | "
                     f"{n['wall_s']:.2f} | {n['speedup']:.1f}x | {z['peak_rss_mib']:,.0f} / {c['peak_rss_mib']:,.0f} / "
                     f"{n['peak_rss_mib']:,.0f} | {c['rss_ratio']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.25, 0.5, 1.0], help="checkpoint sizes, GB")
    parser.add_argument("--repeat", type=int, default=3, help="runs per step (the median is reported)")
    parser.add_argument("--workdir", type=Path, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_consolidate_zero2_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        rows = run(args.sizes, args.repeat, workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}; medians of {args.repeat} rounds; "
          "speedup: median of the per-round ratios zero_to_fp32 / shardkit\n")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
