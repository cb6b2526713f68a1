"""`shardkit consolidate`: the same bytes zero_to_fp32 + safetensors would write, streaming, atomic."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from tests import _ranks_zero3 as R

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    return R.build_sources(tmp_path_factory.getbasetemp() / "zero3")


def _zero_to_fp32_file(ckpt: Path, out: Path, dtype=None) -> Path:
    """What DeepSpeed's zero_to_fp32 produces for ``ckpt``, saved the way its --safe_serialization does."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    save_file(sd, out, metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("label", ["fp32", "bf16_offload", "fp16"])
def test_bytes_equal_to_zero_to_fp32(sources, tmp_path, run_cli, label):
    out = tmp_path / "model.safetensors"
    code, stdout, err = run_cli("consolidate", sources[label], "-o", out)
    assert code == 0, err
    assert f"wrote {out}: 21 tensors" in stdout and "saved by 2 rank(s)" in stdout
    expected = _zero_to_fp32_file(Path(sources[label]), tmp_path / "expected.safetensors")
    assert out.read_bytes() == expected.read_bytes()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_fp32_consolidation_never_imports_torch_or_deepspeed(sources, tmp_path, python_exe):
    import subprocess

    out = tmp_path / "m.safetensors"
    code = (
        "import sys; from shardkit.cli import main\n"
        f"assert main(['consolidate', {str(sources['bf16_offload'])!r}, '-o', {str(out)!r}]) == 0\n"
        "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules, 'heavy import'\n"
    )
    proc = subprocess.run([python_exe, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    expected = _zero_to_fp32_file(Path(sources["bf16_offload"]), tmp_path / "expected.safetensors")
    assert out.read_bytes() == expected.read_bytes()


def test_bf16_output_and_folder_output(sources, tmp_path, run_cli):
    code, stdout, err = run_cli("consolidate", sources["fp32"], "-o", tmp_path, "--dtype", "bf16")
    assert code == 0, err
    expected = _zero_to_fp32_file(Path(sources["fp32"]), tmp_path / "expected.safetensors", torch.bfloat16)
    assert (tmp_path / "model.safetensors").read_bytes() == expected.read_bytes()


def test_output_loads_into_the_model(sources, tmp_path):
    from safetensors.torch import load_file

    from shardkit.checkpoint.ops.consolidate import consolidate_checkpoint
    from shardkit.engines.model_factory import tiny_llama

    result = consolidate_checkpoint(sources["fp32"], tmp_path / "m.safetensors")
    model = tiny_llama(R.MODEL_SIZE)
    model.load_state_dict(load_file(result.output), strict=True)
    assert result.parameters == sum(p.numel() for p in model.parameters())


def test_broken_rank_file_leaves_no_output(sources, tmp_path, run_cli):
    root = tmp_path / "ckpt"
    shutil.copytree(sources["fp32"], root)
    victim = root / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:4096])
    out = tmp_path / "out" / "model.safetensors"
    code, _, err = run_cli("consolidate", root, "-o", out)
    assert code == 1
    assert f"{victim}: cannot be read as a torch checkpoint" in err and "Traceback" not in err
    # refused before the output folder is made (the reader checks every rank file first)
    assert not out.exists() and not (out.parent.exists() and list(out.parent.iterdir()))


def test_usage_errors(tmp_path, run_cli):
    code, _, err = run_cli("consolidate", tmp_path / "missing", "-o", tmp_path / "x.safetensors")
    assert code == 1 and "missing: checkpoint path does not exist" in err
    code, _, err = run_cli("consolidate", tmp_path, "-o", tmp_path / "x.safetensors", "--dtype", "int8")
    assert code == 2 and "invalid choice" in err


def test_unwritable_output_is_a_checkpoint_error_naming_the_path(sources, tmp_path, run_cli):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where a folder should be")
    code, _, err = run_cli("consolidate", sources["fp32"], "-o", blocker / "model.safetensors")
    assert code == 1 and "Traceback" not in err
    assert re.search(rf"{re.escape(str(blocker))}: consolidating the checkpoint failed \((FileExistsError|"
                     r"NotADirectoryError)", err), err


def test_an_fsdp2_dcp_save_consolidates_to_the_weights_it_held(sweep_sources, tmp_path, run_cli):
    """A real FSDP2 save (2 gloo ranks, DCP) through the checkpoint model: every tensor equal to the
    state dict the run exported at save time; a .distcp file missing is refused, nothing written."""
    from safetensors.torch import load_file

    src = sweep_sources.root("fsdp2")
    out = tmp_path / "model.safetensors"
    code, stdout, err = run_cli("consolidate", src, "-o", out)
    assert code == 0, err
    assert "saved by 2 rank(s)" in stdout
    got, want = load_file(out), load_file(sweep_sources.base / "fsdp2.safetensors")
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name

    broken = tmp_path / "broken"
    shutil.copytree(src, broken, symlinks=True)
    tag = next(p for p in broken.iterdir() if p.is_dir())
    victim = sorted(tag.glob("*.distcp"))[-1]
    victim.unlink()
    code, _, err = run_cli("consolidate", broken, "-o", tmp_path / "x.safetensors")
    assert code == 1 and victim.name in err, err
    assert not (tmp_path / "x.safetensors").exists()


def test_a_window_cancelled_behind_a_failed_one_leaves_the_failure_raised(monkeypatch):
    """Under load a window can still be queued when another fails (disk full); join_pool cancels it, and
    asking a cancelled future for its exception raises CancelledError: the run ended in that traceback instead
    of the failure's own line (seen once in a full run on the filling-filesystem test). Deterministic here:
    the pool hands back one failed and one cancelled future."""
    import errno
    from concurrent.futures import Future

    import shardkit.checkpoint.ops.consolidate as consolidate

    def submit_all(pool, fn, calls):
        failed, queued = Future(), Future()
        failed.set_exception(OSError(errno.ENOSPC, "No space left on device"))
        queued.cancel()
        return [failed, queued]

    monkeypatch.setattr(consolidate, "submit_all", submit_all)
    with pytest.raises(OSError) as err:
        consolidate._copy_windows(-1, 0, {}, {}, [(0, 8), (8, 16)])
    assert err.value.errno == errno.ENOSPC
