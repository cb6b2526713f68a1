"""The README's walkthrough, run as written, line by line: the documented commands chain (config ->
check -> preflight -> smoke -> verify -> reshard -> consolidate -> launch) and stay true."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def walkthrough_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Walkthrough", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README: the Walkthrough section has no bash block"
    return [ln.strip() for ln in block.group(1).splitlines() if ln.strip() and not ln.strip().startswith("#")]


def test_walkthrough_uses_every_command():
    used = {shlex.split(c)[1] for c in walkthrough_commands()}
    assert {"config", "check", "versions", "preflight", "smoke", "verify", "reshard", "consolidate", "launch"} <= used


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_readme_walkthrough_runs_top_to_bottom(tmp_path):
    # The walkthrough is run "from the repository root": give it the paths it names, and nothing
    # of the checkout it could write into.
    for name in ("launch", "tests"):
        (tmp_path / name).symlink_to(REPO / name)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    for line in walkthrough_commands():
        argv = shlex.split(line)
        assert argv[0] == "shardkit"
        r = subprocess.run([sys.executable, "-m", "shardkit", *argv[1:]], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"README walkthrough line failed (exit {r.returncode}): {line}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        if argv[1] == "check":
            assert "no findings" in r.stdout, r.stdout
    assert (tmp_path / "ckpt" / "latest").is_file() and (tmp_path / "ckpt_ws3" / "latest").is_file()
    assert (tmp_path / "model.safetensors").stat().st_size > 0
    assert {"after_init", "after_step"} <= set(__import__("json").loads((tmp_path / "run.json").read_text()))
