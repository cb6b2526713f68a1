"""A reshard accounts for every file of its source: rewritten, copied, or named in ``not_carried`` with why.

An Accelerate ``save_state`` folder holds DeepSpeed's root (``latest``, ``pytorch_model/``) and the files
``load_state`` reads beside it (``random_states_<process>.pkl``, ``scheduler.bin``,
``custom_checkpoint_0.pkl``). The reshard used to write ``latest`` and ``pytorch_model/`` only: resumed at
world size 1, GPT-2 with dropout drew other dropout masks and its losses left the original's. Measured
here (2 -> 1 rank, tests/_ranks_accelerate_zero2.py): the first loss after ``load_state`` of the reshard is
the original's rank 0 loss at that step, bit for bit; without ``random_states_0.pkl`` it is another one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from shardkit.checkpoint.hf_trainer.rng_files import ACCELERATE_RNG, plan_rng_files
from tests._ranks_accelerate_zero2 import STEPS, resume_run, save_run

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def accelerate_save(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[float]]]:
    """``Accelerator.save_state`` of a 2-process DeepSpeed ZeRO-2 run (read-only: copy it to change it), and
    each process's losses, the ones after the save included."""
    from shardkit.run.spawn.process import run_ranks

    folder = tmp_path_factory.mktemp("accelerate") / "step_2"
    results = run_ranks(save_run, 2, args=(str(folder),), timeout=300, device="cpu")
    return folder, [r.value for r in results]


def _resume(folder: Path) -> dict[str, Any]:
    from shardkit.run.spawn.process import run_ranks

    return run_ranks(resume_run, 1, args=(str(folder),), timeout=300, device="cpu")[0].value


@pytest.mark.slow  # a 2-process Accelerate save or a 2-rank FSDP2 save first
def test_accelerate_resume_after_reshard_keeps_rank_rng(accelerate_save, tmp_path, run_cli):
    src, original = accelerate_save
    out = tmp_path / "out"
    code, stdout, _ = run_cli("reshard", src, "--world-size", 1, "-o", out, "--json")
    assert code == 0
    result = json.loads(stdout)
    assert result["carried"] == ["custom_checkpoint_0.pkl", "random_states_0.pkl", "scheduler.bin",
                                 "zero_to_fp32.py", "zero_to_torch.py"]
    assert result["not_carried"] == [
        "random_states_1.pkl (its rank does not exist at world size 1; no rank would read it)"]
    for name in ("random_states_0.pkl", "scheduler.bin", "custom_checkpoint_0.pkl"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert not (out / "random_states_1.pkl").exists()

    # the reference: the DeepSpeed part alone (what the reshard wrote before) with the files copied by hand
    by_hand = tmp_path / "by_hand"
    by_hand.mkdir()
    shutil.copytree(out / "pytorch_model", by_hand / "pytorch_model")
    shutil.copy2(out / "latest", by_hand / "latest")
    without_rng = tmp_path / "without_rng"
    shutil.copytree(by_hand, without_rng)
    for name in ("random_states_0.pkl", "scheduler.bin", "custom_checkpoint_0.pkl"):
        shutil.copy2(src / name, by_hand / name)
    for name in ("scheduler.bin", "custom_checkpoint_0.pkl"):
        shutil.copy2(src / name, without_rng / name)

    resumed, reference, no_rng = _resume(out), _resume(by_hand), _resume(without_rng)
    assert resumed == reference
    # rank 0's draws continue: the first step after the save sees the original run's dropout masks
    assert resumed["losses"][0] == original[0][STEPS]
    assert resumed["seen"] == STEPS  # custom_checkpoint_0.pkl restored the registered object
    assert no_rng["losses"][0] != resumed["losses"][0]  # the RNG decides the losses: the check can fail


@pytest.mark.slow  # a 2-process Accelerate save or a 2-rank FSDP2 save first
def test_file_nothing_models_is_copied_and_named(accelerate_save, tmp_path, run_cli):
    src = tmp_path / "src"
    shutil.copytree(accelerate_save[0], src)
    (src / "run_notes.txt").write_text("lr sweep 3")
    (src / "extras").mkdir()
    (src / "extras" / "a.txt").write_text("x")
    (src / "pytorch_model" / "README").write_text("saved by hand")
    (src / "elsewhere").symlink_to(tmp_path)
    os.mkfifo(src / "sampler.bin")  # read, it would block the reshard forever
    out = tmp_path / "out"
    code, stdout, err = run_cli("reshard", src, "--world-size", 3, "-o", out)
    assert code == 0, err
    assert "run_notes.txt" in stdout.split("copied unchanged: ")[1].splitlines()[0]
    assert (out / "run_notes.txt").read_text() == "lr sweep 3"
    assert "not carried: extras/ (a folder nothing a resume loads is known to read" in stdout
    assert "not carried: pytorch_model/README (in the tag folder but not a DeepSpeed rank file" in stdout
    assert "not carried: elsewhere (a link or special file: never followed)" in stdout
    assert "not carried: sampler.bin (a link or special file: never followed)" in stdout
    assert not (out / "extras").exists() and not (out / "elsewhere").exists() and not (out / "sampler.bin").exists()
    # ranks 0 and 1 keep their own RNG file; rank 2 gets none (another rank's would repeat its draws), said so
    assert (out / "random_states_1.pkl").read_bytes() == (src / "random_states_1.pkl").read_bytes()
    assert not (out / "random_states_2.pkl").exists()
    assert ("note: no RNG state for rank(s) 2: they did not exist in the saved run. Accelerate's load_state logs "
            "\"Could not load random states\"") in stdout


@pytest.mark.slow  # a 2-process Accelerate save or a 2-rank FSDP2 save first
def test_root_with_several_tags_names_the_others(accelerate_save, tmp_path, run_cli):
    src = tmp_path / "src"
    shutil.copytree(accelerate_save[0], src)
    shutil.copytree(src / "pytorch_model", src / "pytorch_model_old")
    out = tmp_path / "out"
    code, stdout, err = run_cli("reshard", src, "--world-size", 1, "-o", out, "--json")
    assert code == 0, err
    result = json.loads(stdout)
    assert "pytorch_model_old/ (another tag; 'latest' names pytorch_model)" in result["not_carried"]
    hint = [n for n in result["notes"] if "several tags" in n]
    assert hint and "also there: pytorch_model_old" in hint[0] and str(src / "pytorch_model_old") in hint[0]
    # the way the note gives: the other tag, by its folder
    code, stdout, err = run_cli("reshard", src / "pytorch_model_old", "--world-size", 1, "-o", tmp_path / "old")
    assert code == 0, err
    assert (tmp_path / "old" / "pytorch_model_old").is_dir()
    assert not (tmp_path / "old" / "random_states_0.pkl").exists()  # saved with the tag 'latest' names
    assert (f"note: {src / 'pytorch_model_old'} is a tag folder of {src}, which holds custom_checkpoint_0.pkl, "
            "random_states_0.pkl, random_states_1.pkl, scheduler.bin") in stdout
    assert "they belong to the save 'latest' names (pytorch_model)" in stdout

    code, stdout, err = run_cli("convert", src, "--to", "fsdp2", "-o", tmp_path / "dcp", "--json")
    assert code == 0, err
    result = json.loads(stdout)
    assert "pytorch_model_old/ (another tag; 'latest' names pytorch_model, the one converted)" in result["not_carried"]
    assert any(n.startswith("random_states_0.pkl (no slot for it") for n in result["not_carried"])
    assert any("also there: pytorch_model_old" in n for n in result["notes"])


@pytest.mark.parametrize(("world", "copies", "dropped", "absent"), [
    (1, [("random_states_0.pkl", "random_states_0.pkl")], ["random_states_1.pkl"], []),  # no one-process name
    (2, [("random_states_0.pkl", "random_states_0.pkl"), ("random_states_1.pkl", "random_states_1.pkl")], [], []),
    (3, [("random_states_0.pkl", "random_states_0.pkl"), ("random_states_1.pkl", "random_states_1.pkl")], [], [2]),
])
def test_accelerate_rng_files_follow_their_processes(world, copies, dropped, absent):
    plan = plan_rng_files(["random_states_0.pkl", "random_states_1.pkl", "rng_state_0.pth"], world, ACCELERATE_RNG)
    assert (list(plan.copies), list(plan.dropped), list(plan.absent), plan.stray) == (copies, dropped, absent, ())


@pytest.mark.slow  # a 2-process Accelerate save or a 2-rank FSDP2 save first
def test_convert_of_an_fsdp2_root_names_its_other_tag_and_files(sweep_sources, tmp_path, run_cli):
    src = tmp_path / "src"
    shutil.copytree(sweep_sources.root("fsdp2"), src)
    tag = (src / "latest").read_text().strip()
    shutil.copytree(src / tag, src / "older")
    (src / "notes.txt").write_text("run 7")
    code, stdout, err = run_cli("convert", src, "--to", "zero3", "--world-size", 2, "-o", tmp_path / "out", "--json",
                                "--ds-config", sweep_sources.root("ds_config"))
    assert code == 0, err
    result = json.loads(stdout)
    assert f"older/ (another tag; 'latest' names {tag}, the one converted)" in result["not_carried"]
    assert (f"notes.txt (no slot for it in the converted checkpoint, which holds model and optimizer state; it stays "
            f"in {src})") in result["not_carried"]
    assert any("also there: older (not read). To take another, pass its tag folder" in n for n in result["notes"])


@pytest.mark.slow  # a 2-process Accelerate save or a 2-rank FSDP2 save first
def test_trainer_reshard_json_names_what_it_does_not_carry(accelerate_save, tmp_path, run_cli):
    """The Trainer's checkpoint-N path reports its dropped RNG files and other tags in not_carried as well."""
    src = tmp_path / "checkpoint-2"
    shutil.copytree(accelerate_save[0], src)
    (src / "pytorch_model").rename(src / "global_step2")
    shutil.copytree(src / "global_step2", src / "global_step1")
    (src / "latest").write_text("global_step2")
    (src / "trainer_state.json").write_text('{"global_step": 2}')
    for r in (0, 1):
        (src / f"random_states_{r}.pkl").rename(src / f"rng_state_{r}.pth")
    code, stdout, err = run_cli("reshard", src, "--world-size", 1, "-o", tmp_path / "ws1", "--json")
    assert code == 0, err
    result = json.loads(stdout)
    assert result["not_carried"] == [
        "global_step1/ (a DeepSpeed tag 'latest' does not name; never loaded)",
        "rng_state_1.pth (its rank does not exist at world size 1; no rank would read it)"]
    assert (tmp_path / "ws1" / "rng_state.pth").read_bytes() == (src / "rng_state_0.pth").read_bytes()
