"""Old public names kept one release as aliases that warn, so a rename never breaks a caller silently.

A public name says what it does for every input it takes; when it outgrows its first format
(``reshard_zero3`` reshards ZeRO-1/2 too) it is renamed, and the old name stays one release as a
wrapper that warns on every call and then does exactly what the new name does.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")


class ShardkitDeprecationWarning(DeprecationWarning):
    """A shardkit name or option that goes in the next release; the message names its replacement.

    A subclass so a project can turn shardkit's deprecations into errors
    (``-W error::shardkit.core.deprecated.ShardkitDeprecationWarning``) without touching torch's or
    deepspeed's own.
    """


def deprecated_alias(old: str, new: str, fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` under its old public name ``old``: warns that ``new`` replaces it, then calls ``fn``.

    The wrapper keeps ``fn``'s signature and docstring (functools.wraps) so help() and IDEs still
    show what it takes; ``__name__`` is set to ``old`` so a traceback names the spelling the caller
    used.
    """

    @functools.wraps(fn)
    def alias(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        # stacklevel=2: the warning points at the caller's line, the one that has to change.
        warnings.warn(
            f"shardkit.{old} is deprecated: use shardkit.{new} (same behaviour); {old} goes in the next release",
            ShardkitDeprecationWarning,
            stacklevel=2,
        )
        return fn(*args, **kwargs)

    alias.__name__ = old
    alias.__qualname__ = old
    return alias
