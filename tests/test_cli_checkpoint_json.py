"""reshard, convert, consolidate and export on a real ZeRO-3 checkpoint: --dry-run prints the plan and
writes nothing, --json reports what was read, written and checked and how long it took (JSON alone on
stdout), and the byte progress goes to stderr (never stdout), silenced by --quiet."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests import _ranks_zero3 as R
from tests._ports import job_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def source(tmp_path_factory):
    return R.build_sources(tmp_path_factory.getbasetemp() / "zero3")["fp32"]


@pytest.fixture(scope="session")
def model_config(tmp_path_factory):
    from shardkit.engines.model_factory import tiny_llama

    folder = tmp_path_factory.mktemp("tiny_config")
    tiny_llama("tiny", seed=0).config.save_pretrained(folder)
    return folder


def _tree(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every path under the roots with its size and mtime: what a run that writes nothing leaves equal."""
    seen = {}
    for root in roots:
        for dirpath, dirs, files in os.walk(root):
            for name in dirs + files:
                p = os.path.join(dirpath, name)
                st = os.lstat(p)
                seen[p] = (st.st_size, st.st_mtime_ns)
    return seen


@pytest.mark.parametrize("argv, output", [
    (["reshard", "SRC", "--world-size", "3", "-o", "OUT/ws3"], "OUT/ws3/global_step2"),
    (["convert", "SRC", "--to", "fsdp2", "-o", "OUT/dcp"], "OUT/dcp/global_step2"),
    (["consolidate", "SRC", "-o", "OUT/model.safetensors"], "OUT/model.safetensors"),
    (["export", "SRC", "-o", "OUT/hf", "--model-config", "CFG"], "OUT/hf"),
])
def test_dry_run_prints_the_plan_and_writes_nothing(run_cli, source, model_config, tmp_path, argv, output):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = [a.replace("SRC", str(source)).replace("OUT", str(out_dir)).replace("CFG", str(model_config)) for a in argv]
    before = _tree(tmp_path, source)
    code, out, err = run_cli(*args, "--dry-run", "--json")
    assert code == 0, err
    assert _tree(tmp_path, source) == before  # not a file, folder, staging folder or timestamp changed
    plan = json.loads(out)
    assert plan["dry_run"] is True and plan["wrote"] is None
    assert plan["output"] == output.replace("OUT", str(out_dir))
    assert plan["read"]["files"] == 4 and plan["read"]["bytes"] == sum(f.stat().st_size for f in (source / "global_step2").iterdir())
    assert plan["processes"] == 1 and plan["launcher"] == "single process" and plan["staging"]
    assert "nothing was written (--dry-run)" in err and "would read 4 files" in err


def test_dry_run_reports_a_refusal_the_real_run_would_meet(run_cli, source, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    code, out, err = run_cli("reshard", source, "--world-size", "3", "-o", tmp_path / "taken", "--dry-run")
    assert code == 2 and str(tmp_path / "taken") in err and "nothing was written" not in err
    assert sorted(p.name for p in (tmp_path / "taken").iterdir()) == ["notes.txt"]
    real_code, _, real_err = run_cli("reshard", source, "--world-size", "3", "-o", tmp_path / "taken")
    assert (real_code, real_err) == (code, err)  # the plan met the refusal the real run meets


def test_reshard_json_reports_read_written_checked_and_time(run_cli, source, tmp_path):
    code, out, err = run_cli("reshard", source, "--world-size", "3", "-o", tmp_path / "ws3", "--json")
    assert code == 0, err
    r = json.loads(out)
    written = tmp_path / "ws3" / "global_step2"
    assert r["ok"] and r["dry_run"] is False and r["world_size"] == {"from": 2, "to": 3}
    assert r["read"]["files"] == 4
    assert r["wrote"]["path"] == str(written)
    files = [f for f in written.iterdir() if f.name != "shardkit_manifest.json"]
    assert r["wrote"]["files"] == len(files) == 6 and r["wrote"]["bytes"] == sum(f.stat().st_size for f in files)
    assert r["checked"].startswith("not verified") and r["seconds"] > 0
    # the human lines and the progress went to stderr
    assert f"wrote {written}" in err
    assert "shardkit reshard: " in err and "(100%)" in err and "(done after" in err


def test_convert_both_ways_and_consolidate_report_json(run_cli, source, tmp_path):
    code, out, err = run_cli("reshard", source, "--world-size", "2", "-o", tmp_path / "ws2", "--quiet")
    assert code == 0, err
    assert "(done after" not in err  # --quiet: no progress line
    code, out, err = run_cli("convert", tmp_path / "ws2", "--to", "fsdp2", "-o", tmp_path / "dcp", "--json")
    assert code == 0, err
    c = json.loads(out)
    assert c["engines"] == {"from": "zero3", "to": "fsdp2"} and c["wrote"]["bytes"] > 0
    assert c["checked"].startswith("sizes and content digests") and "fp32 masters" in " ".join(c["carried"])
    target = tmp_path / "c.json"
    code, out, err = run_cli("convert", tmp_path / "dcp", "--to", "zero3", "--world-size", "2", "-o", tmp_path / "back",
                             "--json-file", target)
    assert code == 0, err
    back = json.loads(target.read_text())
    assert back["engines"] == {"from": "fsdp2", "to": "zero3"} and back["world_size"] == 2
    assert "wrote " in out  # --json-file only: the human lines stay on stdout
    # the plain progress line (stderr not a terminal) names the total the rank files were planned at
    assert re.search(r"shardkit convert: [\d.]+ \w*B of [\d.]+ \w*B \(\d+%\), .* \(done after", err), err
    code, out, err = run_cli("consolidate", tmp_path / "ws2", "-o", tmp_path / "m.safetensors", "--json")
    assert code == 0, err
    m = json.loads(out)
    assert m["wrote"]["bytes"] == (tmp_path / "m.safetensors").stat().st_size and m["wrote"]["files"] == 1
    assert m["source_world_size"] == 2 and m["checked"].startswith("sizes and content digests")


def test_export_json(run_cli, source, model_config, tmp_path):
    code, out, err = run_cli("export", source, "-o", tmp_path / "hf", "--model-config", model_config, "--json")
    assert code == 0, err
    e = json.loads(out)
    assert e["wrote"]["path"] == str(tmp_path / "hf") and e["wrote"]["files"] == ["model.safetensors"]
    assert e["wrote"]["bytes"] <= (tmp_path / "hf" / "model.safetensors").stat().st_size
    assert e["source_kind"] == "zero3" and e["seconds"] > 0
    assert "shardkit export: " in err and "(100%)" in err  # the total was known before the first byte


def test_two_processes_rank_0_reports_the_job_and_says_how_it_knows(source, tmp_path):
    """Under torchrun/srun (their variables): rank 0's progress is the whole job's (rank 1's counts from
    its heartbeat file; it says how it knows); rank 1 shows none; each prints its own JSON result."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")}
    port = job_port()
    procs = [subprocess.Popen([sys.executable, "-m", "shardkit", "reshard", str(source), "--world-size", "3", "-o",
                               str(tmp_path / "ws3"), "--json"],
                              env={**env, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": port},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        (out0, err0), (out1, err1) = (p.communicate(timeout=300) for p in procs)
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 0 and procs[1].returncode == 0, err0 + err1
    r0, r1 = json.loads(out0), json.loads(out1)
    assert (r0["rank"], r0["processes"], r0["launcher"]) == (0, 2, "torchrun") and r0["wrote"]["files"] == 6
    assert r1["rank"] == 1 and r1["wrote"]["share_bytes"] > 0 and "path" not in r1["wrote"]
    # rank 1's heartbeat file, or (before it held a plan) rank 0's own share x 2: the line says which
    assert ("(all 2 processes, from their heartbeat files)" in err0
            or "estimated for 2 processes: this process's share x 2" in err0), err0
    assert re.search(r"shardkit reshard: \d", err0) and not re.search(r"shardkit reshard: \d", err1)  # rank 0 only
