"""A SIGTERM (raised by the CLI as an exception, ``cli.Terminated``) or a Ctrl-C landing at any step of a
write leaves either the old output or the new one, complete, and no staging folder or temporary behind.

Each test makes the signal arrive at one exact step: a stand-in for the step does the step's work, then
sends the signal to this thread (``signal.raise_signal``: delivered at once, its Python handler runs at the
next bytecode), as a real signal landing just after the system call returned would. No timing involved.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

import shardkit.storage.atomic as atomic
from shardkit.storage.atomic import publish_dir


@pytest.fixture
def sigterm_raises():
    """SIGTERM handled as the CLI handles it: ``Terminated`` raised in the main thread."""
    from shardkit.cli import Terminated

    def handler(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    yield Terminated
    signal.signal(signal.SIGTERM, previous)


def _sigterm_on_removal(monkeypatch, prefix: str) -> None:
    """Every ``shutil.rmtree`` of a folder named ``prefix...`` first meets a fresh SIGTERM (a scheduler
    repeating its cancel): a clean-up not run with signals held is cut short before removing anything."""
    real_rmtree = shutil.rmtree

    def sigterm_then_rmtree(path, *args, **kwargs):
        if Path(path).name.startswith(prefix):
            signal.raise_signal(signal.SIGTERM)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", sigterm_then_rmtree)


def _folder(path: Path, content: str) -> Path:
    path.mkdir()
    (path / "model.safetensors").write_text(content)
    return path


def test_sigterm_between_the_two_renames_of_a_forced_publish_keeps_a_complete_output(tmp_path, monkeypatch,
                                                                                     sigterm_raises):
    # export --force / reshard --force: the old output was renamed aside, the new one not yet in place,
    # when SIGTERM came; the caller then removed its staging folder: the output was gone, the old one
    # left under a .shardkit-tmp-old-* name nothing removes or restores
    final = _folder(tmp_path / "out", "old")
    staged = _folder(tmp_path / ".shardkit-tmp-out-1@host-0000abcd", "new")
    real_rename, calls = atomic._rename, []

    def rename_then_sigterm(src, dst):
        real_rename(src, dst)
        calls.append(dst)
        if len(calls) == 1:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(atomic, "_rename", rename_then_sigterm)
    with pytest.raises(sigterm_raises):
        try:
            publish_dir(staged, final)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)  # what export_hf and reshard_trainer do on any failure
            raise
    assert os.listdir(tmp_path) == ["out"]
    assert (final / "model.safetensors").read_text() == "new"  # the signal waited for the swap to finish


def test_a_failed_rename_into_place_puts_the_old_output_back(tmp_path, monkeypatch):
    final = _folder(tmp_path / "out", "old")
    staged = _folder(tmp_path / ".shardkit-tmp-out-1@host-0000abcd", "new")
    real_rename, calls = atomic._rename, []

    def second_fails(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_rename(src, dst)

    monkeypatch.setattr(atomic, "_rename", second_fails)
    with pytest.raises(OSError, match="No space left"):
        publish_dir(staged, final)
    assert sorted(os.listdir(tmp_path)) == [".shardkit-tmp-out-1@host-0000abcd", "out"]
    assert (final / "model.safetensors").read_text() == "old"


def test_a_signal_landing_while_the_handlers_are_swapped_is_deferred_and_no_handler_is_left_swapped(
        monkeypatch, sigterm_raises):
    # signals_deferred installs its handler for SIGINT, then SIGTERM: a SIGTERM between the two ran the
    # CLI's handler, whose exception escaped the swap with SIGINT's handler left recording (Ctrl-C ignored)
    from shardkit.storage.atomic import signals_deferred

    real_signal, swaps = signal.signal, []

    def swap_then_sigterm(sig, handler):
        previous = real_signal(sig, handler)
        swaps.append(sig)
        if len(swaps) == 1:
            signal.raise_signal(signal.SIGTERM)
        return previous

    int_before, term_before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    steps = []
    monkeypatch.setattr(signal, "signal", swap_then_sigterm)
    with pytest.raises(sigterm_raises):
        with signals_deferred():
            monkeypatch.setattr(signal, "signal", real_signal)  # only the first swap is watched
            steps.append("clean-up finished")
    assert steps == ["clean-up finished"]
    assert signal.getsignal(signal.SIGINT) is int_before and signal.getsignal(signal.SIGTERM) is term_before


def _linear_and_adam(seed: int):
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("after", ["link_copy", "rename_aside"])
def test_sigterm_while_a_tag_is_saved_again_leaves_the_old_or_the_new_save_whole(tmp_path, monkeypatch,
                                                                                 sigterm_raises, after):
    # link_copy: stopped while the old tag was copied aside (hard links): the partial copy stayed;
    # rename_aside: stopped between renaming the old tag aside and the new one into place: the tag was
    # missing, 'latest' named the copy, and the staging folder was removed
    from shardkit.checkpoint.ops.torch_training import resume_training, save_training

    root = tmp_path / "root"
    model, opt = _linear_and_adam(0)
    save_training(root, model=model, optimizer=opt, step=1, tag="ckpt")
    if after == "link_copy":
        real_copy = atomic._link_copy

        def copy_then_sigterm(src, dst):
            real_copy(src, dst)
            signal.raise_signal(signal.SIGTERM)

        monkeypatch.setattr(atomic, "_link_copy", copy_then_sigterm)
    else:
        real_rename = atomic._rename

        def rename_then_sigterm(src, dst):
            real_rename(src, dst)
            if Path(src).name == "ckpt":
                signal.raise_signal(signal.SIGTERM)

        monkeypatch.setattr(atomic, "_rename", rename_then_sigterm)
    with pytest.raises(sigterm_raises):
        save_training(root, model=model, optimizer=opt, step=2, tag="ckpt")
    assert sorted(os.listdir(root)) == ["ckpt", "latest"]
    assert (root / "latest").read_text() == "ckpt"
    # stopped before the swap: the old save; once the swap began, the signal waited for it to finish
    assert resume_training(root, model=_linear_and_adam(1)[0]).step == (1 if after == "link_copy" else 2)


def test_sigterm_as_the_claim_of_a_save_returns_leaves_no_staging_folder(tmp_path, monkeypatch, sigterm_raises):
    # the claim (staging folder + owner file) was made before the try whose clean-up removes it, and
    # the clean-up only knew it once ``claimed`` was set: a signal in between left .shardkit-tmp-ckpt
    import shardkit.storage.staged_save as staged_save
    from shardkit.checkpoint.ops.torch_training import resume_training, save_training

    root = tmp_path / "root"
    model, opt = _linear_and_adam(0)
    save_training(root, model=model, optimizer=opt, step=1, tag="ckpt")
    real_claim = staged_save.claim

    def claim_then_sigterm(*args, **kwargs):
        staged = real_claim(*args, **kwargs)
        signal.raise_signal(signal.SIGTERM)
        return staged

    monkeypatch.setattr(staged_save, "claim", claim_then_sigterm)
    with pytest.raises(sigterm_raises):
        save_training(root, model=model, optimizer=opt, step=2, tag="ckpt")
    assert sorted(os.listdir(root)) == ["ckpt", "latest"]
    assert resume_training(root, model=_linear_and_adam(1)[0]).step == 1


def test_repeated_sigterms_during_a_save_clean_up_still_remove_the_staging_folder(tmp_path, monkeypatch,
                                                                                  sigterm_raises):
    # a scheduler repeating its cancel: every removal of the staging folder met a fresh SIGTERM, whose
    # exception cut it short before anything was removed
    from shardkit.storage.staged_save import atomic_checkpoint

    root = tmp_path / "root"
    _sigterm_on_removal(monkeypatch, ".shardkit-tmp-ckpt")
    with pytest.raises(sigterm_raises):
        with atomic_checkpoint(root, "ckpt", engine="torch", manifest=False) as save:
            (save.path / "model.pt").write_bytes(b"partial")
            signal.raise_signal(signal.SIGTERM)
    monkeypatch.undo()
    assert os.listdir(root) == []


def test_sigterms_during_a_claim_and_its_removal_leave_no_staging_folder(tmp_path, monkeypatch, sigterm_raises):
    # stopped while the claim swept the root's leftovers, then again while it removed its own claim
    import shardkit.storage.shared_save as shared_save
    from shardkit.storage.shared_save import claim, launch_from_env

    def sweep_stopped(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)

    root = tmp_path / "root"
    monkeypatch.setattr(shared_save, "remove_stale_saves", sweep_stopped)
    _sigterm_on_removal(monkeypatch, ".shardkit-tmp-ckpt")
    with pytest.raises(sigterm_raises):
        claim(root, "ckpt", launch_from_env({}, single=True))
    monkeypatch.undo()
    assert os.listdir(root) == []


def test_repeated_sigterms_while_a_trainer_reshard_is_removed_leave_no_staging_folder(tmp_path, monkeypatch,
                                                                                     sigterm_raises):
    # the reshard of checkpoint-N is stopped, and the removal of its model-sized staging folder beside
    # the output met a second SIGTERM: the folder stayed (only a later run on this host removes it)
    import shardkit.checkpoint.ops.reshard_trainer as reshard_trainer
    from shardkit.checkpoint.hf_trainer.folder import TrainerCheckpoint

    src = tmp_path / "run" / "checkpoint-2"
    (src / "global_step2").mkdir(parents=True)
    (src / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"")
    (src / "latest").write_text("global_step2")
    (src / "trainer_state.json").write_text("{}")

    def reshard_stopped(source, staged, *args, **kwargs):
        (staged / "global_step2").mkdir(parents=True)
        (staged / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"partial")
        signal.raise_signal(signal.SIGTERM)

    out = tmp_path / "new" / "checkpoint-2"
    monkeypatch.setattr(reshard_trainer, "reshard_checkpoint", reshard_stopped)
    _sigterm_on_removal(monkeypatch, ".shardkit-tmp-checkpoint-2-")
    with pytest.raises(sigterm_raises):
        reshard_trainer.reshard_trainer_checkpoint(TrainerCheckpoint(src), out, 2)
    monkeypatch.undo()
    assert os.listdir(out.parent) == []


def test_sigterm_while_the_json_result_file_is_written_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch,
                                                                                            sigterm_raises):
    # --json-file wrote PATH.tmp-<pid> outside any try: a SIGTERM before the rename left it behind
    import argparse

    from shardkit.commands._parser import emit_json

    target = tmp_path / "result.json"
    target.write_text('{"old": true}\n')

    def sigterm_instead_of_rename(src, dst):
        signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(os, "replace", sigterm_instead_of_rename)
    with pytest.raises(sigterm_raises):
        emit_json(argparse.Namespace(json=False, json_file=str(target)), {"new": True})
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["result.json"]
    assert target.read_text() == '{"old": true}\n'


def test_repeated_sigterms_while_a_universal_write_is_removed_leave_no_staging_folder(tmp_path, monkeypatch,
                                                                                     sigterm_raises):
    import shardkit.checkpoint.writers.universal as universal

    def write_stopped(ckpt, staged, *args):
        (staged / "zero" / "w").mkdir(parents=True)
        (staged / "zero" / "w" / "fp32.pt").write_bytes(b"partial")
        signal.raise_signal(signal.SIGTERM)

    class Model:
        trainable: list[str] = []

    root = tmp_path / "universal"
    monkeypatch.setattr(universal, "universal_state_keys", lambda ckpt: [])
    monkeypatch.setattr(universal, "_write", write_stopped)
    _sigterm_on_removal(monkeypatch, ".shardkit-tmp-global_step2")
    with pytest.raises(sigterm_raises):
        universal.write_universal(Model(), root, "global_step2")
    monkeypatch.undo()
    assert os.listdir(root) == []


def test_sigterm_as_the_heartbeat_starts_stops_the_heartbeat(tmp_path, monkeypatch, sigterm_raises):
    # the heartbeat thread was started before the try whose finally stops it: a signal in between left
    # it writing .shardkit-alive-0 into the staging folder while the run's clean-up removed the folder
    import threading

    import shardkit.storage.shared_save as shared_save

    def watch_stopped(counts):
        signal.raise_signal(signal.SIGTERM)

    staged = tmp_path / ".shardkit-tmp-ckpt"
    staged.mkdir()
    monkeypatch.setattr(shared_save.progress, "watch_peers", watch_stopped)
    before = set(threading.enumerate())
    with pytest.raises(sigterm_raises):
        with shared_save.heartbeat(staged, 0):
            pass
    assert [t for t in set(threading.enumerate()) - before if t.name == "shardkit-heartbeat"] == []


@pytest.mark.slow
def test_a_signal_held_until_the_output_is_in_place_is_reported_as_after_publishing(
        sweep_sources, tmp_path, run_cli, monkeypatch):
    # a SIGTERM that lands while consolidate renames its file into place is held until the rename is
    # done: the output is then complete, and the CLI must not say "nothing was published"
    record = atomic.note_published

    def record_then_sigterm(path):
        record(path)
        signal.raise_signal(signal.SIGTERM)  # held by the switch's signals_deferred, delivered after it

    monkeypatch.setattr(atomic, "note_published", record_then_sigterm)
    out = tmp_path / "out" / "model.safetensors"
    previous = signal.getsignal(signal.SIGTERM)
    try:
        code, _, err = run_cli("consolidate", sweep_sources.root("fsdp2"), "-o", out)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 143, err
    assert (f"terminated (SIGTERM); it came after {out} was put in place: that output is complete (nothing need "
            "be run again for it)") in err, err
    assert "nothing was published" not in err and "Traceback" not in err
    from safetensors import safe_open

    with safe_open(str(out), "pt") as f:
        assert len(list(f.keys())) > 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.safetensors"]


def test_publish_dir_records_the_output_it_put_in_place(tmp_path):
    atomic.forget_published()
    staged = _folder(tmp_path / ".staging", "new")
    publish_dir(staged, tmp_path / "final")
    assert atomic.published_outputs() == [tmp_path / "final"]
    atomic.forget_published()
