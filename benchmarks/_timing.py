"""Side-by-side timing of child processes, shared by the ZeRO-2 benchmarks (reshard, consolidate, export memory).

Each step runs as a child of GNU time (wall seconds; peak RSS: ``ru_maxrss`` of the child and its waited-for
descendants), its source read once before it (a warm page cache, so the order of the steps does not decide the
winner). ``measure_rounds`` runs every step once per round and takes each step's ratio to the first step within
its round: on a shared machine a burst of other work weighs on both sides of a ratio alike.

``bench_env`` is the environment the children run in. It turns Python's bytecode cache back on (into the work
folder, not the source tree) where the shell disabled it (``PYTHONDONTWRITEBYTECODE=1``, as on the project's
build machine): without ``.pyc`` files every ``python -m shardkit`` compiles its ~150 modules from source, some
0.2 s a run that an installed package never pays.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIME = "/usr/bin/time"  # GNU time: the peak RSS of each measured child (apt-get install time)
RSS_MARK = "[bench-maxrss-kib] "


def bench_env(workdir: Path) -> dict[str, str]:
    """The children's environment: the repository importable, one OpenMP thread, and a bytecode cache under
    ``workdir`` compiled here once, so no measured run pays for compiling shardkit."""
    cache = workdir / "pycache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PYTHONPYCACHEPREFIX": str(cache)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run([sys.executable, "-c", "import compileall, sys; "
                    "sys.exit(not compileall.compile_dir(sys.argv[1], quiet=1))", str(REPO / "shardkit")],
                   env=env, check=True)
    return env



@dataclass
class Measured:
    wall_s: float
    """Median wall time of the rounds."""
    peak_rss_mib: float
    """Largest ru_maxrss of the rounds (the child and its waited-for descendants)."""
    walls: list[float]
    vs_copy: float
    """Median over the rounds of this step's time / the first step's time in the same round."""
    cpu_s: float = 0.0
    """Median CPU seconds (user + system, every thread and waited-for child): what a loaded machine moves less
    than wall time, since a CPU-bound step waits for the cores while an in-kernel copy waits less."""


@dataclass(frozen=True)
class Step:
    key: str
    name: str
    argv: list[str]
    source: Path
    output: Path


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def warm(path: Path) -> None:
    """Read every file under ``path`` once (a warm page cache for the step after it)."""
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(1 << 24):
                pass


def run_timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of ``argv`` (``run_timed_cpu`` without the CPU seconds)."""
    wall, rss, _ = run_timed_cpu(argv, env)
    return wall, rss


def run_timed_cpu(argv: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """Wall seconds, peak RSS (MiB) and CPU seconds (user + system, every thread) of ``argv``. GNU time reports ``ru_maxrss`` of its child (and that
    child's waited-for descendants: cp, sync): started from this process directly, a child's ru_maxrss would
    start at this process's own RSS, which exec records as the child's high-water mark."""
    t0 = time.perf_counter()
    done = subprocess.run([TIME, "-f", f"{RSS_MARK}%M %U %S", *argv], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.stdout.write(done.stdout[-4000:])
        raise SystemExit(f"[bench] {' '.join(argv)} failed with exit code {done.returncode}")
    kib, user, system = [line[len(RSS_MARK):].split() for line in done.stdout.splitlines()
                         if line.startswith(RSS_MARK)][-1]
    return wall, int(kib) / 1024, float(user) + float(system)


def measure_rounds(steps: list[Step], repeat: int, env: dict[str, str]) -> dict[str, Measured]:
    """``repeat`` rounds, each running every step once (the first step first): a step's ratio to the first step
    is taken within its round, so a burst of other work on this shared machine moves both sides alike."""
    walls: dict[str, list[float]] = {st.key: [] for st in steps}
    peaks: dict[str, list[float]] = {st.key: [] for st in steps}
    cpus: dict[str, list[float]] = {st.key: [] for st in steps}
    for i in range(repeat):
        for st in steps:
            shutil.rmtree(st.output, ignore_errors=True)
            warm(st.source)
            wall, peak, cpu = run_timed_cpu(st.argv, env)
            shutil.rmtree(st.output, ignore_errors=True)
            walls[st.key].append(wall)
            peaks[st.key].append(peak)
            cpus[st.key].append(cpu)
        print(f"[bench] round {i + 1}: " + ", ".join(f"{st.name} {walls[st.key][-1]:.2f} s" for st in steps)
              + f" (load average {os.getloadavg()[0]:.1f})", flush=True)
    first = walls[steps[0].key]
    out = {}
    for st in steps:
        ratios = sorted(w / c for w, c in zip(walls[st.key], first))
        out[st.key] = Measured(sorted(walls[st.key])[repeat // 2], max(peaks[st.key]), walls[st.key],
                               ratios[repeat // 2], sorted(cpus[st.key])[repeat // 2])
        print(f"[bench] {st.name}: median {out[st.key].wall_s:.2f} s, {out[st.key].vs_copy:.2f}x the first step, "
              f"{out[st.key].cpu_s:.2f} CPU s, peak RSS {out[st.key].peak_rss_mib:,.0f} MiB", flush=True)
    return out
