"""A real peft LoRA model (most parameters frozen) through ZeRO-3 and FSDP2 on 2 gloo ranks: trained,
saved and resumed with a bit-identical loss curve; the preflight passes the healthy run and names a
frozen base weight or a LoRA weight left on the wrong device, with its rank.

One spawn per engine (module-scoped): it trains, saves, runs the preflight cases and resumes.
"""

from __future__ import annotations

import re

import pytest

from shardkit.run.spawn.process import run_ranks
from tests import _ranks_peft as targets

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

ENGINES = ["zero3", "fsdp2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for engine, fn in (("zero3", targets.zero3_lora), ("fsdp2", targets.fsdp2_lora)):
        root = tmp_path_factory.mktemp(f"lora_{engine}")
        out[engine] = [r.value for r in run_ranks(fn, 2, args=(str(root),), timeout=420, backend="gloo")]
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_most_parameters_are_frozen_and_the_healthy_run_passes_preflight(runs, engine):
    r0, r1 = runs[engine]
    counts = r0["counts"]
    assert 0 < counts["trainable"] < 0.02 * counts["total"]  # LoRA: under 2% of the weights train
    assert r0["clean"]["ok"] and r1["clean"]["ok"]
    assert re.search(rf"placement preflight \({'deepspeed-zero3' if engine == 'zero3' else 'fsdp2'}, 2 rank\(s\), "
                     r"\d+ tensors\): ok", r0["clean"]["text"])


def test_zero3_optimizer_holds_only_the_adapters(runs):
    r0, _ = runs["zero3"]
    # each rank's fp32 partition covers half of the LoRA weights and none of the frozen base
    assert r0["trainable_in_optimizer"] == r0["counts"]["trainable"] // 2


def test_fsdp2_optimizer_state_only_for_the_adapters(runs):
    # q_proj and v_proj in 2 layers, lora_A and lora_B each: 8 trainable tensors
    assert runs["fsdp2"][0]["state_entries"] == 8


@pytest.mark.parametrize("engine", ENGINES)
def test_resumed_lora_run_continues_bit_exactly(runs, engine):
    r0, r1 = runs[engine]
    continued = r0["reference"][targets.SAVE_AT:]
    if engine == "zero3":
        assert r0["shardkit"]["losses"] == continued and r1["shardkit"]["losses"] == continued
        assert r0["shardkit"]["placement_checked"] and r0["shardkit"]["notes"] == []
        assert r0["plain"]["losses"] == continued  # DeepSpeed's own load_checkpoint of the shardkit save
    else:
        assert r0["resumed"]["losses"] == continued and r1["resumed"]["losses"] == continued
        assert r0["resumed"]["step"] == targets.SAVE_AT and r0["resumed"]["findings"] == []
    assert continued != r0["reference"][: targets.CONTINUE]  # the adapters did train


def test_zero3_replace_optimizer_state_on_the_engine_optimizer_after_a_load(runs):
    # shardkit.replace_optimizer_state(engine.optimizer): nothing to move after the load on CPU ranks;
    # on a GPU run (partitions said to be on cuda:0, planned without allocating) the Adam moments
    # would follow their partitions
    plans = runs["zero3"][0]["shardkit"]["replace"]
    assert plans["here"] == [] and plans["optimizer"] == "FusedAdam"
    assert [tuple(t) for t in plans["to_gpu"]] == [("exp_avg", "cuda:0"), ("exp_avg_sq", "cuda:0")]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case, name, rank, nbytes", [
    ("frozen_misplaced", targets.FROZEN, 1, "8,192"),
    ("lora_misplaced", targets.LORA_WEIGHT, 0, "512"),
], ids=["frozen-base-weight", "lora-weight"])
def test_misplaced_weight_is_named_with_its_rank_on_every_rank(runs, engine, case, name, rank, nbytes):
    r0, r1 = runs[engine]
    assert r0[case]["ok"] is False and r1[case]["ok"] is False
    assert r0[case]["text"] == r1[case]["text"]
    text = r0[case]["text"]
    shown = f"module.{name}.ds_tensor" if engine == "zero3" else name
    assert re.search(rf"{re.escape(shown)}\s+meta\s+cpu\s+{rank}\s+{nbytes}\s", text)
    assert "1 problem(s)" in text  # only that tensor: the other frozen weights are where they belong
