"""scripts/loaded_suite.sh runs the suite as CI does, only with the machine loaded: a test that
passes in CI must pass there. Its pytest runs as a background job of the script, which starts with
SIGINT ignored; Python keeps an ignored SIGINT, so every Ctrl-C test of the suite failed under the
script alone (test_staging_leftovers' three, 'DID NOT RAISE KeyboardInterrupt')."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_ctrl_c_reaches_the_tests_the_script_runs(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import signal, pytest\n"
        "def test_sigint_raises_keyboard_interrupt():\n"
        "    with pytest.raises(KeyboardInterrupt):\n"
        "        signal.raise_signal(signal.SIGINT)\n"
    )
    r = subprocess.run([str(REPO / "scripts" / "loaded_suite.sh"), str(probe), "-q", "-p", "no:randomly"],
                       env={**os.environ, "LOADED_RUNS": "1"}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "all 1 run(s) passed under load" in r.stdout
