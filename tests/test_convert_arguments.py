"""The argument checks the convert targets share (ops/convert/arguments.py): each target refuses a bad
world size or worker count in the same words, naming the value, before anything is read or written."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import pytest

from shardkit.checkpoint.ops.convert.to_dcp import convert_to_dcp
from shardkit.checkpoint.ops.convert.to_zero3 import convert_to_zero3
from shardkit.checkpoint.ops.convert.to_zero12 import convert_to_zero12
from shardkit.checkpoint.ops.reshard import reshard_checkpoint
from shardkit.core.errors import UsageError


def _zero12(src: Path, out: Path, **kw: Any) -> Any:
    return convert_to_zero12(src, out, stage=2, **kw)


def _reshard(src: Path, out: Path, world_size: Any, **kw: Any) -> Any:
    return reshard_checkpoint(src, out, world_size, **kw)


#: reshard (ZeRO-1/2/3 alike) says the same as the convert targets
DEEPSPEED_TARGETS: dict[str, Callable[..., Any]] = {"zero2": _zero12, "zero3": convert_to_zero3, "reshard": _reshard}


@pytest.mark.parametrize("target", sorted(DEEPSPEED_TARGETS))
@pytest.mark.parametrize("world_size", [0, -1, 2**20 + 1, True, 2.0, "4"])
def test_a_world_size_outside_1_to_2_20_is_refused_naming_it(tmp_path, target, world_size):
    with pytest.raises(UsageError, match=rf"^--world-size {re.escape(repr(world_size))}: must be a whole number from 1 to "
                                         r"1048576 \(the data-parallel ranks of the resuming DeepSpeed run\)$"):
        DEEPSPEED_TARGETS[target](tmp_path / "missing", tmp_path / "out", world_size=world_size)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("target, what", [("zero2", "files"), ("zero3", "rank files"), ("fsdp2", "files"), ("reshard", "rank files")])
def test_a_worker_count_below_one_is_refused_naming_it(tmp_path, target, what):
    call = convert_to_dcp if target == "fsdp2" else DEEPSPEED_TARGETS[target]
    kw: dict[str, Any] = {} if target == "fsdp2" else {"world_size": 2}
    with pytest.raises(UsageError, match=rf"^workers=0: must be at least 1 \({what} written at once\)$"):
        call(tmp_path / "missing", tmp_path / "out", workers=0, **kw)
    assert not (tmp_path / "out").exists()
