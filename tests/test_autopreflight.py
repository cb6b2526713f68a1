"""The sitecustomize hook `shardkit launch` puts into ranks: active only in ranks, lazy, chained to
an existing sitecustomize, and catching optimizer state left behind on another device."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from shardkit.autopreflight import EXIT_CODE, enabled, rank_env

PROBE = textwrap.dedent(
    """
    import sys
    print("torch_at_start", "torch" in sys.modules)
    print("watcher", any(type(f).__name__ == "_AfterImport" for f in sys.meta_path))
    print("chained", getattr(sys.modules.get("_shardkit_shadowed_sitecustomize"), "MARK", None))
    """
)


def _python(code: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


def _env(tmp_path, **extra: str) -> dict[str, str]:
    other = tmp_path / "other_site"
    other.mkdir(exist_ok=True)
    (other / "sitecustomize.py").write_text("MARK = 'existing sitecustomize ran'\n")
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "SHARDKIT_AUTOPREFLIGHT")}
    base["PYTHONPATH"] = os.pathsep.join([str(other), base.get("PYTHONPATH", "")])
    env = rank_env(base)
    env.update(extra)
    return env


def test_in_a_rank_the_hook_waits_for_torch_and_chains_to_the_existing_sitecustomize(tmp_path):
    r = _python(PROBE, _env(tmp_path, RANK="0", WORLD_SIZE="1"))
    assert r.returncode == 0, r.stderr
    assert "torch_at_start False" in r.stdout  # nothing imported eagerly at interpreter start
    assert "watcher True" in r.stdout
    assert "chained existing sitecustomize ran" in r.stdout


def test_the_launcher_process_itself_is_left_alone(tmp_path):
    env = _env(tmp_path)  # no RANK: torchrun's agent / the deepspeed runner
    assert not enabled(env)
    r = _python(PROBE, env)
    assert "watcher False" in r.stdout and "chained existing sitecustomize ran" in r.stdout


SINGLE_RANK_RESUME = textwrap.dedent(
    """
    import torch, torch.nn as nn
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # CPU analog of optimizer state left behind: the state a broken resume leaves (moments on another device)
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(10.0), "exp_avg": torch.zeros_like(p, device="meta"),
                        "exp_avg_sq": torch.zeros_like(p)}
    with torch.no_grad():
        model(torch.randn(2, 4))            # evaluation forward: not the training model's first step
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    print("stepped")
    """
)


@pytest.mark.slow
def test_resumed_optimizer_state_on_the_wrong_device_stops_the_rank(tmp_path):
    r = _python(SINGLE_RANK_RESUME, _env(tmp_path, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"))
    assert r.returncode == EXIT_CODE, r.stdout + r.stderr
    assert "exp_avg" in r.stdout and "meta" in r.stdout
    assert "placement preflight failed before the first optimizer step" in r.stderr
    assert "stepped" not in r.stdout


FROZEN_HELPER_FIRST = textwrap.dedent(
    """
    import torch, torch.nn as nn
    helper = nn.Linear(4, 4).requires_grad_(False)   # a frozen encoder, never put in .eval()
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():                     # a broken resume: moments on another device
        opt.state[p] = {"step": torch.tensor(10.0), "exp_avg": torch.zeros_like(p, device="meta"),
                        "exp_avg_sq": torch.zeros_like(p)}
    untrained = nn.Linear(4, 4)                      # trainable, but no optimizer holds it
    features = untrained(helper(torch.randn(2, 4)))  # both run in training mode, before the model
    model(features).sum().backward()
    opt.step()
    print("stepped")
    """
)


@pytest.mark.slow
def test_a_frozen_helper_forward_first_does_not_stand_in_for_the_trained_model(tmp_path):
    r = _python(FROZEN_HELPER_FIRST, _env(tmp_path, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"))
    assert r.returncode == EXIT_CODE, r.stdout + r.stderr
    assert "optimizer.state" in r.stdout and "exp_avg" in r.stdout and "meta" in r.stdout
    assert "placement preflight failed before the first optimizer step" in r.stderr
    assert "stepped" not in r.stdout
