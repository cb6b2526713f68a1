"""`shardkit launch`: check the config a training script will use, then start the real launcher.

One module per step, each importable from here as before:

- :mod:`shardkit.run.launch_plan`: ``build_launch`` turns the command line into a :class:`LaunchPlan`
  (the argv of the real ``deepspeed``, ``torchrun`` or ``accelerate launch`` launcher, with every
  argument passed through untouched, and the environment the ranks get). Tests assert on the plan
  without spawning anything.
- :mod:`shardkit.run.launch_check`: ``check_launch_config`` runs the static checks and the version
  table on the config the script will read (for accelerate: the Accelerate config with its
  command-line overrides, see :mod:`shardkit.run.accelerate_config`).
- :mod:`shardkit.run.launch_ranks`: which ranks the launch starts and where, and whether the
  launch's settings can reach them.
- :mod:`shardkit.run.launch_run`: ``run_launch`` starts the argv (a list, never a shell string),
  passes signals on, reaps what the launcher leaves, and returns its exit status.
- :mod:`shardkit.run.launch_reports`: the ranks' preflight reports and the launch's closing line.
"""

from __future__ import annotations

from shardkit.run.launch_check import check_launch_config
from shardkit.run.launch_plan import (
    CONFIG_FLAGS,
    CONFIG_SUFFIXES,
    LAUNCHERS,
    PATH_ONLY_FLAGS,
    Launcher,
    LaunchPlan,
    build_launch,
    find_config,
    infer_world_size,
    launcher_command,
    missing_script,
    names_hf_trainer_config,
    split_script,
)
from shardkit.run.launch_ranks import ExpectedRanks, expected_ranks
from shardkit.run.launch_reports import outcome_line, preflight_summary
from shardkit.run.launch_run import run_launch

__all__ = [
    "CONFIG_FLAGS", "CONFIG_SUFFIXES", "LAUNCHERS", "PATH_ONLY_FLAGS", "ExpectedRanks", "LaunchPlan", "Launcher",
    "build_launch", "check_launch_config", "expected_ranks", "find_config", "infer_world_size", "launcher_command",
    "missing_script", "names_hf_trainer_config", "outcome_line", "preflight_summary", "run_launch", "split_script",
]
