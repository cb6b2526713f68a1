"""--dry-run refuses what the real run refuses, with the same exit code and message, and writes
nothing: it is the real run stopped before its first write (shardkit.storage.dry_run). Before, the
dry runs of export (no config.json, a --model-config folder that does not exist) and consolidate
(an existing output without --force) printed a plan and exited 0 where the run exits 2."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests import _ranks_zero3 as R

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def source(tmp_path_factory):
    return R.build_sources(tmp_path_factory.getbasetemp() / "zero3")["fp32"]


def _tree(*roots: Path) -> dict[str, tuple[int, int]]:
    seen = {}
    for root in roots:
        for dirpath, dirs, files in os.walk(root):
            for name in dirs + files:
                st = os.lstat(os.path.join(dirpath, name))
                seen[os.path.join(dirpath, name)] = (st.st_size, st.st_mtime_ns)
    return seen


def _damaged(source: Path, tmp_path: Path) -> Path:
    """The source with rank 1's optimizer file cut to half its size (no manifest: the parse meets it)."""
    copy = tmp_path / "damaged"
    shutil.copytree(source, copy)
    victim = next((copy / "global_step2").glob("*rank_1_*optim_states.pt"))
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    return copy


CASES = {
    # export of a ZeRO-3 save that has no config.json beside it, and no --model-config
    "export without config.json": lambda src, tmp: ["export", src, "-o", tmp / "hf"],
    "export with a --model-config that does not exist": lambda src, tmp: [
        "export", src, "-o", tmp / "hf", "--model-config", tmp / "no-such-folder"],
    "consolidate over an existing file without --force": lambda src, tmp: [
        "consolidate", src, "-o", _existing(tmp / "model.safetensors")],
    "consolidate of a damaged rank file": lambda src, tmp: [
        "consolidate", _damaged(src, tmp), "-o", tmp / "model.safetensors"],
    # a ZeRO-3 reshard parses the rank files as it writes the new ones: damage there is met by the
    # staged write (nothing published), not before it, so the output folder's refusal stands in here
    "reshard into a folder holding a checkpoint shardkit did not write": lambda src, tmp: [
        "reshard", src, "--world-size", "3", "-o", _copy(src, tmp / "theirs")],
    # the Trainer's resume globs global_step*: another tag is refused before anything is written
    "reshard of a Trainer checkpoint-N to a tag the Trainer does not resume": lambda src, tmp: [
        "reshard", _trainer_folder(src, tmp), "--world-size", "3", "-o", tmp / "checkpoint-2-ws3", "--tag", "mine"],
    "convert --to fsdp2 of a damaged rank file": lambda src, tmp: [
        "convert", _damaged(src, tmp), "--to", "fsdp2", "-o", tmp / "dcp"],
    "convert --to universal of a damaged rank file": lambda src, tmp: [
        "convert", _damaged(src, tmp), "--to", "universal", "-o", tmp / "universal"],
}


def _trainer_folder(source: Path, tmp_path: Path) -> Path:
    """The ZeRO-3 save as the Trainer lays it out: checkpoint-2/ with trainer_state.json beside global_step2/."""
    folder = _copy(source, tmp_path / "out" / "checkpoint-2")
    (folder / "trainer_state.json").write_text('{"global_step": 2}')
    return folder


def _copy(source: Path, to: Path) -> Path:
    shutil.copytree(source, to)
    return to


def _existing(path: Path) -> Path:
    path.write_bytes(b"someone's weights")
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_the_dry_run_refuses_what_the_run_refuses(run_cli, source, tmp_path, case):
    argv = CASES[case](source, tmp_path)
    before = _tree(tmp_path, source)
    code, out, err = run_cli(*argv, "--dry-run")
    assert code != 0 and "nothing was written (--dry-run)" not in out + err, (code, out, err)
    assert _tree(tmp_path, source) == before  # not a file, folder, staging folder or timestamp changed
    real_code, real_out, real_err = run_cli(*argv)
    assert (code, err) == (real_code, real_err)  # the same refusal, word for word
    assert _tree(tmp_path, source) == before  # the run refused before writing too


def test_a_dry_run_that_passes_the_run_s_checks_prints_the_plan(run_cli, source, tmp_path):
    code, out, err = run_cli("consolidate", source, "-o", _existing(tmp_path / "model.safetensors"), "--force",
                             "--dry-run")
    assert code == 0 and "nothing was written (--dry-run)" in out, err
    assert (tmp_path / "model.safetensors").read_bytes() == b"someone's weights"
