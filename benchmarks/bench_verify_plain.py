"""`shardkit verify` of a plain ZeRO-3 save (no shardkit manifest) as the ranks grow: its time and
peak memory at 8 to 1,024 ranks.

The many-rank folders are generated from one real 2-rank ZeRO-3 save (DeepSpeed's own, the tiny
Llama of tests/_ranks_zero3.py, built here when --source is not given) by shardkit's torch-free
reshard (``reshard_checkpoint`` without a manifest): every rank's files as DeepSpeed at that world size
would have written them. Each verify runs in a fresh process (``python -m shardkit verify DIR
--json``), which reports its own peak RSS; the claim it backs: the byte checks stream one file at
a time, so the peak grows with what the reader's checkpoint model holds (a piece per rank per
tensor), not with the files' structures at once.

    python benchmarks/bench_verify_plain.py [--source ROOT] [--worlds 8 64 256 1024] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: Runs the CLI and prints the process's own peak RSS (KiB on Linux) and CPU seconds (user + system)
#: to stderr as its last line: on a shared machine wall time moves with the load, CPU time does not.
_CHILD = ("import resource, sys\nfrom shardkit.cli import main\ncode = main(sys.argv[1:])\n"
          "u = resource.getrusage(resource.RUSAGE_SELF)\n"
          "print('MAXRSS', u.ru_maxrss, u.ru_utime + u.ru_stime, file=sys.stderr)\nsys.exit(code)")


def build_source(base: Path) -> Path:
    """DeepSpeed's own 2-rank ZeRO-3 save of the tiny Llama (the tests' fp32 source)."""
    from tests import _ranks_zero3 as R

    return Path(R.build_sources(base)["fp32"])


def generate(source: Path, out: Path, world: int) -> float:
    """``source`` resharded to ``world`` ranks into ``out`` (no manifest); seconds taken."""
    from shardkit.checkpoint.ops.reshard import reshard_checkpoint

    start = time.perf_counter()
    reshard_checkpoint(source, out, world, manifest=False, warn=lambda _: None)
    return time.perf_counter() - start


def verify(root: Path) -> dict[str, Any]:
    """One `shardkit verify ROOT --json` in a fresh process: exit code, seconds, peak RSS, its report."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _CHILD, "verify", str(root), "--json"], capture_output=True,
                          text=True, cwd=REPO, timeout=3600)
    seconds = time.perf_counter() - start
    last = next((line.split() for line in reversed(done.stderr.splitlines()) if line.startswith("MAXRSS")), ["", 0, 0])
    rss, cpu = int(last[1]), float(last[2])
    report = json.loads(done.stdout) if done.stdout.strip().startswith("{") else {}
    return {"code": done.returncode, "seconds": round(seconds, 2), "cpu_s": round(cpu, 2), "peak_rss_mib": round(rss / 1024, 1),
            "files": report.get("files"), "bytes": report.get("bytes"), "tensors": report.get("tensors"),
            "check": report.get("check"), "errors": report.get("errors"), "stderr": done.stderr[-400:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", help="a 2-rank ZeRO-3 root (built when absent)")
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 256, 1024])
    p.add_argument("--workdir", help="where the generated folders go (a temporary folder when absent)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_verify_plain_"))
    source = Path(args.source) if args.source else build_source(work / "source")
    rows = []
    for world in args.worlds:
        out = work / f"world{world}"
        shutil.rmtree(out, ignore_errors=True)
        gen = generate(source, out, world)
        row = {"world": world, "generate_s": round(gen, 2), **verify(out)}
        if row["code"] != 0:
            print(f"verify at {world} ranks exited {row['code']}: {row['stderr']}", file=sys.stderr)
        rows.append(row)
        shutil.rmtree(out, ignore_errors=True)
        if not args.json:
            print(f"{world:>6} ranks  {row['files']:>6} files  {row['bytes'] or 0:>12,} bytes  {row['tensors']:>4} "
                  f"tensors  verify {row['seconds']:>7.2f} s ({row['cpu_s']:.2f} CPU s)  peak RSS {row['peak_rss_mib']:>7.1f} MiB  "
                  f"(exit {row['code']}; generated in {row['generate_s']:.1f} s)", flush=True)
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "stderr"} for r in rows], indent=2))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["code"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
