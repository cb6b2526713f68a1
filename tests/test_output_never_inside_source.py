"""No command writes its output inside the checkpoint it reads, nor around it: reshard, every convert target,
consolidate and export refuse ``-o SRC/sub`` (next to ``latest``), ``-o SRC`` and ``-o TAG`` through one check
(``storage.pipeline.refuse_output_in_checkpoint``) before anything is written, and the folder a refusal advises
works. The source is a real ZeRO-3 save of 2 gloo ranks (tests/_ranks_layouts.py), copied per test."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests import _ranks_layouts as L

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="session")
def layouts(tmp_path_factory) -> dict[str, Path]:
    return L.build_layouts(tmp_path_factory.getbasetemp() / "layouts")


@pytest.fixture
def src(layouts, tmp_path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(layouts["zero3"], root)
    return root


@pytest.fixture(scope="session")
def model_config(tmp_path_factory) -> Path:
    from shardkit.engines.model_factory import tiny_llama

    folder = tmp_path_factory.mktemp("model_config")
    tiny_llama("tiny", seed=0).config.save_pretrained(folder)
    return folder


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _commands(src: Path, out: Path, model_config: Path) -> dict[str, list[object]]:
    return {
        "reshard": ["reshard", src, "--world-size", "1", "-o", out],
        "convert --to zero2": ["convert", src, "--to", "zero2", "--world-size", "1", "-o", out],
        "convert --to fsdp2": ["convert", src, "--to", "fsdp2", "-o", out],
        "convert --to universal": ["convert", src, "--to", "universal", "-o", out],
        "consolidate": ["consolidate", src, "-o", out / "model.safetensors"],
        "export": ["export", src, "-o", out, "--model-config", model_config],
    }


def test_every_command_refuses_an_output_inside_the_source_root(src, model_config, run_cli):
    before = _listing(src)
    for command, argv in _commands(src, src / "sub", model_config).items():
        code, _, err = run_cli(*argv)
        assert code == 2, (command, err)
        assert f"is inside the checkpoint being read ({src})" in err and "Nothing was written" in err, (command, err)
        advised = Path(re.search(r"e\.g\. -o (\S+)$", err.strip()).group(1))
        assert advised.parent == src.parent and advised.name.startswith("ckpt") and advised != src, (command, err)
    assert _listing(src) == before


def test_every_command_refuses_the_source_tag_folder_and_the_root_holding_it(src, model_config, run_cli):
    before = _listing(src)
    tag = src / "global_step1"
    for out in (tag, src):
        for command, argv in _commands(src, out, model_config).items():
            if command == "consolidate":
                argv[-1] = out  # a folder: <out>/model.safetensors, inside the source either way
            code, _, err = run_cli(*argv)
            assert code == 2, (command, err)
            # is it (the tag; export reads the root given too), holds it (the root), or lies inside it
            assert re.search(rf"(is|holds|is inside) the checkpoint being read \({re.escape(str(src))}", err), (command, err)
    assert _listing(src) == before


@pytest.mark.parametrize("extra", [[], ["--tag", "ws1"]])
def test_reshard_into_its_own_root_advises_a_folder_that_works(src, run_cli, extra):
    """``reshard SRC -o SRC`` advised ``--tag NEW_TAG``, which is refused too (the root's 'latest' would move)."""
    code, _, err = run_cli("reshard", src, "--world-size", "1", "-o", src, *extra)
    assert code == 2 and "'latest' would point at the new tag" in err, err
    assert "--tag NEW_TAG" not in err
    advised = Path(re.search(r"e\.g\. -o (\S+)$", err.strip()).group(1))
    assert advised == src.parent / "ckpt_new"
    code, _, err = run_cli("reshard", src, "--world-size", "1", "-o", advised, *extra)
    assert code == 0, err
    assert (advised / "latest").is_file() and (src / "latest").read_text().strip() == "global_step1"


def test_no_command_writes_into_another_checkpoint_folder(src, layouts, model_config, tmp_path, run_cli):
    """Not the source, but a checkpoint all the same (a root holding 'latest'): consolidate refused it, and
    reshard, convert and export wrote a checkpoint inside it."""
    other = tmp_path / "other"
    shutil.copytree(layouts["zero2_bf16"], other)
    before = _listing(other)
    for command, argv in _commands(src, other / "sub", model_config).items():
        code, _, err = run_cli(*argv)
        assert code == 2, (command, err)
        assert f"{other} is a checkpoint folder; shardkit never writes into one" in err, (command, err)
    assert _listing(other) == before
