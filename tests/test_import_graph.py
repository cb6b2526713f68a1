"""The house plan holds: shardkit's import graph (function-level imports included) has no cycle and
no import that runs back up a layer (scripts/import_graph.py lists the layers)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_no_import_cycles_and_no_upward_imports():
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "import_graph.py")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no cycles, no upward imports" in r.stdout
