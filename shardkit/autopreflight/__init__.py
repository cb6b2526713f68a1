"""Automatic placement preflight for ranks started by `shardkit launch`, with no change to the script.

How it gets into the ranks: the launcher puts :func:`site_dir` (a directory holding only a
``sitecustomize.py``) first on the ranks' ``PYTHONPATH`` and sets ``SHARDKIT_AUTOPREFLIGHT=1``, also
packed into ``PYTHON_SHARDKIT_LAUNCH`` so that DeepSpeed's multi-node runner carries it to the other
nodes (:mod:`shardkit.autopreflight.launch_link`, which also sends each rank's report to the launch).
Python imports ``sitecustomize`` at start-up; ours installs import watchers (nothing is imported
eagerly) and then runs the ``sitecustomize`` it shadows, if any, so an existing one keeps working.

When ``torch`` is imported, global hooks wait for the first training forward (grad enabled,
module in train mode) and run :func:`shardkit.preflight` once on that root module (or the
DeepSpeed engine) with the optimizer built for it; if no forward is seen, the first optimizer
step runs it. A failing preflight prints the table (rank 0) and ends every rank with
:data:`EXIT_CODE`, so the launcher stops the job before a step is taken.

Its modules: ``rank_env`` (what the launch and its ranks agree on: variables, the exit status,
where the ``sitecustomize`` lives), ``launch_link`` (the launch's settings on every node, each
rank's report sent back), ``hooks`` (the import watchers and the torch and DeepSpeed hooks) and
``run`` (the one preflight of a rank, and stopping the rank when it fails).
"""

from __future__ import annotations

from shardkit.autopreflight.rank_env import (
    DEFAULT_TIMEOUT_S,
    ENV_CONFIG,
    ENV_ENABLE,
    ENV_JSON,
    ENV_TIMEOUT,
    EXIT_CODE,
    enabled,
    rank_env,
    site_dir,
)

__all__ = [
    "DEFAULT_TIMEOUT_S", "ENV_CONFIG", "ENV_ENABLE", "ENV_JSON", "ENV_TIMEOUT", "EXIT_CODE",
    "enabled", "rank_env", "site_dir",
]
