"""`shardkit inspect`: what a checkpoint is (format, stage, world size, dtypes, parameters, optimizer,
step, size, manifest) and which commands take it, from real saves of every layout shardkit knows,
read without torch and without tensor bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import _ranks_layouts as L

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="session")
def layouts(tmp_path_factory) -> dict[str, Path]:
    return L.build_layouts(tmp_path_factory.getbasetemp() / "layouts")


@pytest.fixture(scope="session")
def fsdp_saves(tmp_path_factory) -> Path:
    """accelerate's own FSDP1/FSDP2 saves in every layout (2 gloo ranks; test_trainer_checkpoint's writer)."""
    from shardkit.run.spawn.process import run_ranks
    from tests.test_trainer_checkpoint import save_fsdp_layouts

    base = tmp_path_factory.getbasetemp() / "fsdp_layouts"
    run_ranks(save_fsdp_layouts, 2, args=(str(base),), timeout=300, device="cpu")
    return base


@pytest.fixture(scope="session")
def tiny_counts() -> tuple[int, int]:
    """(parameter tensors, elements) of the tiny Llama every DeepSpeed save here trained."""
    from shardkit.engines.model_factory import tiny_llama

    params = list(tiny_llama("tiny", seed=0).parameters())
    return len(params), sum(p.numel() for p in params)


def _inspect(run_cli, path: Path) -> dict:
    code, stdout, err = run_cli("inspect", path, "--json")
    assert code == 0, err
    return json.loads(stdout)


# label -> (format, stage, world size, precision, offload, optimizer state dtype)
DEEPSPEED = {
    "zero1": ("deepspeed", 1, 2, "fp32", None, "float32"),
    "zero2_bf16": ("deepspeed", 2, 2, "bf16", None, "float32"),
    "zero2_offload": ("deepspeed", 2, 2, "fp32", "cpu", "float32"),
    "zero3": ("deepspeed", 3, 2, "bf16", None, "float32"),
    "universal": ("deepspeed-universal", None, None, "fp32", "cpu", None),
}


@pytest.mark.parametrize("label", sorted(DEEPSPEED))
def test_deepspeed_saves_are_described(layouts, run_cli, tiny_counts, label):
    fmt, stage, world, precision, offload, state_dtype = DEEPSPEED[label]
    d = _inspect(run_cli, layouts[label])
    assert (d["format"], d["stage"], d["world_size"], d["precision"], d["offload"]) == (fmt, stage, world, precision, offload)
    assert (d["parameters"], d["elements"]) == tiny_counts
    assert d["optimizer"] == "AdamW" and d["optimizer_state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    assert d["step"] == 1 and d["manifest"] == "absent" and d["refusals"] == []
    assert d["dtypes"].get("optimizer state") == state_dtype and d["dtypes"]["fp32 masters"] == "float32"
    on_disk = sum(f.stat().st_size for f in Path(d["folder"]).rglob("*") if f.is_file())
    assert d["size_bytes"] == on_disk
    applies = {c["command"]: c["applies"] for c in d["commands"]}
    # every save here has no manifest: verify's structural check takes each (tests/test_inspect_table.py
    # runs every command on these layouts and holds each cell to what the command does)
    if label == "zero3":
        assert applies == {"reshard": True, "convert --to zero1": True, "convert --to zero2": True,
                           "convert --to zero3": False, "convert --to fsdp2": True, "convert --to universal": True,
                           "consolidate": True, "export": True, "verify": True}
    elif label == "universal":  # tests/test_universal_source.py
        assert applies == {"reshard": False, "convert --to zero1": True, "convert --to zero2": True,
                           "convert --to zero3": True, "convert --to fsdp2": True, "convert --to universal": False,
                           "consolidate": True, "export": True, "verify": True}
    else:  # ZeRO-1/2: every command but convert --to zero1/zero2 (reshard changes its world size)
        assert applies == {"reshard": True, "convert --to zero1": False, "convert --to zero2": False,
                           "convert --to zero3": True, "convert --to fsdp2": True, "convert --to universal": True,
                           "consolidate": True, "export": True, "verify": True}


def test_text_output_says_what_it_is_and_where_to_go(layouts, run_cli):
    code, stdout, err = run_cli("inspect", layouts["zero2_bf16"])
    assert code == 0, err
    lines = stdout.splitlines()
    assert lines[1].split(None, 1) == ["layout", "DeepSpeed ZeRO-2"]
    assert "world size  2" in stdout and "precision   bf16" in stdout
    assert "optimizer   AdamW (state: exp_avg, exp_avg_sq, step)" in stdout
    assert "  yes  reshard                new per-rank ZeRO-2 files for --world-size M" in stdout
    assert "  yes  convert --to zero3     per-rank ZeRO-3 files for --world-size N" in stdout
    assert ("  no   convert --to zero2     is a DeepSpeed ZeRO-1/2 checkpoint already; --to zero2 converts other "
            f"formats. For another world size: shardkit reshard {layouts['zero2_bf16']} --world-size N -o OUT") in stdout
    code, stdout, _ = run_cli("inspect", layouts["zero3"])
    assert code == 0 and "  yes  reshard" in stdout
    assert "  no   convert --to zero3     is a DeepSpeed ZeRO-3 checkpoint already" in stdout


@pytest.mark.parametrize("label,marker", [
    ("autoep", "ds_autoep_layers"), ("tensor_parallel", "mp_world_size 2"), ("pipeline", "layer_01-model_00"),
    ("moe", "expp_rank_0"), ("nvme", "offloaded_tensors/"),
])
def test_markers_are_listed_as_refusals(layouts, run_cli, label, marker):
    d = _inspect(run_cli, layouts[label])
    assert d["refusals"] and marker in d["refusals"][0]["marker"]
    converting = [c for c in d["commands"] if c["command"] != "verify"]
    assert not any(c["applies"] for c in converting) and all(marker in c["why"] for c in converting)
    verify = next(c for c in d["commands"] if c["command"] == "verify")  # checks the files, names the marker
    assert verify["applies"] and verify["why"].startswith("a structural check, there being no manifest")
    code, stdout, _ = run_cli("inspect", layouts[label])
    assert code == 0 and "refused: " in stdout and marker in stdout
    assert stdout.count(marker) == 1 and "  no   export                 refused for the marker above" in stdout


def test_a_trainer_checkpoint_wrapping_zero2(layouts, run_cli):
    d = _inspect(run_cli, layouts["trainer_zero2"].parent)  # the output_dir: its newest checkpoint-N
    assert d["trainer_folder"] == str(layouts["trainer_zero2"])
    assert d["layout"] == "Hugging Face Trainer checkpoint-4 holding DeepSpeed ZeRO-2" and d["stage"] == 2
    assert any("Trainer output_dir" in n for n in d["notes"])


# accelerate's label -> (format, state_dict_type, world size, export/consolidate/convert --to fsdp2 apply)
FSDP = {
    "fsdp1_sharded": ("accelerate-fsdp", "SHARDED_STATE_DICT", 2, True),
    "fsdp2_sharded": ("accelerate-fsdp", "SHARDED_STATE_DICT", 2, True),
    "fsdp2_full": ("accelerate-fsdp", "FULL_STATE_DICT", None, True),
    "fsdp1_local": ("accelerate-fsdp", "LOCAL_STATE_DICT", 2, False),
    "fsdp2_sharded_per_rank": ("accelerate-fsdp", "SHARDED_STATE_DICT (use_dcp=False)", 2, True),
}


@pytest.mark.parametrize("label", sorted(FSDP))
def test_accelerate_fsdp_saves_are_described(fsdp_saves, run_cli, label):
    fmt, kind, world, export = FSDP[label]
    d = _inspect(run_cli, fsdp_saves / label / "checkpoint-2")
    assert (d["format"], d["state_dict_type"], d["world_size"]) == (fmt, kind, world)
    applies = {c["command"]: c["applies"] for c in d["commands"]}
    # readers.fsdp1 takes SHARDED and FULL, readers.fsdp1_bins the per-rank files; reshard none (the Trainer
    # resumes SHARDED and FULL at any world size), LOCAL_STATE_DICT nothing
    assert applies == {"reshard": False, **dict.fromkeys(("convert --to zero1", "convert --to zero2",
                       "convert --to zero3", "convert --to fsdp2", "convert --to universal", "consolidate", "export",
                       "verify"), export)}
    if export:
        # Sequential(Linear(16, 16), Linear(16, 4)): 4 tensors, 16*16 + 16 + 16*4 + 4 elements; the torch.save
        # layouts' shapes, dtypes and Adam state from their readers (pickled structures, no tensor bytes)
        assert (d["parameters"], d["elements"], d["dtypes"]["weights"]) == (4, 340, "float32")
        assert d["optimizer_state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    if export:
        # Adam's step, the same for every parameter (no trainer_state.json in these saves): the SHARDED layouts'
        # from the optimizer DCP's 0-dim step records, the torch.save layouts' from their readers
        assert d["step"] == 1
        assert d["precision"] is None  # float32 parameters: an fp32 run and a mixed-precision run save the same


def test_an_accelerate_dcp_save_says_its_step_and_why_its_precision_is_unknown(fsdp_saves, tmp_path, run_cli):
    """accelerate's save_state outside a Trainer checkpoint-N (no trainer_state.json): the step is Adam's, read
    from the optimizer DCP; the precision row says why the files cannot tell it rather than '?'."""
    import shutil

    src = tmp_path / "accelerate_state"
    shutil.copytree(fsdp_saves / "fsdp1_sharded" / "checkpoint-2", src)
    (src / "trainer_state.json").unlink(missing_ok=True)
    code, out, err = run_cli("inspect", src)
    assert code == 0, err
    rows = dict(line.split(None, 1) if " " in line else (line, "") for line in out.splitlines()
                if line.startswith(("step ", "precision ")))
    assert rows["step"].strip() == "1", out
    assert rows["precision"].startswith("not recorded (parameters saved as float32"), out
    weights_only = _inspect(run_cli, src / "pytorch_model_fsdp_0")
    assert weights_only["step"] is None  # no optimizer state, so nothing records the step


def test_a_dcp_folder_and_a_hugging_face_folder(fsdp_saves, tmp_path, run_cli):
    import torch
    from safetensors.torch import save_file

    d = _inspect(run_cli, fsdp_saves / "fsdp2_sharded" / "checkpoint-2" / "pytorch_model_fsdp_0")
    assert (d["format"], d["world_size"], d["parameters"], d["elements"]) == ("dcp", 2, 4, 340)
    applies = {c["command"]: c["applies"] for c in d["commands"]}
    # the model folder alone holds no optimizer state: export and consolidate take it, no convert target does
    assert applies["consolidate"] is True and applies["export"] is True
    said = {c["command"]: c["why"] for c in d["commands"] if not c["applies"]}
    assert said["convert --to zero3"].startswith("shardkit's dcp reader describes this checkpoint's weights only")
    save_file({"w": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(4)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    d = _inspect(run_cli, tmp_path)
    assert (d["format"], d["parameters"], d["elements"], d["dtypes"]["weights"]) == ("hf-model", 2, 16, "bfloat16, float32")
    assert not any(c["applies"] for c in d["commands"])


def test_manifest_sizes_are_checked(layouts, tmp_path, run_cli):
    code, _, err = run_cli("reshard", layouts["zero3"], "--world-size", "1", "-o", tmp_path / "ws1")
    assert code == 0, err
    d = _inspect(run_cli, tmp_path / "ws1")
    assert (d["manifest"], d["world_size"], d["stage"]) == ("sizes match", 1, 3)
    rank_file = next((tmp_path / "ws1" / "global_step1").glob("*optim_states.pt"))
    with open(rank_file, "ab") as f:
        f.write(b"x")
    d = _inspect(run_cli, tmp_path / "ws1")
    assert d["manifest"].startswith("fails: ") and rank_file.name in d["manifest"]


def test_not_a_checkpoint_is_exit_1_naming_the_folder(tmp_path, run_cli):
    (tmp_path / "notes.txt").write_text("hi")
    code, stdout, err = run_cli("inspect", tmp_path)
    assert code == 1 and f"{tmp_path}: not a checkpoint shardkit knows (it holds ['notes.txt'])" in err


def test_inspect_never_imports_torch(layouts, fsdp_saves):
    # accelerate's torch.save layouts too: their readers parse the pickles for shapes, dtypes and Adam state
    accelerate = [str(fsdp_saves / label / "checkpoint-2")
                  for label in ("fsdp2_full", "fsdp2_sharded_per_rank", "fsdp1_sharded", "fsdp2_sharded")]
    code = ("import sys; from shardkit.cli import main\n"
            f"for p in {[str(layouts[k]) for k in ('zero3', 'zero1', 'universal', 'autoep')] + accelerate!r}:\n"
            "    assert main(['inspect', p, '--json']) == 0\n"
            "assert not {'torch', 'deepspeed'} & set(sys.modules), 'heavy import'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
