"""Damaged and mixed-up ZeRO-1/2 and FSDP2 per-rank saves, refused by every command that reads them: ZeRO-1/2
reshard (reader + writer), convert --to zero1/2/3/fsdp2/universal, export and consolidate of FSDP2 per-rank
files (use_dcp=False), and verify of plain saves without a manifest.

Every case is built from real 2-rank saves (one spawn: two ZeRO-2 saves of one run at steps 2 and 3, a ZeRO-1
save, and FSDP2 per-rank files at steps 2 and 3) and changed the way a user's folder goes wrong: rank files of
two saves mixed, a ZeRO-1 rank file in a ZeRO-2 folder, an empty rank file, a rank file that is a directory,
an unreadable one. Each command must exit 1 with a message naming the file, leave no output folder or staging
folder behind, and not move an existing OUT/latest.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TAG = "global_step2"
OPTIM = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"


def _zero(root: Path, stage: int, steps: list[int]) -> None:
    """Train ``max(steps)`` steps of a ZeRO-``stage`` engine, saving ``root/step<k>/<TAG>`` after step k (one
    tag name for every save, so their rank files can be mixed in one folder as a user's copy would)."""
    import copy

    import deepspeed
    import torch
    import torch.distributed as dist

    from shardkit.engines.model_factory import synthetic_batch
    from tests import _ranks_zero12_sources as S

    world, rank = dist.get_world_size(), dist.get_rank()
    model = S.build_model("llama")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=copy.deepcopy(S.ds_config(stage, "fp32", False, world)))
    per = S.GLOBAL_BATCH // world
    for step in range(1, max(steps) + 1):
        rows = synthetic_batch(203, S.GLOBAL_BATCH, S.SEQ_LEN, step, rank=0)[rank * per:(rank + 1) * per]
        engine.backward(engine(input_ids=rows, labels=rows).loss)
        engine.step()
        if step in steps:
            engine.save_checkpoint(str(root / f"step{step}"), tag=TAG)
            if rank == 0:
                engine.module.config.save_pretrained(root / f"step{step}")
    dist.barrier()
    del torch


def _fsdp2(root: Path, steps: list[int]) -> None:
    """FSDP2 saved per rank by accelerate (use_dcp=False) after each step in ``steps``:
    ``root/step<k>/checkpoint-2`` (one folder name, so the files of two saves can be mixed)."""
    import torch
    import torch.distributed as dist
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin, save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.fsdp import fully_shard

    from shardkit.engines.model_factory import synthetic_batch, tiny_llama

    rank = dist.get_rank()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(dist.get_world_size()),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(dist.get_world_size()))
    state = PartialState(cpu=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT",
                                            cpu_ram_efficient_loading=False)
    model = tiny_llama("tiny", seed=0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(1, max(steps) + 1):
        ids = synthetic_batch(model.config.vocab_size, 2, 8, step, rank)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if step in steps:
            folder = root / f"step{step}" / "checkpoint-2"
            save_fsdp_model(plugin, state, model, str(folder), use_dcp=False)
            save_fsdp_optimizer(plugin, state, opt, model, str(folder), use_dcp=False)
            if rank == 0:
                model.config.save_pretrained(folder)
    dist.barrier()


def save_sources(base: str) -> None:
    """Rank target (2 ranks): ``base/zero2/step{2,3}``, ``base/zero1/step2``, ``base/fsdp2/step{2,3}``."""
    import deepspeed

    deepspeed.init_distributed(dist_backend=None, auto_mpi_discovery=False)
    _zero(Path(base) / "zero2", 2, [2, 3])
    _zero(Path(base) / "zero1", 1, [2])
    _fsdp2(Path(base) / "fsdp2", [2, 3])


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shardkit.run.spawn.process import run_ranks

    base = tmp_path_factory.mktemp("damaged_saves")
    run_ranks(save_sources, 2, args=(str(base),), timeout=500, device="cpu")
    return base


def _replace(path: Path, other: Path) -> None:
    path.unlink()
    shutil.copy(other, path)


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _unreadable(path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("chmod 000 does not stop root from reading the file")
    path.chmod(0)


#: case -> (change to the copied ZeRO-2 tag folder (saves, tag folder), what the commands' messages say: the
#: readers' words|verify's structural check's words, where they differ)
ZERO2: dict[str, tuple[Any, str]] = {
    "ranks_of_two_steps": (lambda s, t: _replace(t / OPTIM.format(1), s / "zero2/step3" / TAG / OPTIM.format(1)),
                           f"{OPTIM.format(1)}: param group 0: Adam step 3, but "),
    "a_zero1_rank_file": (lambda s, t: _replace(t / OPTIM.format(1), s / "zero1/step2" / TAG / OPTIM.format(1)),
                          f"{OPTIM.format(1)} records "),  # zero_stage 1 beside rank 0's 2
    "empty_rank_file": (lambda s, t: _empty(t / OPTIM.format(1)),
                        f"{OPTIM.format(1)}: checkpoint file is empty (0 bytes)|{OPTIM.format(1)}: not a readable torch "
                        "zip file (BadZipFile: File is not a zip file; 0 bytes)"),
    "rank_file_is_a_directory": (lambda s, t: _directory(t / OPTIM.format(1)),
                                 f"{OPTIM.format(1)}: is a directory|{OPTIM.format(1)} is a directory, not the rank file"),
    "unreadable_rank_file": (lambda s, t: _unreadable(t / OPTIM.format(1)), OPTIM.format(1)),
}

#: case -> (change to the copied FSDP2 per-rank folder (saves, folder), what the commands say, as above)
FSDP2: dict[str, tuple[Any, str]] = {
    "optimizer_of_another_step": (
        lambda s, f: _replace(f / "optimizer_0_rank1.bin", s / "fsdp2/step3/checkpoint-2/optimizer_0_rank1.bin"),
        "optimizer_0_rank1.bin: state of 'model.embed_tokens.weight': step 3, but rank 0's file records 2"),
    "empty_model_file": (lambda s, f: _empty(f / "pytorch_model_fsdp_0_rank1.bin"),
                         "pytorch_model_fsdp_0_rank1.bin: checkpoint file is empty (0 bytes)|"
                         "pytorch_model_fsdp_0_rank1.bin: not a readable torch zip file"),
    "empty_optimizer_file": (lambda s, f: _empty(f / "optimizer_0_rank1.bin"),
                             "optimizer_0_rank1.bin: checkpoint file is empty (0 bytes)|"
                             "optimizer_0_rank1.bin: not a readable torch zip file"),
    "model_file_is_a_directory": (lambda s, f: _directory(f / "pytorch_model_fsdp_0_rank1.bin"),
                                  "pytorch_model_fsdp_0_rank1.bin: is a directory|"
                                  "pytorch_model_fsdp_0_rank1.bin is a directory, not the rank file"),
    "optimizer_file_is_a_directory": (lambda s, f: _directory(f / "optimizer_0_rank1.bin"),
                                      "optimizer_0_rank1.bin: is a directory|"
                                      "optimizer_0_rank1.bin is a directory, not the rank file"),
    "unreadable_model_file": (lambda s, f: _unreadable(f / "pytorch_model_fsdp_0_rank1.bin"),
                              "pytorch_model_fsdp_0_rank1.bin"),
}


def _commands(src: Path, out: Path, *, reshard: bool) -> list[list[Any]]:
    """Every command that reads the source now, each writing under ``out`` (verify writes nothing)."""
    argv: list[list[Any]] = [["reshard", src, "--world-size", 3, "-o", out / "reshard"]] if reshard else []
    targets = ["zero3"] if reshard else ["zero1", "zero2", "zero3"]  # convert of ZeRO-1/2 to ZeRO-1/2 is reshard's
    argv += [["convert", src, "--to", t, "--world-size", 3, "-o", out / t] for t in targets]
    argv += [["convert", src, "--to", t, "-o", out / t] for t in ("fsdp2", "universal")]
    argv += [["export", src, "-o", out / "hf"], ["consolidate", src, "-o", out / "model.safetensors"],
             ["verify", src, "--json"]]
    return argv


def _refused_everywhere(run_cli: Any, src: Path, out: Path, said: str, *, reshard: bool) -> None:
    out.mkdir()
    for argv in _commands(src, out, reshard=reshard):
        code, stdout, err = run_cli(*argv)
        assert code == 1, (argv[0], argv[2:4], stdout, err)
        readers, _, verify = said.partition("|")
        assert (verify or readers if argv[0] == "verify" else readers) in stdout + err, (argv[0], argv[2:4], stdout, err)
        assert "Traceback" not in err, err
        assert list(out.iterdir()) == [], (argv[0], "left", list(out.iterdir()))  # no output, no staging folder


@pytest.mark.parametrize("case", sorted(ZERO2))
def test_a_damaged_or_mixed_zero2_folder_is_refused_by_every_command(saves, tmp_path, run_cli, case):
    change, said = ZERO2[case]
    root = tmp_path / "src"
    shutil.copytree(saves / "zero2/step2", root)
    change(saves, root / TAG)
    _refused_everywhere(run_cli, root, tmp_path / "out", said, reshard=True)


@pytest.mark.parametrize("case", sorted(FSDP2))
def test_a_damaged_or_mixed_fsdp2_per_rank_folder_is_refused_by_every_command(saves, tmp_path, run_cli, case):
    change, said = FSDP2[case]
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(saves / "fsdp2/step2/checkpoint-2", folder)
    change(saves, folder)
    _refused_everywhere(run_cli, folder, tmp_path / "out", said, reshard=False)


def test_a_refused_reshard_into_an_existing_output_leaves_its_checkpoint_and_latest(saves, tmp_path, run_cli):
    good, bad = tmp_path / "good", tmp_path / "bad"
    shutil.copytree(saves / "zero2/step2", good)
    shutil.copytree(saves / "zero2/step2", bad)
    _replace(bad / TAG / OPTIM.format(1), saves / "zero2/step3" / TAG / OPTIM.format(1))
    out = tmp_path / "out"
    code, _, err = run_cli("reshard", good, "--world-size", 3, "-o", out)
    assert code == 0, err
    before = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    for argv in (["reshard", bad, "--world-size", 3, "-o", out, "--tag", "global_step3"],
                 ["reshard", bad, "--world-size", 3, "-o", out, "--force"]):
        code, _, err = run_cli(*argv)
        assert code == 1 and "Adam step 3, but" in err, err
        assert {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
        assert sorted(p.name for p in out.iterdir()) == sorted({p.parts[0] for p in before}), "a staging folder left"
    assert (out / "latest").read_text().strip() == TAG


def test_the_untouched_saves_are_taken(saves, tmp_path, run_cli):
    # the cases above fail because of the change each makes, not because these saves are refused anyway
    for src, argv in ((saves / "zero2/step2", ["reshard", "--world-size", 3, "-o", tmp_path / "r"]),
                      (saves / "zero2/step3", ["consolidate", "-o", tmp_path / "z.safetensors"]),
                      (saves / "fsdp2/step2/checkpoint-2", ["convert", "--to", "zero3", "--world-size", 3,
                                                            "-o", tmp_path / "z3"]),
                      (saves / "fsdp2/step3/checkpoint-2", ["verify"])):
        code, out, err = run_cli(argv[0], src, *argv[1:])
        assert code == 0, (src, argv, out, err)


@pytest.mark.parametrize("when", ["publish", "write"])
def test_an_interrupt_of_the_zero2_reshard_leaves_the_output_as_it_was(saves, tmp_path, monkeypatch, when):
    """Ctrl-C while the ZeRO-2 reshard writes its files, or between sealing and the rename: the staging folder is
    removed and OUT keeps its checkpoint and its latest."""
    import shardkit.checkpoint.ops.reshard as reshard
    import shardkit.storage.shared_save as shared_save

    def interrupted(*_args: object, **_kwargs: object) -> None:
        raise KeyboardInterrupt

    out = tmp_path / "out"
    reshard.reshard_checkpoint(saves / "zero2/step2", out, world_size=3)
    before = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    monkeypatch.setattr(*((shared_save, "publish_tag", interrupted) if when == "publish"
                          else (reshard, "_write_share", interrupted)))
    with pytest.raises(KeyboardInterrupt):
        reshard.reshard_checkpoint(saves / "zero2/step3", out, world_size=3, tag="global_step3")
    assert {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    assert sorted(p.name for p in out.iterdir()) == sorted({p.parts[0] for p in before}), "a staging folder left"


def _broken_layouts() -> list[str]:
    from tests.test_zero12_sources import BROKEN

    return sorted(BROKEN)


@pytest.mark.parametrize("case", _broken_layouts())
def test_a_layout_the_zero12_reader_does_not_know_is_refused_by_reshard_and_convert(saves, tmp_path, run_cli, case):
    # test_zero12_sources checks consolidate and export of these; reshard and convert read through the same opener
    from tests.test_zero12_sources import BROKEN

    change, said = BROKEN[case]
    root = tmp_path / "src"
    shutil.copytree(saves / "zero2/step2", root)
    change(root)
    out = tmp_path / "out"
    out.mkdir()
    for argv in _commands(root, out, reshard=True):
        code, stdout, err = run_cli(*argv)
        assert code == 1, (argv[0], argv[2:4], stdout, err)
        if argv[0] != "verify":  # verify's own rank comparison words some of these differently; exit 1 is the point
            assert said in err, (argv[0], argv[2:4], err)
        assert list(out.iterdir()) == [], (argv[0], "left", list(out.iterdir()))


def test_a_universal_folder_missing_a_parameter_is_refused_by_convert(saves, tmp_path, run_cli):
    # test_universal_source checks export and consolidate; the convert targets read through the same reader
    universal = tmp_path / "universal"
    code, _, err = run_cli("convert", saves / "zero2/step2", "--to", "universal", "-o", universal)
    assert code == 0, err
    [tag] = [p for p in universal.iterdir() if p.is_dir()]
    shutil.rmtree(tag / "zero" / "model.norm.weight")
    out = tmp_path / "out"
    out.mkdir()
    for argv in [["convert", universal, "--to", t, "--world-size", 3, "-o", out / t] for t in ("zero1", "zero2", "zero3")] \
            + [["convert", universal, "--to", "fsdp2", "-o", out / "fsdp2"], ["verify", universal]]:
        code, stdout, err = run_cli(*argv)
        assert code == 1, (argv[:4], stdout, err)
        assert "model.norm.weight" in stdout + err, (argv[:4], stdout, err)
        assert list(out.iterdir()) == [], (argv[:4], "left", list(out.iterdir()))
