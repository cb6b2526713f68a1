"""Hugging Face Trainer checkpoints, for real: a transformers.Trainer with a DeepSpeed ZeRO-3 config
trains on 2 CPU ranks and saves checkpoint-2 and checkpoint-4; `shardkit reshard` writes
checkpoint-2 for 3 ranks; a Trainer on 3 ranks resumes it with resume_from_checkpoint and trains
to max_steps. The engine holds, right after the Trainer loaded it, the resharded fp32 masters and
Adam moments bit for bit; RNG files follow their ranks; verify and consolidate take the
checkpoint-N folder and the output_dir; Trainer folders without a DeepSpeed checkpoint are refused
with one message naming them.

The two Trainer runs (about 25 s each on an idle 2-core machine) happen once per session, shared by
pytest-xdist workers through a file lock (xdist's recipe, as in test_preflight).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkit.checkpoint.hf_trainer.rng_files import plan_rng_files

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "_ranks_trainer.py"
TRAINER_TIMEOUT = 300


def _tail(log: Path, n: int = 3000) -> str:
    return log.read_text(errors="replace")[-n:] if log.is_file() else "(no log)"


def _torchrun(nproc: int, args: list[str], log: Path) -> None:
    """One real Trainer run under torchrun, killed with all its ranks after TRAINER_TIMEOUT."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            str(SCRIPT), *args]
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            code = proc.wait(timeout=TRAINER_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"Trainer run timed out after {TRAINER_TIMEOUT}s: {argv}\n{_tail(log)}") from None
    if code != 0:
        raise AssertionError(f"Trainer run failed (exit {code}): {argv}\n{_tail(log)}")


def _cli(*argv: Any) -> tuple[int, str, str]:
    from shardkit.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def _build(base: Path) -> dict[str, Any]:
    src, new, resumed, dump = base / "src", base / "new" / "checkpoint-2", base / "resumed", base / "dump"
    # --perturb-rng: each rank's saved torch RNG differs, so a test can tell which file a rank loaded
    _torchrun(2, ["--out", str(src), "--max-steps", "4", "--save-steps", "2", "--perturb-rng",
                  "--result", str(base / "src.json")], base / "src.log")
    code, out, err = _cli("reshard", src / "checkpoint-2", "--world-size", "3", "-o", new)
    if code != 0:
        raise AssertionError(f"shardkit reshard failed ({code}): {out}{err}")
    _torchrun(3, ["--out", str(resumed), "--max-steps", "4", "--save-steps", "2", "--resume", str(new),
                  "--dump-loaded", str(dump), "--result", str(base / "resumed.json")], base / "resumed.log")
    return {"base": str(base), "reshard_out": out, "reshard_err": err,
            "src": json.loads((base / "src.json").read_text()),
            "resumed": json.loads((base / "resumed.json").read_text())}


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> dict[str, Any]:
    """The real Trainer runs: source at 2 ranks, reshard to 3, resume at 3 (shared by xdist workers)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    base, done, failed = root / "trainer_ckpt", root / "trainer_ckpt.json", root / "trainer_ckpt.failed"
    with FileLock(str(done) + ".lock"):
        if failed.is_file():  # built and failed once: report it again instead of paying for it again
            raise AssertionError(failed.read_text())
        if not done.is_file():
            shutil.rmtree(base, ignore_errors=True)
            base.mkdir()
            try:
                done.write_text(json.dumps(_build(base)))
            except BaseException as exc:
                failed.write_text(f"{type(exc).__name__}: {exc}")
                raise
    data = json.loads(done.read_text())
    data["base"] = Path(data["base"])
    return data


def _optim(tag_dir: Path, rank: int) -> dict[str, Any]:
    f = tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    return torch.load(f, weights_only=False)["optimizer_state_dict"]


def test_reshard_writes_a_whole_checkpoint_n(runs):
    base = runs["base"]
    src, new = base / "src" / "checkpoint-2", base / "new" / "checkpoint-2"
    names = sorted(p.name for p in new.iterdir())
    assert names == ["config.json", "generation_config.json", "global_step2", "latest", "rng_state_0.pth",
                     "rng_state_1.pth", "trainer_state.json", "training_args.bin", "zero_to_fp32.py",
                     "zero_to_torch.py"]
    assert (new / "latest").read_text() == "global_step2"
    ranks = sorted(p.name for p in (new / "global_step2").glob("zero_pp_rank_*"))
    assert len(ranks) == 6 and "zero_pp_rank_2_mp_rank_00_optim_states.pt" in ranks
    for name in ("trainer_state.json", "training_args.bin", "config.json", "rng_state_0.pth", "rng_state_1.pth"):
        assert (new / name).read_bytes() == (src / name).read_bytes(), name
    # staged beside the output and renamed: nothing else was left in its parent
    assert sorted(p.name for p in new.parent.iterdir()) == ["checkpoint-2"]
    out = runs["reshard_out"]
    assert "world size 2 -> 3" in out and f"resume_from_checkpoint={str(new)!r}" in out
    assert "no RNG state for rank(s) 2" in out and "4 samples" in out and "it is 6" in out
    assert "no shardkit_manifest.json" in runs["reshard_err"]  # the Trainer's own save has no manifest


def test_trainer_resumes_at_three_ranks_with_the_optimizer_state(runs):
    base = runs["base"]
    new_tag = base / "new" / "checkpoint-2" / "global_step2"
    src, resumed = runs["src"], runs["resumed"]
    assert resumed["world_size"] == 3 and resumed["global_step"] == 4
    # trainer_state.json carried over: the log history of steps 1-2 is the source run's, then 2 new steps
    assert len(resumed["losses"]) == 4 and resumed["losses"][:2] == src["losses"][:2]
    assert all(math.isfinite(x) for x in resumed["losses"][2:])
    for rank in range(3):
        loaded = torch.load(base / "dump" / f"rank{rank}.pt", weights_only=False)
        saved = _optim(new_tag, rank)
        assert loaded["global_step"] == 2
        assert len(loaded["fp32"]) == len(saved["fp32_flat_groups"])
        for i, flat in enumerate(loaded["fp32"]):
            assert torch.equal(flat, saved["fp32_flat_groups"][i]), (rank, i)
            state = saved["optimizer_state_dict"]["state"][i]
            assert int(loaded["state"][i]["step"]) == int(state["step"]) == 2
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(loaded["state"][i][key], state[key]), (rank, i, key)
    # the comparison can fail: rank 0's partition is not rank 1's
    assert not torch.equal(torch.load(base / "dump" / "rank0.pt", weights_only=False)["fp32"][0][:100],
                           _optim(new_tag, 1)["fp32_flat_groups"][0][:100])
    # and the resumed run saved its own 3-rank checkpoint at max_steps
    assert len(list((base / "resumed" / "checkpoint-4" / "global_step4").glob("*optim_states.pt"))) == 3
    # the LR scheduler (inside DeepSpeed's model states) went on from step 2, as in the uninterrupted run:
    # a fresh one would give step 3 the first step's rate
    def rates(run: str) -> list[float]:
        state = json.loads((base / run / "checkpoint-4" / "trainer_state.json").read_text())
        return [h["learning_rate"] for h in state["log_history"] if "learning_rate" in h]

    assert rates("resumed") == rates("src") and len(set(rates("src"))) == 4


def test_rng_files_follow_their_ranks(runs):
    base = runs["base"]
    new = base / "new" / "checkpoint-2"
    saved = [torch.load(new / f"rng_state_{r}.pth", weights_only=False)["cpu"] for r in (0, 1)]
    assert not torch.equal(saved[0], saved[1])  # --perturb-rng made them differ, so the checks below can fail
    at_first_step = [torch.load(base / "dump" / f"rank{r}.pt", weights_only=False)["rng_cpu"] for r in range(3)]
    assert torch.equal(at_first_step[0], saved[0]) and torch.equal(at_first_step[1], saved[1])
    # rank 2 had no file: it kept the RNG the Trainer seeded it with, not another rank's stream
    assert not torch.equal(at_first_step[2], saved[0]) and not torch.equal(at_first_step[2], saved[1])


def test_fp32_masters_consolidated_from_source_and_resharded_are_bit_identical(runs, tmp_path):
    from safetensors.torch import load_file

    base = runs["base"]
    code, out, err = _cli("consolidate", base / "src" / "checkpoint-2", "-o", tmp_path / "src.safetensors")
    assert code == 0, err
    code, out, err = _cli("consolidate", base / "new" / "checkpoint-2", "-o", tmp_path / "new.safetensors")
    assert code == 0, err
    assert "sizes and content digests (blake3 or sha256, as its manifest lists them) match its manifest" in out
    a, b = load_file(tmp_path / "src.safetensors"), load_file(tmp_path / "new.safetensors")
    assert a.keys() == b.keys() and len(a) > 10
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_output_dir_resolves_to_the_newest_checkpoint(runs, tmp_path):
    from safetensors.torch import load_file

    src = runs["base"] / "src"
    code, out, err = _cli("consolidate", src, "-o", tmp_path / "dir.safetensors")
    assert code == 0, err
    assert f"{src} is a Trainer output_dir: using checkpoint-4" in out and "also there: checkpoint-2" in out
    code, _, err = _cli("consolidate", src / "checkpoint-4", "-o", tmp_path / "four.safetensors")
    assert code == 0, err
    a, b = load_file(tmp_path / "dir.safetensors"), load_file(tmp_path / "four.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()
    code, out, _ = _cli("verify", src, "--json")  # no manifest: the structural check of checkpoint-4's tag
    report = json.loads(out)
    assert code == 0 and report["tensor_folder"] == str(src / "checkpoint-4" / "global_step4")
    rules = {f["rule"] for f in report["findings"]}
    assert rules == {"ckpt.trainer.newest"} and report["check"] == "structure"
    # convert --to fsdp2 takes it too: fp32 masters and moments of checkpoint-4 into a DCP checkpoint
    code, out, err = _cli("convert", src, "--to", "fsdp2", "-o", tmp_path / "dcp")
    assert code == 0, err
    assert "using checkpoint-4" in out and "wrote" in out and "exp_avg_sq" in out
    # the Trainer's own files are named as not carried, with where they stay (never silently)
    ckpt4 = src / "checkpoint-4"
    for name in ("trainer_state.json", "training_args.bin", "rng_state_0.pth", "rng_state_1.pth"):
        assert f"not carried: {name} (" in out, out
    assert f"the FSDP2/DCP checkpoint has no slot for it: it stays in {ckpt4})" in out
    assert (tmp_path / "dcp" / "latest").read_text() == "global_step4"


def test_verify_on_checkpoint_folders(runs):
    base = runs["base"]
    src, new = base / "src" / "checkpoint-2", base / "new" / "checkpoint-2"
    # the Trainer's own save: no manifest, so the structural check; saved by 2 ranks, refused for 3 (exit 1)
    code, out, _ = _cli("verify", src, "--json", "--world-size", "3")
    report = json.loads(out)
    assert code == 1 and "no digests" in report["digests"]
    by_rule = {f["rule"]: f for f in report["findings"]}
    assert "cannot repartition ZeRO state" in by_rule["ckpt.world_size.mismatch"]["message"]
    assert "no RNG state for rank(s) 2" in by_rule["ckpt.trainer.rng"]["message"]
    # the resharded one: complete, for 3 ranks, refused for 2 with the Trainer-shaped fix
    code, out, err = _cli("verify", new, "--world-size", "3")
    assert code == 0, out + err
    code, out, _ = _cli("verify", new, "--world-size", "2", "--json")
    findings = json.loads(out)["findings"]
    assert code == 1
    mismatch = next(f for f in findings if f["rule"] == "ckpt.world_size.mismatch")
    assert f"shardkit reshard {new} --world-size 2 -o NEW/checkpoint-2" in mismatch["fix"]


def test_output_folder_rules_and_atomicity(runs, tmp_path):
    base = runs["base"]
    src = base / "src" / "checkpoint-2"
    # -o the source itself, or a Trainer output_dir
    code, _, err = _cli("reshard", src, "--world-size", "3", "-o", src)
    assert code == 2 and f"is the checkpoint being read ({src})" in err
    code, _, err = _cli("reshard", src, "--world-size", "3", "-o", base / "resumed")
    assert code == 2 and "is a Trainer output_dir" in err and str(base / "resumed" / "checkpoint-2") in err
    # a non-empty folder of other files is never replaced
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    code, _, err = _cli("reshard", src, "--world-size", "3", "-o", other)
    assert code == 2 and "is not a Trainer checkpoint written by shardkit" in err
    assert (other / "notes.txt").read_text() == "mine"
    # a resharded one only with --force, and then whole
    out = tmp_path / "ws1" / "checkpoint-2"
    code, stdout, err = _cli("reshard", src, "--world-size", "1", "-o", out)
    assert code == 0, err
    assert sorted(p.name for p in out.glob("rng_state*")) == ["rng_state.pth"]
    assert (out / "rng_state.pth").read_bytes() == (src / "rng_state_0.pth").read_bytes()
    assert "rng_state_0.pth -> rng_state.pth" in stdout and "rng_state_1.pth" in stdout
    code, _, err = _cli("reshard", src, "--world-size", "3", "-o", out)
    assert code == 2 and "pass --force" in err
    code, _, err = _cli("reshard", src, "--world-size", "3", "-o", out, "--force")
    assert code == 0, err
    assert len(list((out / "global_step2").glob("*optim_states.pt"))) == 3
    assert not (out / "rng_state.pth").exists() and (out / "rng_state_1.pth").is_file()
    # the tag folder alone: a plain DeepSpeed reshard, with a warning naming the checkpoint-N to pass instead
    code, _, err = _cli("reshard", src / "global_step2", "--world-size", "3", "-o", tmp_path / "plain")
    assert code == 0 and f"Pass {src} to write a checkpoint-N" in err
    assert not (tmp_path / "plain" / "trainer_state.json").exists()
    # a tag the Trainer would not find
    code, _, err = _cli("reshard", src, "--world-size", "3", "-o", tmp_path / "t" / "checkpoint-2", "--tag", "mytag")
    assert code == 2 and "deepspeed_load_checkpoint" in err
    # a source that breaks mid-way (a truncated rank file; no manifest to catch it first) leaves nothing behind
    broken = tmp_path / "broken" / "checkpoint-2"
    shutil.copytree(src, broken)
    f = broken / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    target = tmp_path / "fromBroken" / "checkpoint-2"
    code, _, err = _cli("reshard", broken, "--world-size", "3", "-o", target)
    assert code == 1, err
    assert list(target.parent.iterdir()) == []


def test_trainer_folders_without_deepspeed_are_refused_by_name(runs, tmp_path):
    src = runs["base"] / "src" / "checkpoint-2"
    # a checkpoint-N whose DeepSpeed save is missing (save_only_model, or an interrupted save)
    no_ds = tmp_path / "out" / "checkpoint-2"
    shutil.copytree(src, no_ds, ignore=shutil.ignore_patterns("global_step*", "latest"))
    for argv in (["reshard", no_ds, "--world-size", "3", "-o", tmp_path / "x"],
                 ["consolidate", no_ds, "-o", tmp_path / "x.safetensors"],
                 ["convert", no_ds, "--to", "fsdp2", "-o", tmp_path / "x"]):
        code, _, err = _cli(*argv)
        assert code == 1 and f"{no_ds}: a Hugging Face Trainer checkpoint without a DeepSpeed checkpoint" in err
        assert "save_only_model" in err
    code, out, _ = _cli("verify", no_ds, "--json")
    (finding,) = json.loads(out)["findings"]
    assert code == 1 and finding["rule"] == "ckpt.trainer.no_deepspeed"
    assert finding["message"].startswith(f"{no_ds}: a Hugging Face Trainer checkpoint without a DeepSpeed checkpoint")
    # the output_dir holding it: the newest checkpoint is named
    shutil.copytree(src, no_ds.parent / "checkpoint-1")  # an older complete one is named, not silently used
    code, _, err = _cli("consolidate", no_ds.parent, "-o", tmp_path / "y.safetensors")
    assert code == 1 and f"the newest checkpoint of the output_dir {no_ds.parent}" in err
    assert "Older checkpoints there: checkpoint-1" in err
    # a DDP/one-process checkpoint (optimizer.pt + model.safetensors, as the Trainer writes without DeepSpeed)
    (no_ds / "optimizer.pt").write_bytes(b"")
    (no_ds / "model.safetensors").write_bytes(b"")
    code, _, err = _cli("reshard", no_ds, "--world-size", "3", "-o", tmp_path / "z")
    assert code == 1 and "saved without DeepSpeed" in err and "nothing to reshard" in err
    # an output_dir without any checkpoint-N
    empty_run = tmp_path / "run"
    empty_run.mkdir()
    shutil.copy2(src / "training_args.bin", empty_run / "training_args.bin")
    code, _, err = _cli("reshard", empty_run, "--world-size", "3", "-o", tmp_path / "w")
    assert code == 1 and f"{empty_run}: looks like a Hugging Face Trainer output_dir" in err
    assert "holds no checkpoint-N folder" in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "z").exists()


@pytest.mark.parametrize(
    ("names", "world", "copies", "dropped", "absent"),
    [
        (["rng_state_0.pth", "rng_state_1.pth"], 3, [("rng_state_0.pth", "rng_state_0.pth"),
                                                     ("rng_state_1.pth", "rng_state_1.pth")], [], [2]),
        (["rng_state_0.pth", "rng_state_1.pth", "rng_state_2.pth"], 2,
         [("rng_state_0.pth", "rng_state_0.pth"), ("rng_state_1.pth", "rng_state_1.pth")], ["rng_state_2.pth"], []),
        (["rng_state_0.pth", "rng_state_1.pth"], 1, [("rng_state_0.pth", "rng_state.pth")], ["rng_state_1.pth"], []),
        (["rng_state.pth", "trainer_state.json"], 2, [("rng_state.pth", "rng_state_0.pth")], [], [1]),
        (["trainer_state.json"], 2, [], [], []),  # saved without RNG files: nothing to say per rank
    ],
)
def test_rng_plan(names, world, copies, dropped, absent):
    plan = plan_rng_files(names, world)
    assert list(plan.copies) == copies and list(plan.dropped) == dropped and list(plan.absent) == absent
    notes = " ".join(plan.notes(world))
    for name in dropped:
        assert name in notes
    if absent:
        assert f"no RNG state for rank(s) {', '.join(map(str, absent))}" in notes


def test_a_stray_one_process_rng_file_gets_its_own_note():
    # rng_state.pth beside per-rank files (a 1-process run saved into the same folder): its "rank"
    # is not beyond the new world size, so the dropped-rank reason would be false
    plan = plan_rng_files(["rng_state.pth", "rng_state_0.pth", "rng_state_1.pth"], 2)
    assert plan.dropped == () and plan.stray == ("rng_state.pth",) and plan.absent == ()
    notes = plan.notes(2)
    assert not any("RNG state dropped" in n for n in notes)
    assert any(n.startswith("RNG state not carried: rng_state.pth (the one-process RNG file, which only a 1-process "
                            "run reads") for n in notes), notes


def test_staging_folders_of_killed_reshards_are_removed_and_live_ones_kept(tmp_path):
    from shardkit.storage.sibling_staging import remove_stale_staging
    from shardkit.storage.sibling_staging import staging_folder as _staging_folder

    final = tmp_path / "run" / "checkpoint-2"
    final.parent.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid is no longer running
    host = socket.gethostname()
    names = {
        "killed": f".shardkit-tmp-checkpoint-2-{gone.pid}@{host}-deadbeef",
        "running": _staging_folder(final).name,  # this process: alive
        "other_host": f".shardkit-tmp-checkpoint-2-{gone.pid}@not-{host}-deadbeef",
        "other_name": f".shardkit-tmp-checkpoint-20-{gone.pid}@{host}-deadbeef",
        "no_owner": ".shardkit-tmp-checkpoint-2-deadbeef",
    }
    for n in names.values():
        (final.parent / n).mkdir()
        (final.parent / n / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * 10)
    assert remove_stale_staging(final) == [names["killed"]]
    assert sorted(p.name for p in final.parent.iterdir()) == sorted(v for k, v in names.items() if k != "killed")


def test_a_no_manifest_trainer_checkpoint_is_not_replaced_even_with_force(tmp_path):
    from shardkit.checkpoint.ops.reshard_trainer import check_output_folder
    from shardkit.core.errors import UsageError

    src, out = tmp_path / "src" / "checkpoint-2", tmp_path / "new" / "checkpoint-2"
    for d in (src, out):
        (d / "global_step2").mkdir(parents=True)
        (d / "trainer_state.json").write_text("{}")
        (d / "latest").write_text("global_step2")
    with pytest.raises(UsageError, match=r"holds a Trainer checkpoint without a shardkit manifest \(trainer_state.json "
                                         r"and 'latest', no <tag>/shardkit_manifest.json\): a Trainer's own save or a "
                                         r"reshard written with --no-manifest\..* never replaced, even with --force"):
        check_output_folder(out, src, force=True)
    assert (out / "trainer_state.json").is_file()


def test_convert_names_every_trainer_file_it_leaves_behind(tmp_path):
    from shardkit.checkpoint.hf_trainer.folder import trainer_files_not_converted

    ckpt = tmp_path / "checkpoint-4"
    (ckpt / "global_step4").mkdir(parents=True)
    (ckpt / "global_step2").mkdir()  # a tag 'latest' does not name: not converted either, so named
    (ckpt / "latest").write_text("global_step4")
    for name in ("trainer_state.json", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth",
                 "training_args.bin", "config.json"):
        (ckpt / name).write_text("x")
    lines = trainer_files_not_converted(ckpt)
    assert [line.split(" (")[0] for line in lines] == ["config.json", "global_step2/", "rng_state_0.pth",
                                                      "rng_state_1.pth", "scheduler.pt", "trainer_state.json",
                                                      "training_args.bin"]
    assert all(line.endswith(f"the FSDP2/DCP checkpoint has no slot for it: it stays in {ckpt})") for line in lines)
    assert "scheduler.pt (the Trainer's LR scheduler state;" in lines[4]
    assert "global_step2/ (a DeepSpeed tag 'latest' does not name, never loaded;" in lines[1]


# --- FSDP Trainer checkpoints: the files accelerate 1.15 really writes -----------------------------

FSDP_LAYOUTS = {  # label: (FSDP version, fsdp_state_dict_type, use_dcp)
    "fsdp1_sharded": (1, "SHARDED_STATE_DICT", True),
    "fsdp1_local": (1, "LOCAL_STATE_DICT", True),
    "fsdp2_sharded": (2, "SHARDED_STATE_DICT", True),
    "fsdp2_full": (2, "FULL_STATE_DICT", True),
    "fsdp2_sharded_per_rank": (2, "SHARDED_STATE_DICT", False),
}


def save_fsdp_layouts(base: str) -> dict[str, list[str]]:
    """Rank target: a small model under real FSDP1 (``FullyShardedDataParallel``) and FSDP2
    (``fully_shard``), one AdamW step, saved into ``base/<label>/checkpoint-2`` by accelerate's own
    ``save_fsdp_model``/``save_fsdp_optimizer`` as ``Trainer._save_optimizer_and_scheduler`` calls
    them. The accelerator argument is accelerate's ``PartialState`` over this process group (its
    ``Accelerator`` refuses FSDP without a GPU; the save functions read only the process count and
    index from it). Returns each folder's listing."""
    import torch.distributed as dist
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin, save_fsdp_model, save_fsdp_optimizer

    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()),
                      LOCAL_RANK=str(dist.get_rank()), LOCAL_WORLD_SIZE=str(dist.get_world_size()))
    state = PartialState(cpu=True)
    assert (state.num_processes, state.process_index) == (dist.get_world_size(), dist.get_rank())
    out = {}
    for label, (version, kind, use_dcp) in FSDP_LAYOUTS.items():
        plugin = FullyShardedDataParallelPlugin(fsdp_version=version, state_dict_type=kind, cpu_ram_efficient_loading=False)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
        if version == 1:
            from torch.distributed.fsdp import FullyShardedDataParallel

            model = FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))
        else:
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
        folder = Path(base) / label / "checkpoint-2"
        save_fsdp_model(plugin, state, model, str(folder), use_dcp=use_dcp)
        save_fsdp_optimizer(plugin, state, opt, model, str(folder), use_dcp=use_dcp)
        dist.barrier()
        out[label] = sorted(e.name + ("/" if e.is_dir() else "") for e in folder.iterdir())
    return out


@pytest.fixture(scope="module")
def fsdp_checkpoints(tmp_path_factory) -> tuple[Path, dict[str, list[str]]]:
    from shardkit.run.spawn.process import run_ranks

    base = tmp_path_factory.mktemp("fsdp_trainer")
    listing = run_ranks(save_fsdp_layouts, 2, args=(str(base),), timeout=300, device="cpu")[0].value
    return base, listing


FSDP_SAID = {
    "fsdp1_sharded": (["optimizer_0/", "pytorch_model_fsdp_0/"], [
        "fsdp_state_dict_type SHARDED_STATE_DICT (model: pytorch_model_fsdp_0/; optimizer: optimizer_0/; written by "
        "2 rank(s)): torch.distributed.checkpoint folders, the same layout under FSDP1 and FSDP2",
        "The Trainer resumes it at any world size as it is (DCP reshards while loading)"]),
    "fsdp2_sharded": (["optimizer_0/", "pytorch_model_fsdp_0/"], [
        "fsdp_state_dict_type SHARDED_STATE_DICT (model: pytorch_model_fsdp_0/; optimizer: optimizer_0/; written by "
        "2 rank(s))", "nothing to reshard"]),
    "fsdp2_full": (["optimizer.bin", "pytorch_model_fsdp.bin"], [
        "fsdp_state_dict_type FULL_STATE_DICT (model: pytorch_model_fsdp.bin; optimizer: optimizer.bin)",
        "the whole, unsharded optimizer state, saved by rank 0", "pytorch_model_fsdp.bin already hold the full weights"]),
    "fsdp1_local": (["optimizer_0/", "pytorch_model_fsdp_rank0.bin", "pytorch_model_fsdp_rank1.bin"], [
        "fsdp_state_dict_type LOCAL_STATE_DICT (model: pytorch_model_fsdp_rank0.bin, pytorch_model_fsdp_rank1.bin; "
        "optimizer: optimizer_0/; written by 2 rank(s))", "which only 2 ranks can load", "Resume with 2 ranks"]),
    "fsdp2_sharded_per_rank": (["optimizer_0_rank0.bin", "optimizer_0_rank1.bin", "pytorch_model_fsdp_0_rank0.bin",
                                "pytorch_model_fsdp_0_rank1.bin"], [
        "fsdp_state_dict_type SHARDED_STATE_DICT (use_dcp=False)", "which only 2 ranks can load",
        "save again with fsdp_state_dict_type SHARDED_STATE_DICT"]),
}


@pytest.mark.parametrize("label", sorted(FSDP_LAYOUTS))
def test_fsdp_trainer_checkpoints_are_refused_saying_what_accelerate_wrote(fsdp_checkpoints, tmp_path, label):
    base, listing = fsdp_checkpoints
    files, said = FSDP_SAID[label]
    assert listing[label] == files  # what accelerate 1.15 writes, as the refusal describes it
    ckpt = base / label / "checkpoint-2"
    refused = [["reshard", ckpt, "--world-size", "3", "-o", tmp_path / "x"]]
    if label == "fsdp1_local":  # no reader (readers.fsdp1 and fsdp1_bins take the rest)
        refused += [["consolidate", ckpt, "-o", tmp_path / "x.safetensors"], ["convert", ckpt, "--to", "fsdp2", "-o", tmp_path / "y"]]
    for argv in refused:
        code, _, err = _cli(*argv)
        assert code == 1 and f"{ckpt}: a Hugging Face Trainer checkpoint without a DeepSpeed checkpoint" in err, err
        for phrase in said:
            assert phrase in err, (phrase, err)
        assert "accelerate's FSDP files" in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
