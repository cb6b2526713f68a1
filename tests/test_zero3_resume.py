"""Resuming a 2-rank ZeRO-3 run at 1 and 3 ranks on real DeepSpeed engines (CPU, gloo).

One fp32 run saves at 2 ranks after SAVE_STEPS steps. Then, per new world size, one spawn runs:
the uninterrupted reference, DeepSpeed's own load of the 2-rank checkpoint (refused), DeepSpeed's
plain ``engine.load_checkpoint`` of the ``shardkit reshard`` output, and shardkit's in-process
``load_checkpoint_resharded`` straight from the 2-rank checkpoint, with offload_optimizer switched on
or off relative to the save. Every global batch is the same at any world size, so the resumed loss
curve must follow the uninterrupted one; fp32 masters and Adam moments must be bit-exact.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from tests import _ranks_zero3 as R
from tests._corrupt import flip_a_byte

pytestmark = pytest.mark.slow
WORLDS = [1, 3]
MODES = ["plain", "shardkit"]


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    return R.build_resumed(tmp_path_factory.getbasetemp() / "zero3")


def _full_states(source: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Oracle: full fp32 masters from DeepSpeed's zero_to_fp32, moments by a plain concatenation."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from tests.test_zero3_reader import _independent_gather

    tag_dir = source / (source / "latest").read_text().strip()
    return {
        "fp32": get_fp32_state_dict_from_zero_checkpoint(str(source)),
        "exp_avg": _independent_gather(tag_dir, "exp_avg"),
        "exp_avg_sq": _independent_gather(tag_dir, "exp_avg_sq"),
    }


def _expected_partition(full: dict[str, torch.Tensor], world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s flat partition at ``world`` ranks (one sub-group: DeepSpeed's default size)."""
    pieces = []
    for t in full.values():
        flat = t.reshape(-1)
        part = math.ceil(flat.numel() / world)
        padded = torch.zeros(part * world, dtype=flat.dtype)
        padded[: flat.numel()] = flat
        pieces.append(padded[rank * part : (rank + 1) * part])
    return torch.cat(pieces)


@pytest.mark.parametrize("world", WORLDS)
def test_deepspeed_alone_refuses_another_world_size(runs, world):
    msg = runs[world]["ranks"][0]["refuse"]
    assert "used a DP world size of 2" in msg and f"current world size is {world}" in msg
    assert "not currently supported" in msg


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", WORLDS)
def test_loss_curve_continues_like_an_uninterrupted_run(runs, world, mode):
    ranks = runs[world]["ranks"]
    reference = ranks[0]["reference"]["losses"]
    resumed = ranks[0][mode]["losses"]
    assert len(resumed) == R.RESUME_STEPS
    # saved losses of the 2-rank run match the reference's first steps, too
    assert reference[: R.SAVE_STEPS] == pytest.approx(runs["sources"]["fp32_losses"], rel=1e-5)
    assert resumed == pytest.approx(reference[R.SAVE_STEPS :], rel=1e-5, abs=1e-6)
    assert all(r[mode]["losses"] == resumed for r in ranks)  # the global loss every rank reports
    assert ranks[0][mode]["global_steps"] == R.SAVE_STEPS


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", WORLDS)
def test_fp32_masters_and_moments_are_bit_exact(runs, world, mode):
    full = _full_states(Path(runs["sources"]["fp32"]))
    for rank, result in enumerate(runs[world]["ranks"]):
        got = result[mode]
        assert len(got["fp32"]) == 1 and got["step"] == [float(R.SAVE_STEPS)]
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            expected = _expected_partition(full[key], world, rank)
            assert torch.equal(got[key][0], expected), (world, mode, rank, key)


def test_offload_switched_between_save_and_resume(runs):
    # saved by FusedAdam without offload; resumed with offload_optimizer -> DeepSpeedCPUAdam
    assert runs[3]["ranks"][0]["shardkit"]["optimizer"] == "DeepSpeedCPUAdam"
    assert runs[1]["ranks"][0]["plain"]["optimizer"] == "DeepSpeedCPUAdam"
    assert runs[3]["ranks"][0]["plain"]["optimizer"] == "FusedAdam"
    for world in WORLDS:
        for r in runs[world]["ranks"]:
            assert r["shardkit"]["devices"] == ["cpu"] and r["shardkit"]["placement_checked"] is True
            assert r["shardkit"]["saved_world_size"] == 2


def test_bf16_offload_checkpoint_with_several_sub_groups_resumes_without_offload(runs):
    source = Path(runs["sources"]["bf16_offload"])
    full = _full_states(source)
    for rank, got in enumerate(runs["bf16_offload_off"]):  # its own 3-rank spawn
        assert got["optimizer"] == "FusedAdam" and got["step"] == [1.0]
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[key][0], _expected_partition(full[key], 3, rank)), (rank, key)


def test_checkpoint_saved_at_three_ranks_reads_and_reshards(runs, tmp_path, run_cli):
    """The resumed 3-rank engine's own save: odd partitions with padding, read like zero_to_fp32."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    saved = runs[3]["saved"]
    code, _, err = run_cli("consolidate", saved, "-o", tmp_path / "a.safetensors")
    assert code == 0, err
    save_file(get_fp32_state_dict_from_zero_checkpoint(str(saved)), tmp_path / "b.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    code, _, err = run_cli("reshard", saved, "--world-size", "2", "-o", tmp_path / "ws2")
    assert code == 0, err
    full, back = _full_states(Path(saved)), _full_states(tmp_path / "ws2")
    for key in full:
        for name in full[key]:
            assert torch.equal(full[key][name], back[key][name]), (key, name)


def test_corrupted_optim_file_of_the_right_size_is_refused_on_every_rank(tmp_path, tmp_path_factory):
    """One flipped byte (same size) in a rank's optim file: each rank hashes its share of the
    files, and both ranks raise the same error naming the file (no rank waits alone)."""
    from shardkit.checkpoint.ops.reshard import reshard_checkpoint
    from shardkit.run.spawn.process import run_ranks

    sources = R.build_sources(tmp_path_factory.getbasetemp() / "zero3")
    out = tmp_path / "ws2"
    reshard_checkpoint(sources["fp32"], out, 2)  # a 2-rank checkpoint with a shardkit manifest
    bad = next((out / "global_step2").glob("*zero_pp_rank_1_*optim_states.pt"))
    flip_a_byte(bad)
    msgs = [r.value for r in run_ranks(R.load_refused, 2, args=(str(out), "fp32"), timeout=300, device="cpu")]
    assert msgs[0] == msgs[1], msgs
    assert re.match(rf"CheckpointError: cannot resume from .*\[{re.escape(bad.name)}\] .*{re.escape(bad.name)}: "
                    r"content differs from the manifest \(blake3 mismatch\)", msgs[0]), msgs[0]


# --- DeepSpeed's CPU Adam kernels keep beta**step outside the checkpoint ------------------------
#
# Saved after 2 steps, the first resumed step is optimizer step 3, where float32 0.999**3 built by
# multiplication (one process) and by pow (a new process) differ in the last bit. Every tensor
# DeepSpeed saves is restored bit for bit either way; the fp32 masters after that step are equal
# only when the kernel's step state is replayed. Fresh processes for the resumed side: the CPU
# FusedAdam kernel object is one per process.

KERNEL_SAVE_AT = 2
KERNEL_CASES = [("fused_adam", "bf16", False), ("cpu_adam", "bf16", True)]  # (label, dtype, offload_optimizer)


def _fp32_masters(engine) -> list[torch.Tensor]:
    return [f.detach().cpu().clone() for f in engine.optimizer.fp32_partitioned_groups_flat]


def kernel_train_save_continue(base: str) -> dict:
    """Rank target: per case, KERNEL_SAVE_AT steps, save, one more step; the masters after it."""
    import gc

    from shardkit.checkpoint.ops.save_zero3 import save_deepspeed_checkpoint

    out = {}
    for label, dtype, offload in KERNEL_CASES:
        engine = R._build(dtype, offload)
        for s in range(KERNEL_SAVE_AT):
            R._global_step(engine, s)
        save_deepspeed_checkpoint(engine, f"{base}/{label}", f"step{KERNEL_SAVE_AT}")
        R._global_step(engine, KERNEL_SAVE_AT)
        out[label] = _fp32_masters(engine)
        del engine
        gc.collect()
    return out


def kernel_resume_one_step(base: str) -> dict:
    """Rank target in fresh processes: per case, DeepSpeed's plain load (first, while the kernel
    object is fresh), shardkit's loader, plain load + restore_cpu_adam_kernel_state; one step each."""
    import gc
    import warnings

    import torch.distributed as dist

    from shardkit.checkpoint.ops.cpu_adam_kernel import restore_cpu_adam_kernel_state
    from shardkit.checkpoint.ops.resume_zero3 import (
        guard_plain_loads,
        load_checkpoint_resharded,
        restore_after_plain_load,
    )
    from shardkit.core.errors import CheckpointError
    from shardkit.engines.deepspeed import initialize
    from shardkit.engines.model_factory import tiny_llama

    out: dict = {}
    for label, dtype, offload in KERNEL_CASES:
        for mode in ("plain", "shardkit", "plain+restore", "plain+guard"):
            engine = R._build(dtype, offload)
            if mode == "shardkit":
                replays = load_checkpoint_resharded(engine, f"{base}/{label}", preflight=False).kernel_replays
            elif mode == "plain+guard":
                # the user's own plain load_checkpoint call, nothing by hand afterwards
                path, _ = guard_plain_loads(engine).load_checkpoint(f"{base}/{label}")
                assert path is not None
                replays = engine.shardkit_kernel_replays
            else:
                path, _ = engine.load_checkpoint(f"{base}/{label}")
                assert path is not None
                replays = restore_cpu_adam_kernel_state(engine) if mode == "plain+restore" else []
            R._global_step(engine, KERNEL_SAVE_AT)
            out[(label, mode)] = {
                "masters": _fp32_masters(engine),
                "replays": [(r.kernel.split(" opt_id")[0], r.step, r.calls) for r in replays],
                "optimizer": type(engine.optimizer.optimizer).__name__,
            }
            del engine
            gc.collect()
    # the bf16 checkpoint (bf16_zero_pp_rank_* files) resumed by an fp32 engine
    bf16_ckpt = f"{base}/{KERNEL_CASES[0][0]}"
    try:
        guard_plain_loads(R._build("fp32", False)).load_checkpoint(bf16_ckpt)
        out["fp32_engine_guarded"] = "loaded"
    except CheckpointError as exc:
        out["fp32_engine_guarded"] = str(exc)
    gc.collect()
    try:  # DeepSpeed alone: what the guard spares the user
        R._build("fp32", False).load_checkpoint(bf16_ckpt)
        out["fp32_engine_deepspeed"] = "loaded"
    except Exception as exc:
        out["fp32_engine_deepspeed"] = f"{type(exc).__name__}: {exc}"
    gc.collect()
    out["fp32_engine_shardkit_notes"] = load_checkpoint_resharded(R._build("fp32", False), bf16_ckpt, preflight=False).notes
    gc.collect()
    # a copy whose rank-1 optim file is a link to the same bytes outside the tag folder
    linked = f"{base}/linked"
    if dist.get_rank() == 0:
        import shutil
        from pathlib import Path

        shutil.copytree(bf16_ckpt, linked)
        tag_dir = Path(linked) / f"step{KERNEL_SAVE_AT}"
        victim = tag_dir / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
        shutil.move(victim, Path(base) / "outside.pt")
        victim.symlink_to(Path(base) / "outside.pt")
    dist.barrier()
    for how in ("guarded", "shardkit"):
        engine = R._build("bf16", False)
        try:
            if how == "guarded":
                guard_plain_loads(engine).load_checkpoint(linked)
            else:
                load_checkpoint_resharded(engine, linked, preflight=False, verify=False)
            out[f"linked_{how}"] = "loaded"
        except CheckpointError as exc:
            out[f"linked_{how}"] = str(exc)
        del engine
        gc.collect()
    cfg = R.ds_config("fp32", False, dist.get_world_size())
    cfg["zero_optimization"] = {"stage": 2}
    zero2 = initialize(tiny_llama(R.MODEL_SIZE, seed=0), cfg)
    try:
        restore_cpu_adam_kernel_state(zero2)
        out["zero2"] = "accepted"
    except CheckpointError as exc:
        out["zero2"] = str(exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["zero2_guarded"] = (restore_after_plain_load(zero2), [f"{w.category.__name__}: {w.message}" for w in caught])
    return out


@pytest.fixture(scope="module")
def kernel_runs(tmp_path_factory):
    from shardkit.run.spawn.process import run_ranks

    base = tmp_path_factory.mktemp("kernel")
    reference = [r.value for r in run_ranks(kernel_train_save_continue, 2, args=(str(base),), timeout=420, device="cpu")]
    resumed = [r.value for r in run_ranks(kernel_resume_one_step, 2, args=(str(base),), timeout=420, device="cpu")]
    return reference, resumed


@pytest.mark.parametrize("label,optimizer", [("fused_adam", "FusedAdam"), ("cpu_adam", "DeepSpeedCPUAdam")])
def test_first_step_after_resume_is_bit_exact_because_the_kernel_step_state_is_replayed(kernel_runs, label, optimizer):
    reference, resumed = kernel_runs
    kernel = {"fused_adam": "FusedAdam CPU kernel (adamw mode)", "cpu_adam": "DeepSpeedCPUAdam"}[label]
    for rank, (ref, got) in enumerate(zip(reference, resumed)):
        for mode in ("shardkit", "plain+restore", "plain+guard"):
            run = got[(label, mode)]
            assert run["optimizer"] == optimizer
            for a, b in zip(ref[label], run["masters"]):
                assert torch.equal(a, b), f"rank {rank} {mode}: {int((a != b).sum())} of {a.numel()} fp32 master elements differ"
            assert run["replays"] == [(kernel, KERNEL_SAVE_AT, KERNEL_SAVE_AT)], (rank, mode)
        # DeepSpeed's own load restores every saved tensor, yet misses the kernel's state: this is
        # what the replay fixes (if it ever passes, DeepSpeed keeps no such state any more)
        plain = got[(label, "plain")]["masters"]
        assert any(not torch.equal(a, b) for a, b in zip(ref[label], plain)), f"rank {rank}: plain load is bit-exact now"


def test_kernel_replay_refuses_engines_other_than_zero3(kernel_runs):
    _, resumed = kernel_runs
    msg = resumed[0]["zero2"]
    assert re.match(r"restore_cpu_adam_kernel_state: this engine runs ZeRO stage 2; only stage 3 engines are handled", msg), msg
    assert "engine.optimizer.optimizer" in msg


def test_a_guarded_plain_load_of_files_named_for_another_precision_is_refused_before_deepspeed_reads(kernel_runs):
    """DeepSpeed 0.19.8 looks only for its own naming (bf16_zero_pp_rank_* under bf16)
    and fails deep in the load; the guard names the key, both values and the fix first, and
    shardkit's own loader reads the other naming with a note."""
    _, resumed = kernel_runs
    for rank, got in enumerate(resumed):
        assert re.match(r"FileNotFoundError: .*zero_pp_rank_\d_mp_rank_00_optim_states\.pt", got["fp32_engine_deepspeed"]), (
            rank, got["fp32_engine_deepspeed"])
        msg = got["fp32_engine_guarded"]
        assert re.search(r"fused_adam/step2: its ZeRO optimizer files are named for bf16 \(bf16\.enabled: true\) "
                         r"\(bf16_zero_pp_rank_0_mp_rank_00_optim_states\.pt\), but this engine runs without bf16 "
                         r"\(bf16\.enabled: false\), so DeepSpeed's load_checkpoint looks for "
                         r"zero_pp_rank_0_mp_rank_00_optim_states\.pt and stops with FileNotFoundError", msg), (rank, msg)
        assert "Fix: resume with the precision the checkpoint was written in (set bf16.enabled to true" in msg
        assert "shardkit.load_checkpoint_resharded(engine, path), which reads either naming" in msg
        (note,) = [n for n in got["fp32_engine_shardkit_notes"] if "was written by a bf16 run" in n]
        assert "this engine runs fp32: the fp32 masters and Adam moments were loaded as they are" in note


def test_a_guarded_load_says_where_the_kernel_state_cannot_be_restored(kernel_runs):
    _, resumed = kernel_runs
    replays, caught = resumed[0]["zero2_guarded"]
    assert replays == []
    (warning,) = caught
    assert warning.startswith("KernelNotRestoredWarning: DeepSpeed's CPU Adam kernel state (beta**step, kept outside "
                              "the checkpoint) was not restored after load_checkpoint: the engine runs ZeRO stage 2")
    assert "shardkit.restore_cpu_adam_kernel_state(engine.optimizer.optimizer)" in warning


def test_a_load_never_reads_through_a_link_leading_out_of_the_tag_folder(kernel_runs):
    """Neither the guarded plain load nor shardkit's loader (verify off: no manifest
    check stands between) reads a rank file through a link to a file outside the tag."""
    _, resumed = kernel_runs
    for got in resumed:
        for how in ("guarded", "shardkit"):
            msg = got[f"linked_{how}"]
            assert re.search(r"refusing to load .*linked/step2: .*bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt: a "
                             r"symlink to '.*outside\.pt', which leads outside the checkpoint folder .*; shardkit never "
                             r"reads or writes through it\. Fix: replace the link", msg), (how, msg)


def test_a_resuming_rank_lists_the_tag_folder_once(tmp_path_factory):
    """Each listing of a tag folder is a metadata storm at 1,024 ranks on a shared filesystem: a rank resuming a
    ZeRO-3 checkpoint lists it once and hands the names on. Before, given the root: twice (the reader's rank
    files, the links leaving it) and an exists() per rank file; given the tag folder: 4 times (resolve_tag_dir in
    the ZeRO-1/2 check and in the reader too)."""
    from shardkit.run.spawn.process import run_ranks

    source = R.build_sources(tmp_path_factory.getbasetemp() / "zero3")["fp32"]
    tag_dir = source / (source / "latest").read_text().strip()
    got = [r.value for r in run_ranks(R.load_listing, 2, args=(str(source), str(tag_dir)), timeout=300, device="cpu")]
    for rank, result in enumerate(got):
        assert result["global_steps"] > 0
        assert len(result["listed"]) == 1, (rank, result["listed"])
