"""The installed package behaves like the checkout: a wheel built from this tree, installed into a
fresh virtual environment (no downloads: --no-deps, the machine's torch/deepspeed through
--system-site-packages), runs `shardkit smoke` from another directory on the presets it ships."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _clean_env() -> dict[str, str]:
    """The environment without the checkout on PYTHONPATH (conftest puts it there for spawned ranks)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PIP_NO_INDEX"] = "1"  # never download: everything needed is on this machine
    return env


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_installed_wheel_ships_the_presets_and_smokes_from_another_directory(tmp_path):
    env = _clean_env()
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(REPO)],
        check=True, env=env, cwd=tmp_path, timeout=300,
    )
    (wheel,) = dist.glob("shardkit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n.rsplit("/", 1)[-1] for n in names if n.startswith("shardkit/ds_configs/")}
    assert {"zero3.json", "fsdp2_full_shard.json"} <= shipped, sorted(names)

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, env=env, cwd=tmp_path, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(python), "-c", "import shardkit; print(shardkit.__file__)"], check=True,
                           capture_output=True, text=True, env=env, cwd=elsewhere).stdout.strip()
    assert Path(where).is_relative_to(env_dir), f"imported {where}, not the installed wheel"

    r = subprocess.run([str(env_dir / "bin" / "shardkit"), "smoke", "--engine", "zero3", "--steps", "2", "--device", "cpu",
                        "--quiet", "--json", "report.json"],
                       capture_output=True, text=True, env=env, cwd=elsewhere, timeout=800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((elsewhere / "report.json").read_text())
    # the shipped preset, not a generated config: the installed package finds its own data
    assert [e["config_source"] for e in report["results"]] == ["preset zero3.json"], report
