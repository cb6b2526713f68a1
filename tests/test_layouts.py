"""Every checkpoint command refuses the layouts it cannot convert correctly before writing anything,
naming the marker and where to go: AutoEP expert partitions, native MoE expert files,
tensor/pipeline-parallel ranks, NVMe-swapped optimizer state, and (reshard only) a universal
checkpoint (``checkpoint.layout.support``, the one table that decides). Real DeepSpeed saves; see
``tests/_ranks_layouts.py`` for which layouts are real and which are real files carrying DeepSpeed's
marker."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import _ranks_layouts as L

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="session")
def layouts(tmp_path_factory) -> dict[str, Path]:
    return L.build_layouts(tmp_path_factory.getbasetemp() / "layouts")


#: label -> what the refusal must name (the marker as found, or the layout and where to go).
REFUSED = {
    "universal": ["a DeepSpeed universal checkpoint needs no reshard", "checkpoint.load_universal: true",
                  "convert --to zero3 (or zero2/zero1) --world-size N"],
    "autoep": ["'ds_autoep_layers' in the model states (DeepSpeed AutoEP)", "incomplete expert tensors",
               "ds_to_universal.py"],
    "tensor_parallel": ["tensor/model-parallel ranks (mp_world_size 2", "zero_pp_rank_0_mp_rank_01_model_states.pt"],
    "pipeline": ["pipeline-parallel layer files (layer_01-model_00-model_states.pt)"],
    "moe": ["native DeepSpeed MoE expert files", "expp_rank_0_mp_rank_00_optim_states.pt"],
    "nvme": ["offloaded_tensors/ (the NVMe swap folder", "swapped to NVMe"],
    "mixed_stages": ["zero_pp_rank_0_mp_rank_00_model_states.pt, zero_pp_rank_1_mp_rank_00_model_states.pt beside "
                     "the ZeRO-1/2 files (mp_rank_00_model_states.pt)", "two saves of different stages"],
}

COMMANDS = {
    "reshard": lambda src, out: ["reshard", src, "--world-size", "1", "-o", out],
    **{f"convert --to zero{n}": (lambda n: lambda src, out: ["convert", src, "--to", f"zero{n}", "--world-size", "1",
                                                              "-o", out])(n) for n in (1, 2, 3)},
    "convert --to fsdp2": lambda src, out: ["convert", src, "--to", "fsdp2", "-o", out],
    "convert --to universal": lambda src, out: ["convert", src, "--to", "universal", "-o", out],
    "consolidate": lambda src, out: ["consolidate", src, "-o", out / "model.safetensors"],
    "export": lambda src, out: ["export", src, "-o", out],
}


#: The refusals ``refuse_unsupported`` raises itself: every command that reads tensors for a marker, reshard for a
#: universal checkpoint (the other commands take it: tests/test_universal_source.py). ZeRO-1/2 is taken by every
#: command but convert --to zero1/zero2, whose own check says "already" (tests/test_inspect_table.py holds each cell).
CASES = [(label, command) for label in sorted(REFUSED) for command in sorted(COMMANDS)
         if label != "universal" or command == "reshard"]


@pytest.mark.parametrize("label,command", CASES)
def test_unsupported_layout_is_refused_by_name_and_nothing_is_written(layouts, tmp_path, run_cli, label, command):
    out = tmp_path / "out"
    before = sorted(p.name for p in layouts[label].rglob("*"))
    code, stdout, err = run_cli(*COMMANDS[command](layouts[label], out))
    assert code == 1, (stdout, err)
    assert f"shardkit {command} refuses {layouts[label]}" in err
    for said in REFUSED[label]:
        assert said in err, f"{said!r} not in {err!r}"
    assert "Nothing was written" in err
    assert not out.exists() and not list(tmp_path.iterdir())
    assert sorted(p.name for p in layouts[label].rglob("*")) == before, "the source was changed"


def test_the_python_api_refuses_too(layouts, tmp_path):
    from shardkit.checkpoint.ops.consolidate import consolidate_checkpoint
    from shardkit.checkpoint.ops.reshard import reshard_checkpoint
    from shardkit.core.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"ds_autoep_layers.*incomplete expert tensors"):
        reshard_checkpoint(layouts["autoep"], tmp_path / "r", 1)
    with pytest.raises(CheckpointError, match=r"native DeepSpeed MoE expert files"):
        consolidate_checkpoint(layouts["moe"], tmp_path / "m.safetensors")
    assert not list(tmp_path.iterdir())


def test_the_real_zero3_save_the_markers_were_added_to_is_taken(layouts, tmp_path, run_cli):
    """The control: the same ZeRO-3 files without a marker pass the check and reshard as before."""
    from shardkit.checkpoint.layout.support import refuse_unsupported

    refuse_unsupported(layouts["zero3"], "reshard")  # no exception
    code, stdout, err = run_cli("reshard", layouts["zero3"], "--world-size", "1", "-o", tmp_path / "ws1")
    assert code == 0, err
    assert "world size 2 -> 1" in stdout


def test_a_path_the_check_cannot_describe_is_left_to_the_command(tmp_path, run_cli):
    """No layout to judge: the command's own reader names the problem, as before."""
    from shardkit.checkpoint.layout.support import refuse_unsupported

    refuse_unsupported(tmp_path / "missing", "reshard")
    (tmp_path / "empty").mkdir()
    refuse_unsupported(tmp_path / "empty", "reshard")
    code, _, err = run_cli("reshard", tmp_path / "missing", "--world-size", "1", "-o", tmp_path / "o")
    assert code == 1 and "checkpoint path does not exist" in err
