"""What `shardkit launch` and its ranks agree on: the environment variables, the exit status of a
rank whose preflight failed, and where the ``sitecustomize`` lives."""

from __future__ import annotations

import os
from pathlib import Path

ENV_ENABLE = "SHARDKIT_AUTOPREFLIGHT"
"""Set to "1" by `shardkit launch` unless --no-preflight."""
ENV_CONFIG = "SHARDKIT_AUTOPREFLIGHT_CONFIG"
"""Path of the config the launcher found; gives the preflight the expected devices (FSDP2 offload)."""
ENV_TIMEOUT = "SHARDKIT_AUTOPREFLIGHT_TIMEOUT"
"""Seconds the preflight waits for every rank (default 120: ranks reach their first step at different times)."""
ENV_JSON = "SHARDKIT_AUTOPREFLIGHT_JSON"
"""Optional path where rank 0 writes the preflight report as JSON."""
EXIT_CODE = 3
"""Exit status of a rank whose placement preflight failed (the launcher then stops the others)."""

DEFAULT_TIMEOUT_S = 120.0


def site_dir() -> Path:
    """The directory to put first on the ranks' PYTHONPATH: ``shardkit/startup``, which holds only
    the ``sitecustomize.py`` that installs the hooks. It is a folder, not an import: the rank's
    interpreter runs it as the top-level module ``sitecustomize``, above every shardkit layer."""
    return Path(__file__).resolve().parents[1] / "startup"


def rank_env(environ: dict[str, str], config_path: str | None = None) -> dict[str, str]:
    """``environ`` plus what the ranks need for the automatic preflight (a new dict)."""
    env = dict(environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    site = str(site_dir())
    env["PYTHONPATH"] = os.pathsep.join([site, *[p for p in parts if p != site]])
    env[ENV_ENABLE] = "1"
    if config_path:
        env[ENV_CONFIG] = str(Path(config_path).resolve())
    return env


def enabled(environ: "os._Environ[str] | dict[str, str] | None" = None) -> bool:
    """True in a training rank started with the automatic preflight (not in the launcher itself)."""
    env = os.environ if environ is None else environ
    # RANK is set by torchrun / the deepspeed launcher for workers only, never for the agent.
    return env.get(ENV_ENABLE) == "1" and "RANK" in env
