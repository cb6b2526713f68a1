"""Byte sizes as people write them (``80GB``, ``80GiB``, ``512MiB``) and as the estimate prints them."""

from __future__ import annotations

import re

from shardkit.core.errors import UsageError
from shardkit.estimate.bounds import MAX_PARAMS, MEMORY_BYTES

# Decimal units are powers of 1000 (a "80GB" label), binary ones powers of 1024 (what nvidia-smi's
# MiB and torch.cuda.mem_get_info count): "80GB" is 74.5 GiB, so both are accepted and kept apart.
_UNITS: dict[str, int] = {
    "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")
GIB = 2**30


def parse_size(text: str, flag: str) -> int:
    """Bytes in ``text`` (``80GB`` = 80e9, ``80GiB`` = 80 * 2**30); UsageError naming ``flag`` otherwise."""
    m = _SIZE.match(text)
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _UNITS:
        why = ("a bare number is ambiguous" if m and not unit else
               f"{unit!r} could be decimal or binary" if m and unit in ("K", "M", "G", "T") else
               "it is not a number followed by a unit")
        raise UsageError(
            f"{flag} {text!r}: cannot read a memory size ({why}). Write a number and a unit: "
            "80GiB (80 x 2**30 bytes, what nvidia-smi's MiB count) or 80GB (80 x 10**9 bytes); "
            "units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if value < 1:  # 0.5B is no memory either
        raise UsageError(f"{flag} {text!r}: a memory size must be at least 1 byte, e.g. 80GiB")
    if not value <= MEMORY_BYTES.high:  # also inf, from a number of 309 digits
        raise UsageError(f"{flag} {text!r}: more than {human(MEMORY_BYTES.high)} ({MEMORY_BYTES.why}); "
                         "write the usable memory of one GPU or one host, e.g. 80GiB")
    return int(value)


def parse_count(text: str, flag: str) -> int:
    """A parameter count: ``6.8e9``, ``6805M``, ``7B`` or ``7G``, ``125000000`` (B = billion here, not bytes)."""
    m = re.match(r"^\s*([0-9]+(?:\.[0-9]+)?(?:[eE][0-9]+)?)\s*([kKmMbBgGtT]?)\s*$", text)
    if not m:
        raise UsageError(
            f"{flag} {text!r}: not a parameter count. Write e.g. 6.8e9, 6805M, 7B or 125000000"
        )
    scale = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}[m.group(2).upper()]
    value = float(m.group(1)) * scale
    if value < 1:
        raise UsageError(f"{flag} {text!r}: a model has at least one parameter")
    if not value <= MAX_PARAMS.high:  # also inf (1e400): int() of it was an OverflowError traceback
        raise UsageError(f"{flag} {text!r}: more than {MAX_PARAMS.high:.0e} parameters ({MAX_PARAMS.why}); "
                         "write the model's count, e.g. 6.8e9 or 70B")
    return int(value)


def gib(n: int | float) -> str:
    """``n`` bytes as GiB with two decimals (``0.00`` for a few bytes, which is the truth)."""
    return f"{n / GIB:.2f}"


def human(n: int | float) -> str:
    """``n`` bytes in the largest binary unit that keeps it above 1 (``1.50 GiB``, ``12.0 KiB``)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
