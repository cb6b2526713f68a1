"""The in-process ZeRO-1/2 resume parses only the source rank files its partition needs (``resume_zero12``).

A real 2-rank ZeRO-2 save (bf16, the tiny Llama; ``bench_reshard_zero2.small_save``) laid out for 8 source ranks
(``bench_reshard_zero2.scale_zero2``: the same model, 8 rank files) is resumed by 2 spawned ranks. Each rank
records the files the torch-free reader parses: the model-states file, rank 0's optimizer file (the layout)
and the 4 files its half of the flat buffer covers, never the other half's; its fp32 masters and Adam moments
equal the full description's (every file parsed) for its partition. A damaged file only rank 1 needs stops both
ranks (rank 0 says which rank and file), with neither engine changed; a missing file is named on every rank.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SOURCE_RANKS, NEW_WORLD = 8, 2


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from benchmarks.bench_reshard_zero2 import TAG, scale_zero2, small_save

    base = tmp_path_factory.mktemp("resume_sources")
    return scale_zero2(small_save(base / "small"), base / f"ws{SOURCE_RANKS}", 1, SOURCE_RANKS).parent / TAG


def resume_counting(tag: str, verify: bool) -> dict[str, Any]:
    """Rank target: ``load_checkpoint_resharded`` on a fresh ZeRO-2 engine, with the files the reader parsed."""
    import torch.distributed as dist

    import shardkit.checkpoint.readers.zero12 as zero12_reader
    from benchmarks.bench_reshard_zero2 import _config
    from shardkit import load_checkpoint_resharded
    from shardkit.engines.deepspeed import initialize
    from shardkit.engines.model_factory import tiny_llama

    parsed: list[str] = []
    real = zero12_reader.read_structure

    def counting(path: Any, *args: Any, **kwargs: Any) -> Any:
        parsed.append(Path(path).name)
        return real(path, *args, **kwargs)

    zero12_reader.read_structure = counting
    engine = initialize(tiny_llama("tiny", seed=0), _config(dist.get_world_size()))
    out: dict[str, Any] = {"parsed": parsed, "error": None}
    try:
        load_checkpoint_resharded(engine, tag, verify=verify, preflight=False)
    except Exception as exc:  # noqa: BLE001 - the message is what is asserted
        out["error"] = f"{type(exc).__name__}: {exc}"
    opt = engine.optimizer
    out["global_steps"] = engine.global_steps
    out["fp32"] = [t.detach().clone() for t in opt.single_partition_of_fp32_groups]
    out["exp_avg"] = [opt.optimizer.state[t]["exp_avg"].clone() if t in opt.optimizer.state else None
                      for t in opt.single_partition_of_fp32_groups]
    out["partition_size"] = [int(s) for s in opt.partition_size]
    return out


def _resume(tag: Path, verify: bool = True) -> list[dict[str, Any]]:
    from shardkit.run.spawn.process import run_ranks

    return [r.value for r in run_ranks(resume_counting, NEW_WORLD, args=(str(tag), verify), timeout=420,
                                       device="cpu")]


def _optim(rank: int) -> str:
    return f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _flat(ckpt: Any, key: str, group: int, start: int, size: int) -> torch.Tensor:
    """Elements [start, start + size) of the source's flat ``key`` of ``group``, from the full description."""
    from shardkit.checkpoint.readers.zero12 import zero12_layout
    from shardkit.checkpoint.writers.zero3 import read_slice

    layout = zero12_layout(ckpt)
    out = torch.zeros(size, dtype=torch.float32)
    for name, (g, at) in layout.offsets.items():
        t = ckpt.weights[name] if key == "fp32" else ckpt.optimizer[name][key]
        lo, hi = max(start, at), min(start + size, at + t.numel)
        if g == group and lo < hi:
            out[lo - start:hi - start] = read_slice(t, lo - at, hi - at).float()
    return out


def test_each_rank_parses_only_the_files_its_partition_needs(source):
    from shardkit.checkpoint.readers.zero12 import read_zero12

    got = _resume(source)
    assert [r["error"] for r in got] == [None, None]
    half = SOURCE_RANKS // NEW_WORLD
    for rank, result in enumerate(got):
        optim = {name for name in result["parsed"] if name.endswith("optim_states.pt")}
        mine = {_optim(r) for r in range(rank * half, (rank + 1) * half)}
        assert optim == mine | {_optim(0)}, (rank, sorted(optim))
        assert "mp_rank_00_model_states.pt" in result["parsed"]
        assert result["global_steps"] == 1
    # what was loaded is the source's partition, as the reader of every file describes it
    full = read_zero12(source)
    for rank, result in enumerate(got):
        for g, size in enumerate(result["partition_size"]):
            for key in ("fp32", "exp_avg"):
                want = _flat(full, key, g, rank * size, size)
                have = result[key][g].float()
                assert torch.equal(have, want[:have.numel()]), (rank, g, key)


def test_a_damaged_file_one_rank_needs_stops_every_rank(source, tmp_path):
    copy = tmp_path / "damaged" / source.name
    shutil.copytree(source, copy)
    victim = copy / _optim(SOURCE_RANKS - 2)  # in new rank 1's half only
    victim.write_bytes(victim.read_bytes()[:200])
    got = _resume(copy, verify=False)  # the manifest would refuse it on every rank before any read
    own, other = got[1]["error"], got[0]["error"]
    assert own is not None and victim.name in own, own
    assert other is not None and other.startswith("CheckpointError: ") and "rank 1 of 2" in other, other
    assert victim.name in other and "Nothing was loaded on any rank" in other
    assert victim.name not in got[0]["parsed"]
    assert [r["global_steps"] for r in got] == [0, 0]


def test_a_missing_rank_file_is_named_on_every_rank(source, tmp_path):
    copy = tmp_path / "missing" / source.name
    shutil.copytree(source, copy)
    (copy / _optim(5)).unlink()
    got = _resume(copy, verify=False)
    for result in got:
        assert result["error"] is not None and "rank(s) [5] missing" in result["error"], result["error"]
        assert result["global_steps"] == 0


def resume_listing(tag: str) -> dict[str, Any]:
    """Rank target: ``load_checkpoint_resharded`` (no manifest check: the reader's own listings) with every listing of
    the tag folder counted (``tests._listings``)."""
    import torch.distributed as dist

    from benchmarks.bench_reshard_zero2 import _config
    from shardkit import load_checkpoint_resharded
    from shardkit.engines.deepspeed import initialize
    from shardkit.engines.model_factory import tiny_llama
    from tests._listings import listings_of

    engine = initialize(tiny_llama("tiny", seed=0), _config(dist.get_world_size()))
    with listings_of(tag) as listed:
        load_checkpoint_resharded(engine, tag, verify=False, preflight=False)
    return {"listed": listed, "global_steps": engine.global_steps}


def test_a_resuming_rank_lists_the_tag_folder_once(source):
    """At 1,024 ranks on a shared filesystem each listing of a folder of 2,048 files is a metadata storm: a rank
    lists the tag folder once and hands the names on (finding the tag, the stage, the links, the rank files);
    it listed it 5 times (resolve_tag_dir, is_zero12_folder, links_leaving, each of the reader's two reads)."""
    from shardkit.run.spawn.process import run_ranks

    got = [r.value for r in run_ranks(resume_listing, NEW_WORLD, args=(str(source),), timeout=420, device="cpu")]
    for rank, result in enumerate(got):
        assert result["global_steps"] == 1
        assert len(result["listed"]) == 1, (rank, result["listed"])
