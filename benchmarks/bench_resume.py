"""Resume and consolidation of a ZeRO-3 checkpoint: shardkit vs DeepSpeed's own tools, side by side.

Builds a ZeRO-3 bf16 AdamW checkpoint of the ~160M-parameter Llama (hidden 768, 12 layers, vocab
32000) at 2 ranks, then measures wall time and peak RSS of:

- resume at 3 ranks: DeepSpeed's ``ds_to_universal`` + ``load_universal``, vs ``shardkit reshard``
  + DeepSpeed's plain ``load_checkpoint``, vs shardkit's in-process ``load_checkpoint_resharded``
  (no conversion at all);
- full fp32 weights: DeepSpeed's ``zero_to_fp32.py --safe_serialization`` vs ``shardkit consolidate``;
- ``cp -r`` of the checkpoint folder: the floor any tool that reads and writes it all must pay (and
  ``cp -r`` + fsync of every copied file, the floor for a copy that survives a crash, as reshard's does);
- ``shardkit reshard`` at the source's own world size (nothing changes: a hashed byte copy);
- ``shardkit convert`` both ways (ZeRO-3 -> FSDP2 DCP, and that DCP -> ZeRO-3 at 3 ranks, then
  DeepSpeed's plain ``load_checkpoint``), against what a user has without it: consolidate to full
  weights (``zero_to_fp32.py``; torch's ``dcp_to_torch_save``) and load those, losing the optimizer
  state. Skipped when ``shardkit.checkpoint.ops.convert`` is not installed.

Every step runs in its own process tree; peak RSS is the largest *sum* of the RSS of the process
and all its descendants (workers, ranks), sampled from /proc every 20 ms, or the largest VmHWM
(the kernel's peak RSS) of any one of them when that is higher (a short peak between samples). Every step reads a warm
page cache (its inputs are read once right before it). Resume times are the
``load_checkpoint`` call on the slowest rank (engine construction is the same for all and is
reported separately); "end to end" adds the conversion. The copies, the two conversions and the
loads run ``SHARDKIT_BENCH_REPEAT`` times (default 3; loads as repeated calls in one engine) and
report the median: on a shared machine one timing moves by 2-4x. After loading, each method reports a
digest of rank 0's fp32 partition and Adam moments: they must agree.

    python benchmarks/bench_resume.py [--workdir DIR] [--keep] [--json FILE] [--reshard-only]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# SHARDKIT_BENCH_MODEL=tiny runs the whole pipeline in a minute (to check the script itself).
MODEL = os.environ.get("SHARDKIT_BENCH_MODEL", "160m")
SAVE_WORLD, RESUME_WORLD = 2, 3
SEQ = 32
# This machine's load moves single timings by 2-4x; the steps the README's ratios come from are run
# REPEAT times (loads: REPEAT load_checkpoint calls in one engine) and the median is reported.
REPEAT = int(os.environ.get("SHARDKIT_BENCH_REPEAT", "3"))


def ds_config(world: int, universal: bool = False) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_batch_size": 6,
        "train_micro_batch_size_per_gpu": 6 // world,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10_000,
    }
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


# --- rank targets (spawned) ----------------------------------------------------------------------


def _engine(world: int, universal: bool = False):
    from shardkit.engines.deepspeed import initialize
    from shardkit.engines.model_factory import tiny_llama

    return initialize(tiny_llama(MODEL, seed=0), ds_config(world, universal))


def rank_save(out: str) -> float:
    import torch.distributed as dist

    from shardkit.engines.deepspeed import train_step
    from shardkit.engines.model_factory import synthetic_batch

    engine = _engine(dist.get_world_size())
    ids = synthetic_batch(engine.module.config.vocab_size, 6 // dist.get_world_size(), SEQ, 0, dist.get_rank())
    loss = train_step(engine, ids)
    engine.save_checkpoint(out, tag="global_step1")
    return loss


def rank_resume(method: str, ckpt: str) -> dict[str, Any]:
    import torch.distributed as dist

    t0 = time.perf_counter()
    engine = _engine(dist.get_world_size(), universal=method == "universal")
    t1 = time.perf_counter()
    engine_s = t1 - t0
    loads = []
    for _ in range(REPEAT):
        dist.barrier()
        t1 = time.perf_counter()
        if method == "shardkit_inprocess":
            from shardkit.checkpoint.ops.resume_zero3 import load_checkpoint_resharded

            load_checkpoint_resharded(engine, ckpt)
        else:
            path, _ = engine.load_checkpoint(ckpt)
            if path is None:
                raise RuntimeError(f"load_checkpoint({ckpt!r}) loaded nothing")
        dist.barrier()
        loads.append(time.perf_counter() - t1)
    opt = engine.optimizer
    h = hashlib.sha256()
    for flat in opt.fp32_partitioned_groups_flat:
        h.update(flat.detach().cpu().numpy().tobytes())
        st = opt.optimizer.state[flat]
        for key in ("exp_avg", "exp_avg_sq"):
            h.update(st[key].detach().float().cpu().numpy().tobytes())
    return {"engine_s": engine_s, "load_s": sorted(loads)[len(loads) // 2], "loads_s": loads, "digest": h.hexdigest()[:16],
            "global_steps": engine.global_steps}


def _resume_main(method: str, ckpt: str, result: str) -> None:
    from shardkit.run.spawn.process import run_ranks

    res = run_ranks(rank_resume, RESUME_WORLD, args=(method, ckpt), timeout=1500)
    Path(result).write_text(json.dumps([r.value for r in res]))


def _convert_to_zero3_main(source: str, out: str) -> None:
    from shardkit.checkpoint.ops.convert.to_zero3 import convert_to_zero3

    # the resuming run's config (bf16, sub_group_size default): the files must match its engine
    convert_to_zero3(source, out, world_size=RESUME_WORLD, ds_config=ds_config(RESUME_WORLD))


def _save_main(out: str) -> None:
    from shardkit.run.spawn.process import run_ranks

    run_ranks(rank_save, SAVE_WORLD, args=(out,), timeout=1500)


# --- measuring a process tree --------------------------------------------------------------------


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:
                stat = fh.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def _tree(root: int) -> list[int]:
    kids, out, todo = _children_map(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def _rss_bytes(pid: int) -> tuple[int, int]:
    """(current RSS, peak RSS VmHWM) of one process, 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            text = fh.read()
    except OSError:
        return 0, 0
    vals = {}
    for line in text.splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            k, v = line.split(":", 1)
            vals[k] = int(v.split()[0]) * 1024
    return vals.get("VmRSS", 0), vals.get("VmHWM", 0)


@dataclass
class Measured:
    name: str
    wall_s: float
    peak_rss: int
    """max(largest sampled sum of RSS over the process tree, largest VmHWM of any one process)."""
    processes: int
    """Distinct processes seen in the tree."""
    extra: dict[str, Any] = field(default_factory=dict)


def warm(path: Path) -> None:
    """Read every file under ``path`` once, so the step after it starts from a warm page cache.

    Without this the order of the steps decides the winner: the 3-rank engines take several GB
    each and evict whatever an earlier step left in the cache.
    """
    files = [str(f) for f in Path(path).rglob("*") if f.is_file()]
    for i in range(0, len(files), 500):
        subprocess.run(["cat", *files[i : i + 500]], stdout=subprocess.DEVNULL, check=True)


def measure(name: str, argv: list[str], env: dict[str, str] | None = None, inputs: Path | None = None) -> Measured:
    if inputs is not None:
        warm(inputs)
    print(f"[bench] {name}: {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    peak, seen = 0, set()
    hwm: dict[int, int] = {}  # last VmHWM (the kernel's own peak RSS) seen per pid
    done = threading.Event()
    out_chunks: list[bytes] = []

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out_chunks.append(line)
        done.set()

    threading.Thread(target=drain, daemon=True).start()
    while proc.poll() is None:
        pids = _tree(proc.pid)
        seen.update(pids)
        rss_hwm = {p: _rss_bytes(p) for p in pids}
        peak = max(peak, sum(rss for rss, _ in rss_hwm.values()))
        for p, (_, high) in rss_hwm.items():
            if high:
                hwm[p] = high
        time.sleep(0.02)
    # A 20 ms sampler can miss a short peak; the kernel's per-process high-water mark cannot. The
    # sum of HWMs would overstate (peaks at different moments), so report the larger of the
    # sampled sum and the largest single-process peak.
    peak = max(peak, max(hwm.values(), default=0))
    wall = time.perf_counter() - t0
    done.wait(10)
    if proc.returncode != 0:
        sys.stdout.write(b"".join(out_chunks[-60:]).decode(errors="replace"))
        raise SystemExit(f"[bench] {name} failed with exit code {proc.returncode}")
    print(f"[bench] {name}: {wall:.1f} s, peak RSS {peak / 2**20:,.0f} MiB over {len(seen)} processes", flush=True)
    return Measured(name, wall, peak, len(seen))


def measure_median(name: str, argv: list[str], env: dict[str, str] | None = None, inputs: Path | None = None,
                   before: Any = None) -> Measured:
    """``measure`` REPEAT times (``before()`` first each time, e.g. removing the output): the median
    wall time, the largest peak RSS; every wall time is kept in ``extra['walls']``."""
    runs = []
    for _ in range(REPEAT):
        if before is not None:
            before()
        runs.append(measure(name, argv, env, inputs))
    walls = sorted(m.wall_s for m in runs)
    return Measured(name, walls[len(walls) // 2], max(m.peak_rss for m in runs), max(m.processes for m in runs),
                    {"walls": [m.wall_s for m in runs]})


# --- the benchmark -------------------------------------------------------------------------------


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_reshard_only(workdir: Path) -> dict[str, Any]:
    """The copy floors and every `shardkit reshard` row (no DeepSpeed conversion, no 3-rank load):
    minutes instead of a quarter hour, for a quiet machine."""
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    ckpt = workdir / "ckpt"
    if not (ckpt / "latest").exists():
        raise SystemExit(f"[bench] --reshard-only needs the checkpoint of a full run in {ckpt} (--workdir DIR --keep)")
    tag_dir = ckpt / (ckpt / "latest").read_text().strip()
    results: dict[str, Any] = {"ckpt_bytes": _dir_bytes(tag_dir)}
    copy, out = workdir / "copy", workdir / "resharded"

    def fresh(p: Path) -> Path:
        shutil.rmtree(p, ignore_errors=True)
        return p

    results["copy"] = measure_median("cp -r checkpoint", ["cp", "-r", str(ckpt), str(copy)], inputs=ckpt, before=lambda: fresh(copy))
    results["copy_fsync"] = measure_median("cp -r checkpoint + fsync", ["sh", "-c", f'cp -r "{ckpt}" "{copy}" && find "{copy}" -type f -exec sync {{}} +'],
                                           inputs=ckpt, before=lambda: fresh(copy))
    fresh(copy)
    for key, extra in (("reshard_no_verify", ["--no-verify"]), ("reshard", [])):
        results[key] = measure_median(f"shardkit reshard {' '.join(extra)}", _py("-m", "shardkit", "reshard", str(ckpt), "--world-size",
                                      str(RESUME_WORLD), "-o", str(out), *extra), env, inputs=ckpt, before=lambda: fresh(out))
    results["reshard_bytes"] = _dir_bytes(out / tag_dir.name)
    fresh(out)
    results.update(sha256_rows(workdir, ckpt, env, out))
    results.update(scaling_rows(workdir, ckpt, env))
    return results


def run_convert_only(workdir: Path) -> dict[str, Any]:
    """``shardkit convert --to zero3`` of the kept checkpoint's DCP form: one process with its
    default writers and with one, and two launched processes x 1 writer (RANK/WORLD_SIZE, what
    srun/torchrun start on two nodes), beside ``cp -r`` + fsync of the DCP folder."""
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    ckpt = workdir / "ckpt"
    if not (ckpt / "latest").exists():
        raise SystemExit(f"[bench] --convert-only needs the checkpoint of a full run in {ckpt} (--workdir DIR --keep)")
    dcp, back, copy = workdir / "dcp", workdir / "zero3_back", workdir / "copy_dcp"
    shutil.rmtree(dcp, ignore_errors=True)
    results: dict[str, Any] = {"convert_to_dcp": measure("shardkit convert --to fsdp2", _py(
        "-m", "shardkit", "convert", str(ckpt), "--to", "fsdp2", "-o", str(dcp)), env, inputs=ckpt)}
    results["dcp_bytes"] = _dir_bytes(dcp)
    cfg = workdir / "ds_config.json"
    cfg.write_text(json.dumps(ds_config(RESUME_WORLD)))

    def fresh(p: Path) -> None:
        shutil.rmtree(p, ignore_errors=True)

    results["dcp_copy_fsync"] = measure_median(
        "cp -r DCP + fsync", ["sh", "-c", f'cp -r "{dcp}" "{copy}" && find "{copy}" -type f -exec sync {{}} +'],
        inputs=dcp, before=lambda: fresh(copy))
    fresh(copy)
    to_zero3 = _py("-m", "shardkit", "convert", str(dcp), "--to", "zero3", "--world-size", str(RESUME_WORLD),
                   "--ds-config", str(cfg), "-o", str(back))
    results["to_zero3"] = measure_median("shardkit convert --to zero3", to_zero3, env, inputs=dcp,
                                         before=lambda: fresh(back))
    results["to_zero3_one_writer"] = measure_median("shardkit convert --to zero3 --workers 1", [*to_zero3, "--workers", "1"],
                                                    env, inputs=dcp, before=lambda: fresh(back))
    cmd = " ".join(f"'{a}'" for a in [*to_zero3, "--workers", "1"])
    two = ["sh", "-c", "; ".join(f"RANK={r} WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29701 {cmd} & p{r}=$!"
                                 for r in range(2)) + "; wait $p0 && wait $p1"]
    results["to_zero3_two_processes"] = measure_median("shardkit convert --to zero3: 2 launched processes x 1 writer",
                                                       two, env, inputs=dcp, before=lambda: fresh(back))
    results["zero3_bytes"] = _dir_bytes(back)
    fresh(back)
    fresh(dcp)
    return results


def convert_only_table(r: dict[str, Any]) -> str:
    mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
    floor = r["dcp_copy_fsync"]
    rows = [f"| `shardkit convert --to zero3 --world-size {RESUME_WORLD}` | wall (s) | GB/s written | peak RSS (MiB) | "
            "vs 1 writer | vs `cp -r` + fsync of the DCP |", "|---|---:|---:|---:|---:|---:|"]
    base = r["to_zero3_one_writer"]
    for key, label in (("to_zero3_one_writer", "1 process, `--workers 1`"), ("to_zero3", "1 process, default writers"),
                       ("to_zero3_two_processes", "2 launched processes x 1 writer (RANK/WORLD_SIZE, as srun/torchrun)")):
        m = r[key]
        rows.append(f"| {label} | {m.wall_s:.2f} | {r['zero3_bytes'] / 1e9 / m.wall_s:.2f} | {mib(m.peak_rss)} | "
                    f"{base.wall_s / m.wall_s:.2f}x | {m.wall_s / floor.wall_s:.2f}x the time |")
    rows += ["", f"DCP source {r['dcp_bytes'] / 1e9:.2f} GB (`cp -r` + fsync {floor.wall_s:.2f} s), ZeRO-3 output "
             f"{r['zero3_bytes'] / 1e9:.2f} GB; medians of {REPEAT}."]
    return "\n".join(rows)


def sha256_twin(ckpt: Path, workdir: Path) -> Path:
    """The same checkpoint (hard links: no extra disk) under a manifest of sha256 digests, as every
    shardkit before blake3 sealed it; ``SHARDKIT_HASH=sha256`` then reshards it as they did."""
    twin = workdir / "ckpt_sha256"
    tag = (ckpt / "latest").read_text().strip()
    if not (twin / tag / "shardkit_manifest.json").exists():
        shutil.rmtree(twin, ignore_errors=True)
        subprocess.run(["cp", "-al", str(ckpt), str(twin)], check=True)
        (twin / tag / "shardkit_manifest.json").unlink()
        sys.path.insert(0, str(REPO))
        from shardkit.storage.manifest import seal

        os.environ["SHARDKIT_HASH"] = "sha256"
        try:
            seal(twin / tag, engine="deepspeed", world_size=SAVE_WORLD, zero_stage=3, dtype="bf16")
        finally:
            del os.environ["SHARDKIT_HASH"]
    return twin


def sha256_rows(workdir: Path, ckpt: Path, env: dict[str, str], out: Path) -> dict[str, Any]:
    """``shardkit reshard`` as before blake3 (sha256 for the source check and the new manifest), in the same run."""
    twin = sha256_twin(ckpt, workdir)
    env256 = {**env, "SHARDKIT_HASH": "sha256"}
    rows: dict[str, Any] = {}
    for key, extra in (("reshard_sha256_no_verify", ["--no-verify"]), ("reshard_sha256", [])):
        rows[key] = measure_median(f"shardkit reshard {' '.join(extra)} (sha256)", _py(
            "-m", "shardkit", "reshard", str(twin), "--world-size", str(RESUME_WORLD), "-o", str(out), *extra),
            env256, inputs=twin, before=lambda: shutil.rmtree(out, ignore_errors=True))
    shutil.rmtree(out, ignore_errors=True)
    return rows


def reshard_table(r: dict[str, Any]) -> str:
    cps = r["copy_fsync"]
    rows = ["| step | wall (s) | peak RSS (MiB) | vs `cp -r` + fsync |", "|---|---:|---:|---:|",
            f"| `cp -r` | {r['copy'].wall_s:.2f} | {r['copy'].peak_rss / 2**20:,.0f} | |",
            f"| `cp -r` + fsync of every file | {cps.wall_s:.2f} | {cps.peak_rss / 2**20:,.0f} | 1x |"]
    for key, label in (("reshard_no_verify", "--no-verify (sizes checked)"), ("reshard", "default (source digests verified)"),
                       ("reshard_sha256_no_verify", "sha256 as before blake3, --no-verify"),
                       ("reshard_sha256", "sha256 as before blake3, source verified")):
        if key not in r:
            continue
        m = r[key]
        rows.append(f"| `shardkit reshard` 2 -> 3, {label} | {m.wall_s:.2f} | {m.peak_rss / 2**20:,.0f} | "
                    f"{m.wall_s / cps.wall_s:.2f}x the time |")
    return "\n".join(rows) + "\n\n" + scaling_table(r)


def run(workdir: Path) -> dict[str, Any]:
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    ckpt = workdir / "ckpt"
    this = str(Path(__file__).resolve())
    results: dict[str, Any] = {}
    if not (ckpt / "latest").exists():
        results["build"] = measure("build checkpoint (2 ranks, 1 step)", _py(this, "_save", str(ckpt)), env)
    tag_dir = ckpt / (ckpt / "latest").read_text().strip()
    if not (tag_dir / "shardkit_manifest.json").exists():
        # as a run saving through shardkit has it: every shardkit row below verifies the source's
        # digests (DeepSpeed's tools read it unverified); the --no-verify row shows that cost
        from shardkit.storage.manifest import seal

        seal(tag_dir, engine="deepspeed", world_size=SAVE_WORLD, zero_stage=3, dtype="bf16")
    optim_files = sorted(tag_dir.glob("*optim_states.pt"))
    results["ckpt_bytes"] = _dir_bytes(tag_dir)
    results["optim_file_bytes"] = optim_files[0].stat().st_size

    def fresh(p: Path) -> Path:
        shutil.rmtree(p, ignore_errors=True)
        return p

    # floor
    copy = workdir / "copy"
    results["copy"] = measure_median("cp -r checkpoint", ["cp", "-r", str(ckpt), str(copy)], inputs=ckpt, before=lambda: fresh(copy))
    # coreutils `sync FILE...` fsyncs those files (not the whole machine's dirty pages)
    results["copy_fsync"] = measure_median("cp -r checkpoint + fsync", ["sh", "-c", f'cp -r "{ckpt}" "{copy}" && find "{copy}" -type f -exec sync {{}} +'],
                                           inputs=ckpt, before=lambda: fresh(copy))
    shutil.rmtree(copy, ignore_errors=True)
    # what every python tool below pays before it reads a byte
    results["imports"] = measure("python -c 'import torch, deepspeed'", _py("-c", "import torch, deepspeed"), env)

    # consolidate
    z2f = fresh(workdir / "zero_to_fp32_out")
    results["zero_to_fp32"] = measure(
        "zero_to_fp32.py --safe_serialization", _py(str(ckpt / "zero_to_fp32.py"), str(ckpt), str(z2f), "--safe_serialization"), env, inputs=ckpt)
    mine = workdir / "consolidated.safetensors"
    results["consolidate"] = measure("shardkit consolidate", _py("-m", "shardkit", "consolidate", str(ckpt), "-o", str(mine)), env, inputs=ckpt)
    results["consolidate_equal"] = (z2f / "model.safetensors").read_bytes() == mine.read_bytes()
    shutil.rmtree(z2f, ignore_errors=True)
    mine.unlink(missing_ok=True)

    # resume at 3 ranks
    def resume(label: str, method: str, path: Path) -> Measured:
        out = workdir / f"resume_{label}.json"
        m = measure(f"resume at {RESUME_WORLD} ranks: {label}", _py(this, "_resume", method, str(path), str(out)), env, inputs=path)
        ranks = json.loads(out.read_text())
        m.extra = {"load_s": max(r["load_s"] for r in ranks), "engine_s": max(r["engine_s"] for r in ranks),
                   "digest": ranks[0]["digest"], "global_steps": ranks[0]["global_steps"]}
        return m

    univ = workdir / "universal"
    results["ds_to_universal"] = measure_median(
        "ds_to_universal", _py("-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
                               "--output_folder", str(univ / f"{tag_dir.name}_universal")), env, inputs=ckpt,
        before=lambda: fresh(univ).mkdir())
    results["resume_universal"] = resume("load_universal", "universal", univ)
    shutil.rmtree(univ, ignore_errors=True)

    resharded = workdir / "resharded"
    results["reshard_no_verify"] = measure_median(
        "shardkit reshard --no-verify", _py("-m", "shardkit", "reshard", str(ckpt), "--world-size", str(RESUME_WORLD),
                                            "-o", str(resharded), "--no-verify"), env, inputs=ckpt,
        before=lambda: fresh(resharded))
    fresh(resharded)
    results["reshard"] = measure_median("shardkit reshard", _py("-m", "shardkit", "reshard", str(ckpt), "--world-size",
                                                                 str(RESUME_WORLD), "-o", str(resharded)), env, inputs=ckpt,
                                        before=lambda: fresh(resharded))
    results["reshard_bytes"] = _dir_bytes(resharded / tag_dir.name)
    results["resume_resharded"] = resume("reshard + plain load_checkpoint", "plain", resharded)
    shutil.rmtree(resharded, ignore_errors=True)
    results.update(sha256_rows(workdir, ckpt, env, resharded))
    same = workdir / "resharded_same"
    results["reshard_same"] = measure_median("shardkit reshard (same world size)", _py("-m", "shardkit", "reshard", str(ckpt), "--world-size",
                                                                                     str(SAVE_WORLD), "-o", str(same)), env, inputs=ckpt,
                                             before=lambda: fresh(same))
    shutil.rmtree(same, ignore_errors=True)
    results["resume_inprocess"] = resume("shardkit load_checkpoint_resharded", "shardkit_inprocess", ckpt)
    results.update(scaling_rows(workdir, ckpt, env))
    if _have_convert():
        results.update(convert_rows(workdir, ckpt, env, resume))
    return results


#: Writer threads tried for the scaling rows (`--workers`), and the size factor of the large case.
WORKERS = (1, 2, 4)
SCALE = int(os.environ.get("SHARDKIT_BENCH_SCALE", "10"))


def scaling_rows(workdir: Path, ckpt: Path, env: dict[str, str]) -> dict[str, Any]:
    """``shardkit reshard`` with 1..N writer threads, as 2 launched processes (what srun/torchrun
    start on two nodes, here on one machine), and on a checkpoint SCALE times larger
    (``_scale_zero3``), beside ``cp -r`` + fsync of that one."""
    out: dict[str, Any] = {}
    target = workdir / "scaled_out"

    def fresh() -> None:
        shutil.rmtree(target, ignore_errors=True)

    def reshard(src: Path, *extra: str) -> list[str]:
        return _py("-m", "shardkit", "reshard", str(src), "--world-size", str(RESUME_WORLD), "-o", str(target), *extra)

    for n in WORKERS:
        out[f"reshard_workers_{n}"] = measure_median(f"shardkit reshard --workers {n}", reshard(ckpt, "--workers", str(n)),
                                                     env, inputs=ckpt, before=fresh)
    cmd = " ".join(f"'{a}'" for a in reshard(ckpt, "--workers", "1"))
    two = ["sh", "-c", "; ".join(f"RANK={r} WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29700 {cmd} & p{r}=$!"
                                 for r in range(2)) + "; wait $p0 && wait $p1"]
    out["reshard_two_processes"] = measure_median("shardkit reshard: 2 launched processes x 1 writer", two, env,
                                                  inputs=ckpt, before=fresh)
    fresh()
    big_root = workdir / f"ckpt_x{SCALE}"
    if not (big_root / "latest").exists():
        sys.path.insert(0, str(REPO))
        from benchmarks._scale_zero3 import scale_checkpoint

        t0 = time.perf_counter()
        scale_checkpoint(ckpt, big_root, SCALE)
        out["scaled_generate_s"] = time.perf_counter() - t0
    big_tag = big_root / (big_root / "latest").read_text().strip()
    out["scaled_bytes"] = _dir_bytes(big_tag)
    copy = workdir / "copy_big"
    shutil.rmtree(copy, ignore_errors=True)
    # one run each: the source (SCALE x 1.9 GB) no longer fits the page cache beside the output
    out["scaled_copy_fsync"] = measure(f"cp -r + fsync, {SCALE}x checkpoint",
                                       ["sh", "-c", f'cp -r "{big_root}" "{copy}" && find "{copy}" -type f -exec sync {{}} +'])
    shutil.rmtree(copy, ignore_errors=True)
    out["scaled_reshard"] = measure(f"shardkit reshard, {SCALE}x checkpoint", reshard(big_root), env)
    fresh()
    if os.environ.get("SHARDKIT_BENCH_KEEP_SCALED") != "1":
        shutil.rmtree(big_root, ignore_errors=True)
    return out


def scaling_table(r: dict[str, Any]) -> str:
    gbs = lambda nbytes, m: nbytes / 1e9 / m.wall_s  # noqa: E731
    mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
    size, big = r["ckpt_bytes"], r["scaled_bytes"]
    base = r["reshard_workers_1"]
    rows = ["| `shardkit reshard` 2 -> 3 | checkpoint | wall (s) | GB/s | peak RSS (MiB) | vs 1 writer | vs `cp -r` + fsync |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for n in WORKERS:
        m = r[f"reshard_workers_{n}"]
        rows.append(f"| `--workers {n}` | {size / 1e9:.1f} GB | {m.wall_s:.2f} | {gbs(size, m):.2f} | {mib(m.peak_rss)} | "
                    f"{base.wall_s / m.wall_s:.2f}x | {m.wall_s / r['copy_fsync'].wall_s:.2f}x the time |")
    m = r["reshard_two_processes"]
    rows.append(f"| 2 launched processes x 1 writer (RANK/WORLD_SIZE, as srun/torchrun on 2 nodes) | {size / 1e9:.1f} GB | "
                f"{m.wall_s:.2f} | {gbs(size, m):.2f} | {mib(m.peak_rss)} | {base.wall_s / m.wall_s:.2f}x | "
                f"{m.wall_s / r['copy_fsync'].wall_s:.2f}x the time |")
    m, c = r["scaled_reshard"], r["scaled_copy_fsync"]
    rows.append(f"| default writers, {SCALE}x checkpoint (generated) | {big / 1e9:.1f} GB | {m.wall_s:.1f} | {gbs(big, m):.2f} | "
                f"{mib(m.peak_rss)} | | {m.wall_s / c.wall_s:.2f}x the time ({c.wall_s:.1f} s, {gbs(big, c):.2f} GB/s) |")
    small = r["reshard"]
    rows += ["", f"{SCALE}x the bytes: reshard time x{m.wall_s / small.wall_s:.1f} ({SCALE}x would be linear), peak RSS "
             f"{mib(small.peak_rss)} -> {mib(m.peak_rss)} MiB ({m.peak_rss / small.peak_rss - 1:+.0%})."]
    return "\n".join(rows)


def _have_convert() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(f"shardkit.checkpoint.ops.convert.{m}") is not None for m in ("to_dcp", "to_zero3"))


def convert_rows(workdir: Path, ckpt: Path, env: dict[str, str], resume: Any) -> dict[str, Any]:
    """``shardkit convert`` both ways, and the full-weights route a user has without it."""
    this = str(Path(__file__).resolve())
    out: dict[str, Any] = {}
    dcp = workdir / "dcp"
    shutil.rmtree(dcp, ignore_errors=True)
    out["convert_to_dcp"] = measure("shardkit convert --to fsdp2", _py("-m", "shardkit", "convert", str(ckpt), "--to", "fsdp2",
                                                                       "-o", str(dcp)), env, inputs=ckpt)
    dcp_tag = dcp / (dcp / "latest").read_text().strip()
    # the copy alone (no torch in the process), against `cp -r` + sync of the same checkpoint
    quick = workdir / "dcp_no_verify"
    out["convert_to_dcp_no_verify"] = measure_median(
        "shardkit convert --to fsdp2 --no-verify", _py("-m", "shardkit", "convert", str(ckpt), "--to", "fsdp2", "-o",
                                                       str(quick), "--no-verify"), env, inputs=ckpt,
        before=lambda: shutil.rmtree(quick, ignore_errors=True))
    shutil.rmtree(quick, ignore_errors=True)
    full = workdir / "dcp_full.pt"
    out["dcp_to_torch_save"] = measure("torch dcp_to_torch_save", _py("-m", "torch.distributed.checkpoint.format_utils",
                                                                       "dcp_to_torch", str(dcp_tag), str(full)), env, inputs=dcp)
    full.unlink(missing_ok=True)
    back = workdir / "zero3_back"
    shutil.rmtree(back, ignore_errors=True)
    out["convert_to_zero3"] = measure("shardkit convert --to zero3", _py(this, "_convert_to_zero3", str(dcp), str(back)), env, inputs=dcp)
    shutil.rmtree(dcp, ignore_errors=True)
    out["resume_converted"] = resume("convert round trip + plain load_checkpoint", "plain", back)
    shutil.rmtree(back, ignore_errors=True)
    return out


def table(r: dict[str, Any]) -> str:
    mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
    rate = lambda nbytes, m: nbytes / 2**20 / m.wall_s  # noqa: E731  MiB/s
    optim = r["optim_file_bytes"]
    uc_total = r["ds_to_universal"].wall_s + r["resume_universal"].extra["load_s"]
    rs_total = r["reshard"].wall_s + r["resume_resharded"].extra["load_s"]
    ip_total = r["resume_inprocess"].extra["load_s"]
    cp, cps, rs = rate(r["ckpt_bytes"], r["copy"]), rate(r["ckpt_bytes"], r["copy_fsync"]), rate(r["reshard_bytes"], r["reshard"])
    same = rate(r["ckpt_bytes"], r["reshard_same"])
    row = lambda label, m, note="": f"| {label} | {m.wall_s:.1f} | {mib(m.peak_rss)} | {m.processes} | {note} |"  # noqa: E731
    rows = [
        "| step | wall (s) | peak RSS (MiB) | processes | vs DeepSpeed |",
        "|---|---:|---:|---:|---|",
        row(f"floor: `cp -r` checkpoint ({mib(r['ckpt_bytes'])} MiB)", r["copy"], f"{cp:,.0f} MiB/s"),
        row("floor: `cp -r` + fsync of every file", r["copy_fsync"], f"{cps:,.0f} MiB/s"),
        row("fixed cost of every Python tool below: `import torch, deepspeed`", r["imports"]),
        row("DeepSpeed `zero_to_fp32.py --safe_serialization`", r["zero_to_fp32"], "1x"),
        row(f"`shardkit consolidate` (bytes equal: {r['consolidate_equal']})", r["consolidate"],
            f"{r['zero_to_fp32'].wall_s / r['consolidate'].wall_s:.1f}x faster, {r['consolidate'].peak_rss / r['zero_to_fp32'].peak_rss:.2f}x the RSS"),
        row("DeepSpeed `ds_to_universal` (conversion)", r["ds_to_universal"], f"1x; RSS {r['ds_to_universal'].peak_rss / optim:.2f}x one optim file"),
        row(f"`shardkit reshard` {SAVE_WORLD} -> {RESUME_WORLD} ranks (conversion)", r["reshard"],
            f"{r['ds_to_universal'].wall_s / r['reshard'].wall_s:.1f}x faster; RSS {r['reshard'].peak_rss / optim:.2f}x one optim file "
            f"({mib(optim)} MiB); {rs:,.0f} MiB/s = {rs / cp:.0%} of `cp -r`, **{rs / cps:.0%} of `cp -r` + fsync "
            f"({r['reshard'].wall_s / r['copy_fsync'].wall_s:.2f}x its time)**; source digests (blake3) verified"),
        row(f"`shardkit reshard --no-verify` {SAVE_WORLD} -> {RESUME_WORLD} (source sizes checked, not its digests)",
            r["reshard_no_verify"], f"{rate(r['reshard_bytes'], r['reshard_no_verify']) / cps:.0%} of `cp -r` + fsync "
            f"({r['reshard_no_verify'].wall_s / r['copy_fsync'].wall_s:.2f}x its time)"),
        *[row(f"`shardkit reshard` {SAVE_WORLD} -> {RESUME_WORLD} as before blake3 (`SHARDKIT_HASH=sha256`{label})", r[key],
              f"{r[key].wall_s / r['copy_fsync'].wall_s:.2f}x the time of `cp -r` + fsync")
          for key, label in (("reshard_sha256", ", source sha256 verified"), ("reshard_sha256_no_verify", ", --no-verify"))
          if key in r],
        row(f"`shardkit reshard` {SAVE_WORLD} -> {SAVE_WORLD} (nothing changes: hashed byte copy)", r["reshard_same"],
            f"{same:,.0f} MiB/s = {same / cp:.0%} of `cp -r`, {same / cps:.0%} of `cp -r` + fsync"),
        f"| 3-rank `load_checkpoint` with `load_universal` | {r['resume_universal'].extra['load_s']:.1f} | {mib(r['resume_universal'].peak_rss)} | {r['resume_universal'].processes} | 1x |",
        f"| 3-rank plain `load_checkpoint` of the resharded files | {r['resume_resharded'].extra['load_s']:.1f} | {mib(r['resume_resharded'].peak_rss)} | {r['resume_resharded'].processes} | "
        f"{r['resume_universal'].extra['load_s'] / r['resume_resharded'].extra['load_s']:.1f}x faster |",
        f"| 3-rank `shardkit.load_checkpoint_resharded` (no conversion) | {ip_total:.1f} | {mib(r['resume_inprocess'].peak_rss)} | {r['resume_inprocess'].processes} | "
        f"{r['resume_universal'].extra['load_s'] / ip_total:.1f}x faster |",
        f"| **end to end, DeepSpeed**: ds_to_universal + load_universal | {uc_total:.1f} | | | 1x |",
        f"| **end to end, shardkit reshard** + plain load | {rs_total:.1f} | | | **{uc_total / rs_total:.1f}x faster** |",
        f"| **end to end, shardkit in-process** load | {ip_total:.1f} | | | **{uc_total / ip_total:.1f}x faster** |",
    ]
    keys = ["resume_universal", "resume_resharded", "resume_inprocess"] + (["resume_converted"] if "resume_converted" in r else [])
    digests = {k: r[k].extra["digest"] for k in keys}
    engine = max(r[k].extra["engine_s"] for k in digests)
    rows.append("")
    rows.append(
        f"Loaded rank-0 fp32 + Adam state digests: {digests} ({'identical' if len(set(digests.values())) == 1 else 'DIFFERENT'}). "
        f"Building each 3-rank engine (same for every method, not in the resume times) took up to {engine:.1f} s; "
        f"whole resume processes incl. spawn and engine build: universal {r['resume_universal'].wall_s:.0f} s, "
        f"resharded {r['resume_resharded'].wall_s:.0f} s, in-process {r['resume_inprocess'].wall_s:.0f} s."
    )
    if "scaled_reshard" in r:
        rows += ["", scaling_table(r)]
    if "convert_to_dcp" in r:
        rows += ["", convert_table(r)]
    return "\n".join(rows)


def convert_table(r: dict[str, Any]) -> str:
    mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
    z2f, to_dcp, d2t, to_z3 = r["zero_to_fp32"], r["convert_to_dcp"], r["dcp_to_torch_save"], r["convert_to_zero3"]
    load = r["resume_converted"].extra["load_s"]
    same = r["resume_converted"].extra["digest"] == r["resume_resharded"].extra["digest"]
    lost = "weights only: **optimizer state lost** (fp32 masters, Adam moments, step)"
    return "\n".join([
        "| conversion | wall (s) | peak RSS (MiB) | what the resuming run gets |",
        "|---|---:|---:|---|",
        f"| ZeRO-3 -> FSDP2, today: DeepSpeed `zero_to_fp32.py` (full weights) then load them | {z2f.wall_s:.1f} | {mib(z2f.peak_rss)} | {lost} |",
        f"| ZeRO-3 -> FSDP2: `shardkit convert --to fsdp2` (DCP) | {to_dcp.wall_s:.1f} | {mib(to_dcp.peak_rss)} | "
        f"everything: fp32 masters, Adam moments, step, param groups ({z2f.wall_s / to_dcp.wall_s:.2f}x the speed of zero_to_fp32) |",
        *([f"| ZeRO-3 -> FSDP2: `shardkit convert --to fsdp2 --no-verify` | {r['convert_to_dcp_no_verify'].wall_s:.1f} | "
           f"{mib(r['convert_to_dcp_no_verify'].peak_rss)} | the same; {r['convert_to_dcp_no_verify'].wall_s / r['copy_fsync'].wall_s:.2f}x "
           "the time of `cp -r` + sync |"] if "convert_to_dcp_no_verify" in r else []),
        f"| FSDP2 -> ZeRO-3, today: torch `dcp_to_torch_save` (one full file) then load the weights | {d2t.wall_s:.1f} | {mib(d2t.peak_rss)} | "
        f"{lost}: DeepSpeed's load_checkpoint cannot take the file, only its weights can be loaded into the module |",
        f"| FSDP2 -> ZeRO-3: `shardkit convert --to zero3 --world-size {RESUME_WORLD}` | {to_z3.wall_s:.1f} | {mib(to_z3.peak_rss)} | "
        f"everything, loaded by DeepSpeed's plain `load_checkpoint` in {load:.1f} s; rank-0 state after the round trip "
        f"ZeRO-3 -> DCP -> ZeRO-3 {'identical to' if same else 'DIFFERENT from'} the resharded load ({d2t.wall_s / to_z3.wall_s:.2f}x the speed of dcp_to_torch_save) |",
    ])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_save":
        _save_main(argv[1])
        return 0
    if argv and argv[0] == "_convert_to_zero3":
        _convert_to_zero3_main(argv[1], argv[2])
        return 0
    if argv and argv[0] == "_resume":
        _resume_main(argv[1], argv[2], argv[3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=None, help="where the checkpoint and outputs go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the workdir (reuse its checkpoint next time)")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw numbers here")
    ap.add_argument("--reshard-only", action="store_true",
                    help="only the copy floors and the reshard rows (needs a kept workdir of a full run)")
    ap.add_argument("--convert-only", action="store_true",
                    help="only `convert --to zero3` by 1 and 2 processes (needs a kept workdir of a full run)")
    args = ap.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shardkit-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        if args.convert_only:
            results = run_convert_only(workdir)
            text = convert_only_table(results)
        elif args.reshard_only:
            results = run_reshard_only(workdir)
            text = reshard_table(results)
        else:
            results = run(workdir)
            text = table(results)
        print()
        print(text)
        if args.json:
            args.json.write_text(json.dumps({k: (v.__dict__ if isinstance(v, Measured) else v) for k, v in results.items()}, indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
