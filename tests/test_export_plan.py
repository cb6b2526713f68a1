"""`shardkit export`'s planning, without ranks: the shard split is huggingface_hub's (what
save_pretrained calls), sizes parse as save_pretrained's max_shard_size, names are cleaned as the
model class expects and a config that does not fit is refused naming each tensor."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from shardkit.checkpoint.model.tensors import Piece, SourceTensor
from shardkit.checkpoint.ops.export.match import match, normalize
from shardkit.checkpoint.ops.export.model_spec import ModelSpec
from shardkit.checkpoint.ops.export.shard_plan import parse_shard_size, plan_shards
from shardkit.core.errors import CheckpointError, UsageError


@pytest.mark.parametrize("seed", range(20))
def test_split_is_huggingface_hubs(seed):
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards

    rng = random.Random(seed)
    sizes = {f"t{i}": rng.choice([1, 3, 40, 250, 1000, 5000]) * 4 for i in range(rng.randint(1, 40))}
    limit = rng.choice([1000, 4000, 20000, 10**9])
    state = {n: torch.empty(b // 4, dtype=torch.float32) for n, b in sizes.items()}
    theirs = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors", max_shard_size=limit)
    ours = plan_shards(sizes, limit)
    assert {s.filename: list(s.names) for s in ours} == theirs.filename_to_tensors


def test_shard_sizes_parse_as_save_pretrained():
    from huggingface_hub.serialization._base import parse_size_to_int

    for text in ("5GB", "500MB", "50KB", "1.5GB", "2TB", " 10mb "):
        assert parse_shard_size(text) == parse_size_to_int(text)
    assert parse_shard_size("12345") == 12345
    for bad in ("5XB", "", "GB", "-3MB", "0KB"):
        with pytest.raises(UsageError, match=r"--max-shard-size .*expected a size like 5GB, 500MB or 50KB"):
            parse_shard_size(bad)


def _t(name: str, *shape: int) -> SourceTensor:
    return SourceTensor(name, "float32", tuple(shape), [Piece(Path("/x"), 0, 0, 1)])


SPEC = ModelSpec("TinyLM", {"embed.weight": (8, 4), "block.w": (4, 4)}, ["head.weight"], {"head.weight": "embed.weight"})


def test_prefixes_removed_and_tied_alias_dropped():
    src = {"module._orig_mod.embed.weight": _t("a", 8, 4), "module.block._fsdp_wrapped_module.w": _t("b", 4, 4),
           "module.head.weight": _t("c", 8, 4)}
    tensors, aliases, notes = normalize(src, {})
    assert sorted(tensors) == ["block.w", "embed.weight", "head.weight"]
    assert any("removed DeepSpeed's 'module.' prefix" in n for n in notes)
    got = match(tensors, aliases, SPEC, "ckpt")
    assert list(got.tensors) == ["embed.weight", "block.w"] and got.dropped == ["head.weight"]


def test_tied_weight_stored_under_the_dropped_alias_is_written_under_the_kept_name():
    got = match({"head.weight": _t("h", 8, 4), "block.w": _t("b", 4, 4)}, {}, SPEC, "ckpt")
    assert got.tensors["embed.weight"].name == "h"


def test_a_config_that_does_not_fit_is_refused_naming_each_tensor():
    with pytest.raises(CheckpointError) as err:
        match({"embed.weight": _t("e", 8, 5), "extra.bias": _t("x", 3)}, {}, SPEC, "ckpt")
    text = str(err.value)
    assert "missing 1 tensor(s) TinyLM needs: block.w" in text
    assert "1 tensor(s) TinyLM has no place for: extra.bias" in text
    assert "embed.weight: [8, 5] in the checkpoint, [8, 4] in TinyLM" in text and "--model-config DIR" in text


def test_pieces_must_cover_every_element_once():
    t = SourceTensor("w", "float32", (2, 3), [Piece(Path("/x"), 0, 0, 4), Piece(Path("/y"), 0, 4, 2)])
    assert t.covered()
    t.pieces.pop()
    assert not t.covered()
