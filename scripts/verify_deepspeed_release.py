#!/usr/bin/env python3
"""Verify one DeepSpeed release, or one torch release, against shardkit: install the pair into a
throwaway virtualenv, run `shardkit smoke` there, round-trip the smoke's ZeRO-3 checkpoint through
`shardkit reshard` and `shardkit convert`, and record the result in
shardkit/data/verified_releases.json.

    python scripts/verify_deepspeed_release.py 0.18.9
    python scripts/verify_deepspeed_release.py 0.19.8 --torch 2.13.0 --keep
    python scripts/verify_deepspeed_release.py 0.19.8 --torch 2.6.0 --torch-index-url https://download.pytorch.org/whl/cpu

A torch release is verified with a DeepSpeed release (a row is one pair): pass the DeepSpeed the
suite runs on and vary --torch. On Linux PyPI's torch wheels are CUDA builds (several GB in the
venv, still run on CPU ranks here); --torch-index-url takes torch from another index (PyTorch's CPU
index) and nothing else from it.

The venv is a plain ``python -m venv`` (never --system-site-packages: the point is to import the
DeepSpeed release under test, not the one already installed). DeepSpeed is built from its sdist with
DS_BUILD_OPS=0 (ops are JIT-built on first use, into a per-venv TORCH_EXTENSIONS_DIR so releases
never share a stale build); shardkit is installed from this checkout with --no-deps, next to the
dependencies it names. The smoke is run from outside the checkout so the installed copy is tested:
ZeRO-3 with the repository's ds_configs/zero3.json and FSDP2 with ds_configs/fsdp2_full_shard.json,
2 CPU ranks (gloo), 4 steps, resume after 2. The ZeRO-3 run's checkpoint is then kept and taken
ZeRO-3 -> reshard to 1 rank -> reshard to 2 ranks, and ZeRO-3 -> convert --to fsdp2 -> convert
--to zero3 at 2 ranks; each round trip's files must equal the original's tensor for tensor, in bits
(scripts/_release_roundtrip.py, run by the venv's Python). A pair passes when both smokes resume
bit-exact and both round trips are bit-equal.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomllib  # Python >= 3.11: this maintainer script, not the package, reads pyproject.toml

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "shardkit" / "data" / "verified_releases.json"
# What shardkit imports besides torch and deepspeed: pyproject's dependencies, minus those two
# (read, not copied, so a dependency added there is installed here too).
SHARDKIT_DEPS = [d for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
                 if not d.startswith(("torch", "deepspeed"))]
SMOKES = [("zero3", "ds_configs/zero3.json"), ("fsdp2", "ds_configs/fsdp2_full_shard.json")]


def _run(cmd: list[str], log: Path, env: dict[str, str], cwd: Path, timeout: float) -> int:
    with log.open("a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        try:
            return subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            fh.write(f"timed out after {timeout:.0f}s\n")
            return 124


def _tail(log: Path, lines: int = 8) -> str:
    text = log.read_text(errors="replace").strip().splitlines()
    return " | ".join(line.strip() for line in text[-lines:] if line.strip())


def _round_trips(venv: Path, kept: Path, workdir: Path, log: Path, env: dict[str, str]) -> list[dict]:
    """reshard 2 -> 1 -> 2 ranks and convert zero3 -> fsdp2 -> zero3 of the smoke's kept ZeRO-3
    checkpoint, each compared with the original by _release_roundtrip.py in the venv."""
    shardkit, py = str(venv / "bin" / "shardkit"), str(venv / "bin" / "python")
    checker = str(REPO / "scripts" / "_release_roundtrip.py")
    tag = (kept / "latest").read_text().strip()
    ds_config = workdir / "kept-ds-config.json"
    plans = {
        "reshard 2 -> 1 -> 2 ranks": [
            [shardkit, "reshard", str(kept), "--world-size", "1", "-o", str(workdir / "rt-reshard-1")],
            [shardkit, "reshard", str(workdir / "rt-reshard-1"), "--world-size", "2", "-o", str(workdir / "rt-reshard-2")],
        ],
        "convert zero3 -> fsdp2 -> zero3 at 2 ranks": [
            [py, checker, "ds-config", str(kept / tag), str(ds_config)],
            [shardkit, "convert", str(kept), "--to", "fsdp2", "-o", str(workdir / "rt-dcp")],
            [shardkit, "convert", str(workdir / "rt-dcp"), "--to", "zero3", "--world-size", "2",
             "--ds-config", str(ds_config), "-o", str(workdir / "rt-zero3")],
        ],
    }
    results = {"reshard 2 -> 1 -> 2 ranks": workdir / "rt-reshard-2", "convert zero3 -> fsdp2 -> zero3 at 2 ranks": workdir / "rt-zero3"}
    for name in ("rt-reshard-1", "rt-reshard-2", "rt-dcp", "rt-zero3"):  # a rerun's outputs start empty
        shutil.rmtree(workdir / name, ignore_errors=True)
    out = []
    for name, commands in plans.items():
        t0 = time.monotonic()
        entry: dict = {"check": name}
        failed = next((c for c in commands if _run(c, log, env, workdir, 1800)), None)
        if failed is not None:
            entry.update(ok=False, failure=f"`{' '.join(failed[1:3])}` failed: {_tail(log)}")
        else:
            cmp = subprocess.run([py, checker, "compare", str(kept / tag), str(results[name] / tag)],
                                 capture_output=True, text=True, env=env, cwd=workdir)
            lines = [line for line in cmp.stdout.splitlines() if line.startswith("{")]
            if not lines:
                entry.update(ok=False, failure=f"compare exited {cmp.returncode}: {cmp.stderr.strip()[-400:]}")
            else:
                found = json.loads(lines[-1])
                entry.update(ok=found["ok"], files=found["files"], tensors=found["tensors"])
                if not found["ok"]:
                    entry["failure"] = found["first_difference"]
        entry["seconds"] = round(time.monotonic() - t0)
        out.append(entry)
    return out


def _smoke_flags(venv: Path, env: dict[str, str], cwd: Path) -> tuple[str, str]:
    """The smoke's (write-JSON-to-a-file, rank count) flags in the shardkit under test: --json FILE
    and --nproc before the one-vocabulary change, --json-file PATH and --world-size after it."""
    text = subprocess.run([str(venv / "bin" / "shardkit"), "smoke", "--help"], capture_output=True, text=True, env=env, cwd=cwd).stdout
    return ("--json-file" if "--json-file" in text else "--json"), ("--world-size" if "--world-size" in text else "--nproc")


def verify(version: str, torch_version: str, workdir: Path, steps: int, nproc: int, torch_index_url: str | None = None) -> dict:
    venv = workdir / f"ds-{version}-torch-{torch_version}"
    log = workdir / f"ds-{version}-torch-{torch_version}.log"
    log.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(DS_BUILD_OPS="0", OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(venv / "torch_extensions"))
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    row: dict = {
        "deepspeed": version,
        "torch": torch_version,
        "python": platform.python_version(),
        "date": dt.date.today().isoformat(),
        "platform": f"{platform.system().lower()} cpu, gloo, {nproc} ranks",
        # what a pass means, so a row is never read as "everything in this release works"
        "covers": "ZeRO-3 and FSDP2 train/save/resume bit-exact, placement preflight after resume; "
                  "reshard 2->1->2 and convert zero3->fsdp2->zero3 of the ZeRO-3 checkpoint bit-equal; "
                  "ZeRO-1/2, offload and GPU kernels not exercised",
        "smoke": [],
    }
    t0 = time.monotonic()
    if not (venv / "bin" / "python").exists():
        if _run([sys.executable, "-m", "venv", str(venv)], log, env, workdir, 300):
            return {**row, "result": "fail", "broke": f"venv creation failed: {_tail(log)}"}
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    # torch first and alone, so --torch-index-url serves torch and nothing else
    index = ["--index-url", torch_index_url] if torch_index_url else []
    if _run([*pip, *index, f"torch=={torch_version}"], log, env, workdir, 3600):
        return {**row, "result": "fail", "broke": f"pip install torch=={torch_version} failed: {_tail(log)}"}
    if _run([*pip, f"torch=={torch_version}", f"deepspeed=={version}", *SHARDKIT_DEPS], log, env, workdir, 1800):
        return {**row, "result": "fail", "broke": f"pip install deepspeed=={version} failed: {_tail(log)}"}
    # Built from a copy: building in the checkout would write build/ and *.egg-info into it. In a git
    # checkout the copy is the committed tree (git archive HEAD), so a row names the commit it tested
    # and never half-saved work in the working tree.
    src = workdir / "shardkit-src"
    shutil.rmtree(src, ignore_errors=True)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if commit.returncode == 0:
        src.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        row["shardkit_commit"] = commit.stdout.strip()
    else:
        shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"))
    if _run([*pip, "--no-deps", "--force-reinstall", str(src)], log, env, workdir, 600):
        return {**row, "result": "fail", "broke": f"installing shardkit failed: {_tail(log)}"}
    row["install_seconds"] = round(time.monotonic() - t0)
    # DeepSpeed logs to stdout on import (accelerator selection): the versions are the last line
    probe = subprocess.run([py, "-c", "import deepspeed, torch, transformers; "
                            "print('VERSIONS', deepspeed.__version__, torch.__version__, transformers.__version__)"],
                           capture_output=True, text=True, env=env, cwd=workdir)
    if probe.returncode != 0:
        return {**row, "result": "fail", "broke": f"import failed: {probe.stderr.strip().splitlines()[-1:]}"}
    versions_line = next(line for line in probe.stdout.splitlines()[::-1] if line.startswith("VERSIONS "))
    # recorded as Python reports them (torch "2.13.0+cpu"), the form `shardkit versions` compares
    ds_seen, row["torch"], row["transformers"] = versions_line.split()[1:4]
    if ds_seen != version:
        return {**row, "result": "fail", "broke": f"asked for deepspeed {version}, the venv imports {ds_seen}"}
    broke = []
    json_flag, ranks_flag = _smoke_flags(venv, env, workdir)
    # An op build killed by an earlier run in this workdir (shardkit's 30-minute build limit, on a
    # loaded machine) leaves its lock in the venv's own extensions folder, and the smoke then refuses
    # to start. Only this script builds there, so its locks are this script's leftovers.
    for lock in (venv / "torch_extensions").glob("*/lock"):
        lock.unlink()
    kept = workdir / "kept-zero3"
    shutil.rmtree(kept, ignore_errors=True)
    for engine, config in SMOKES:
        out = workdir / f"ds-{version}-{engine}.json"
        t1 = time.monotonic()
        keep = ["--keep-checkpoint", str(kept)] if engine == "zero3" else []
        code = _run([str(venv / "bin" / "shardkit"), "smoke", "--engine", engine, ranks_flag, str(nproc), "--device", "cpu", "--steps", str(steps),
                     "--config", str(REPO / config), json_flag, str(out), "--quiet", *keep,
                     # the first run of a fresh venv JIT-builds DeepSpeed's CPU Adam (minutes on 2 cores)
                     "--timeout", "1500"], log, env, workdir, 3600)
        entry = {"engine": engine, "config": config, "exit_code": code, "seconds": round(time.monotonic() - t1)}
        if out.exists():
            (result,) = json.loads(out.read_text())["results"]
            entry.update(ok=result["ok"], exact=result["exact"], preflight=result["preflight"], checkpoint=result["checkpoint"])
            if not result["ok"]:
                broke.append(f"{engine}: {result['failure']}")
        else:
            broke.append(f"{engine}: smoke exited {code} without a report: {_tail(log)}")
        row["smoke"].append(entry)
    if (kept / "latest").exists():
        row["round_trips"] = _round_trips(venv, kept, workdir, log, env)
        broke += [f"{c['check']}: {c['failure']}" for c in row["round_trips"] if not c["ok"]]
    else:
        broke.append(f"no ZeRO-3 checkpoint kept in {kept} for the reshard and convert round trips")
    row["result"] = "pass" if not broke else "fail"
    row["broke"] = "; ".join(broke) or None
    return row


def _release_key(version: str) -> list[int]:
    return [int(x) for x in version.split("+")[0].split(".") if x.isdigit()]


def record(row: dict, path: Path = RECORD) -> None:
    """Merge ``row`` into the record: passing releases under "releases" (what `shardkit versions`
    reads as verified), failing ones under "failed", one row per (deepspeed, torch)."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data["about"] = ("DeepSpeed and torch releases checked with scripts/verify_deepspeed_release.py (shardkit smoke, "
                     "and since 2026-11-26 reshard/convert round trips, in a fresh venv); one row per (deepspeed, torch) pair")
    key = (row["deepspeed"], row["torch"])
    for name in ("releases", "failed"):
        data[name] = [r for r in data.get(name, []) if (r.get("deepspeed"), r.get("torch")) != key]
    data["releases" if row["result"] == "pass" else "failed"].append(row)
    for name in ("releases", "failed"):
        data[name].sort(key=lambda r: (_release_key(r["deepspeed"]), _release_key(r["torch"])), reverse=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version", help="DeepSpeed release, e.g. 0.18.9")
    parser.add_argument("--torch", default=None, help="torch version for the venv (default: this interpreter's)")
    parser.add_argument("--torch-index-url", default=None,
                        help="index torch alone is installed from (https://download.pytorch.org/whl/cpu for a CPU build; default: pip's)")
    parser.add_argument("--workdir", default=None, help="where venvs and logs go (default: a temp dir, removed unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the venv and logs")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--no-record", action="store_true", help="print the result, do not write verified_releases.json")
    args = parser.parse_args()
    torch_version = args.torch
    if torch_version is None:
        from importlib.metadata import version

        torch_version = version("torch").split("+")[0]
    own = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="shardkit-verify-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        row = verify(args.version, torch_version, workdir, args.steps, args.nproc, args.torch_index_url)
    except BaseException:
        print(f"logs kept in {workdir}", file=sys.stderr)
        raise
    if own and not args.keep and row["result"] == "pass":
        shutil.rmtree(workdir, ignore_errors=True)
    elif row["result"] != "pass":
        print(f"logs kept in {workdir}", file=sys.stderr)
    print(json.dumps(row, indent=2))
    if not args.no_record:
        record(row)
    return 0 if row["result"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
