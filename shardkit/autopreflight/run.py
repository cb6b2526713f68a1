"""The one automatic preflight of a rank: who runs it (:func:`claim`), running it with the launch's
settings, and stopping the rank when it fails (:func:`run_or_exit`, :func:`stop_rank`).

Shared by the torch/DeepSpeed hooks (shardkit.autopreflight.hooks) and the HF Trainer's
PreflightCallback (shardkit.integrations.hf), so a rank runs the preflight once and fails the same
way whichever of them got there first.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any, Callable, NoReturn

from shardkit.autopreflight.launch_link import send_report
from shardkit.autopreflight.rank_env import DEFAULT_TIMEOUT_S, ENV_JSON, ENV_TIMEOUT, EXIT_CODE
from shardkit.core.env_settings import read_seconds, read_text

LAUNCH_SKIP_HINT = "relaunch with `shardkit launch --no-preflight` to skip the check"
"""How a failure message tells a `shardkit launch` user to skip the check."""


class HookState:
    """This process's automatic-preflight state (one per rank; the hooks and the callback share it)."""

    done = False
    """The preflight was claimed (run, or being run) in this process."""
    handles: list[Any] = []
    optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()
    engines: "weakref.WeakSet[Any]" = weakref.WeakSet()
    original_optimizer_init: Callable[..., Any] | None = None


def claim() -> bool:
    """Mark the one automatic preflight of this process as taken and remove the torch hooks.

    False when it was already taken: the HF Trainer's PreflightCallback and the torch hooks then
    never both run it (the callback claims it at ``on_train_begin``, before the first forward)."""
    if HookState.done:
        return False
    HookState.done = True
    _remove_hooks()
    return True


def run_or_exit(
    kwargs: dict[str, Any],
    what: str,
    when: str = "before the first optimizer step",
    skip_hint: str = LAUNCH_SKIP_HINT,
    timeout: float | None = None,
    json_path: str | None = None,
) -> Any:
    """``shardkit.preflight(**kwargs)`` with the launch's timeout and JSON path; rank 0 prints one
    summary line when it passes. On failure every rank prints why and exits with EXIT_CODE (rank 0
    has printed the table), reporting it to `shardkit launch`, which names the failed ranks."""
    from shardkit.core.errors import PreflightError

    rank = os.environ.get("RANK", "?")
    what_failed = f"placement preflight failed {when}"
    try:
        from shardkit.placement.preflight import preflight

        report = preflight(**kwargs, timeout=preflight_timeout(timeout), json_path=json_path or read_text(ENV_JSON),
                           on_verdict=(stops_first := rank0_stops_first(rank, what_failed, skip_hint)))
    except PreflightError as exc:
        if stops_first.said:
            os._exit(EXIT_CODE)  # its stop lines and report went out before the verdict was published
        # another rank, or a failure before any verdict (a rank that never arrived)
        where = "the table above" if rank in ("0", "?") else "rank 0's output"
        stop_rank(rank, what_failed, _first_line(str(exc)), where, skip_hint)
    except ImportError as exc:
        print(f"shardkit autopreflight: rank {rank}: preflight unavailable ({exc}); continuing", file=sys.stderr)
        send_report("skipped", f"preflight unavailable ({exc})")
        return None
    send_report("passed", f"{report.tensor_count} tensors ({what})")
    if rank in ("0", "?"):
        print(
            f"shardkit autopreflight: placement preflight passed on {report.rank_count} rank(s), "
            f"{report.tensor_count} tensors ({what}) {when}",
            file=sys.stderr,
            flush=True,
        )
    return report


class rank0_stops_first:  # noqa: N801 - used as preflight's on_verdict callback, named for what it does
    """``preflight``'s ``on_verdict`` for rank 0: on a failed verdict it writes its stop lines and tells
    `shardkit launch` before the other ranks can read the verdict. They then exit at once and torchrun's
    agent SIGTERMs rank 0, whose lines and report, written after preflight raised, were lost under load
    (CI: the launch named rank(s) [1] of 2; the 2-rank Trainer test saw rank 1's stop line alone).
    ``said`` tells the caller they are out (a failure before any verdict still goes through stop_rank)."""

    def __init__(self, rank: str, what_failed: str, skip_hint: str) -> None:
        self.rank, self.what_failed, self.skip_hint = rank, what_failed, skip_hint
        self.said = False

    def __call__(self, ok: bool, text: str) -> None:
        if not ok:
            _write_stop_lines(self.rank, self.what_failed, _first_line(text), "the table above", self.skip_hint)
            send_report("failed", _first_line(text))
            self.said = True


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "placement preflight failed"


def preflight_timeout(given: float | None = None) -> float:
    """``given``, else SHARDKIT_AUTOPREFLIGHT_TIMEOUT, else the default (ranks arrive at different times).
    A bad value is warned about once and the default used: the rank is mid-run, past its start."""
    return given if given is not None else read_seconds(ENV_TIMEOUT, DEFAULT_TIMEOUT_S, during_run=True)


def _write_whole(text: str) -> None:
    """``text`` to stderr in one write: every rank stops at once on the same pipe, and print()'s
    separate writes of the text and its newline let another rank's line land in between (seen in
    the 2-rank Trainer tests: two stop lines run together on one line)."""
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), text.encode())
    except (AttributeError, OSError, ValueError):  # no real file descriptor (captured stderr)
        sys.stderr.write(text)
        sys.stderr.flush()


def _write_stop_lines(rank: str, what_failed: str, first_line: str, where: str, skip_hint: str) -> None:
    _write_whole(
        f"shardkit autopreflight: rank {rank}: {what_failed}: {first_line}\n"
        f"shardkit autopreflight: rank {rank}: stopping (exit {EXIT_CODE}); see {where}. "
        f"Fix it, or {skip_hint}.\n"
    )
    sys.stdout.flush()


def stop_rank(rank: str, what_failed: str, first_line: str, where: str, skip_hint: str = LAUNCH_SKIP_HINT) -> NoReturn:
    """End this rank with EXIT_CODE after one line saying what failed and why (the same on every
    rank); ``first_line`` (the cause) goes to `shardkit launch`, which summarizes the failed ranks."""
    _write_stop_lines(rank, what_failed, first_line, where, skip_hint)
    # the launch names the failed ranks (with this line) after the launcher's own output
    send_report("failed", first_line)
    # os._exit: atexit handlers can block in a collective the other ranks never join.
    os._exit(EXIT_CODE)


def _remove_hooks() -> None:
    for handle in HookState.handles:
        handle.remove()
    HookState.handles.clear()
    if HookState.original_optimizer_init is not None:
        from torch.optim.optimizer import Optimizer

        Optimizer.__init__ = HookState.original_optimizer_init  # type: ignore[method-assign]
        HookState.original_optimizer_init = None
