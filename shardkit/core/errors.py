"""The one small exception hierarchy every user-facing shardkit failure goes through.

Each message says what failed, the value seen, why, and the fix; the CLI prints ``str(exc)`` and
never a traceback for these.
"""

from __future__ import annotations


class ShardkitError(Exception):
    """Base of every error shardkit raises on purpose."""

    #: exit code the CLI uses when this error reaches it
    exit_code: int = 1


class UsageError(ShardkitError, ValueError):
    """The command line or an argument cannot be acted on (CLI exit 2)."""

    exit_code = 2


class ConfigError(ShardkitError, ValueError):
    """A config file is missing, unreadable, malformed, or cannot be used."""


class PreflightError(ShardkitError, RuntimeError):
    """The placement preflight found tensors on the wrong device or ranks that disagree."""


class CheckpointError(ShardkitError, RuntimeError):
    """A checkpoint is missing, truncated, corrupted, unsafe, or does not fit this run."""


class DistributedError(ShardkitError, RuntimeError):
    """A spawned rank failed, hung past its timeout, or never arrived."""
