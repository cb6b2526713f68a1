"""A convert target keeps one Adam step where torch keeps one per parameter (a ZeRO-3 sub-group, a ZeRO-1/2
or universal param group): parameters that must share it but hold different step counts, or none, are
refused naming the parameters and the rule, never averaged."""

from __future__ import annotations

import pytest

from shardkit.checkpoint.ops.convert.to_zero3_plan import single_adam_step
from shardkit.core.errors import CheckpointError


def test_the_one_step_check_names_the_parameters_that_disagree_and_the_rule() -> None:
    with pytest.raises(CheckpointError) as e:
        single_adam_step(["a.weight", "b.weight"], {"a.weight": 3.0, "b.weight": 5.0}, "ckpt: param group 0",
                         "its parameters", "ZeRO-1/2 keeps one step per param group")
    assert "ckpt: param group 0: its parameters have different Adam step counts (a.weight: 3, b.weight: 5)" in str(e.value)
    assert "ZeRO-1/2 keeps one step per param group" in str(e.value)
    with pytest.raises(CheckpointError, match=r"no Adam step recorded for \['b.weight'\]"):
        single_adam_step(["a.weight", "b.weight"], {"a.weight": 3.0}, "ckpt", "x", "y")
    assert single_adam_step(["a.weight", "b.weight"], {"a.weight": 4.0, "b.weight": 4.0}, "ckpt", "x", "y") == 4
