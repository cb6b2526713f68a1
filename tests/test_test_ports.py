"""The suite's own port picker (tests/_ports.py): two jobs of the two xdist workers must never be
handed one MASTER_PORT, even when a library reseeded the random module in both the same way (CI's
test_no_ssh_one_launch_per_node failed with EADDRINUSE on a port the picker had checked free)."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

from tests._ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_a_reseeded_random_module_does_not_hand_out_the_same_port_twice():
    random.seed(0)
    first = free_port()
    random.seed(0)
    assert free_port() != first


def test_a_port_claimed_by_a_live_process_is_not_handed_to_another():
    """A second process (the other worker) gets other ports than a live one holds, in a span too."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from tests._ports import free_port; "
         "print(*[free_port(span=3) for _ in range(50)], flush=True); sys.stdin.read()"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        held = {p + i for p in map(int, holder.stdout.readline().split()) for i in range(3)}
        assert len(held) == 150
        mine = {free_port() for _ in range(200)}
        assert not mine & held
    finally:
        holder.communicate("", timeout=30)
