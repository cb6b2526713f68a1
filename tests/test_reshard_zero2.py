"""``shardkit reshard`` of a ZeRO-2 (and ZeRO-1) checkpoint saved at 2 ranks, resumed at 1 and 3 ranks by
DeepSpeed's plain ``engine.load_checkpoint`` on real engines (CPU, gloo).

DeepSpeed alone refuses that load ("Automatic adjustment of ZeRO's optimizer state partitioning with a new
world size is not currently supported"). After the reshard, the fp32 masters and both Adam moments,
gathered by parameter name (``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``), must be bit-equal
to the 2-rank run's at its save, and the next steps' losses must follow the 2-rank run's own continuation:
every global batch is the same rows at any world size, so only the gradient all-reduce's summation order
differs (close, not bit-equal: asserted to 1e-5 relative in fp32). Written at the source's own world size,
the writer's files hold exactly the source's values (the bit-equal reference).

Three spawns in all (saves at 2 ranks; loads at 1; loads at 3), each running its engines one after another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardkit.storage.manifest import MANIFEST_NAME
from shardkit.storage.torch_load import safe_torch_load

pytestmark = pytest.mark.slow
GLOBAL_BATCH = 6  # divisible by 1, 2 and 3 ranks
SEQ_LEN = 8
SAVE_STEPS, RESUME_STEPS = 2, 2


def _fp16_supported() -> bool:
    # what DeepSpeed's CPU accelerator asks before it trains in fp16 (accelerator/cpu_accelerator.py is_fp16_supported)
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # noqa: BLE001 - a torch build without the op: no fp16 on this CPU
        return False


#: label -> (ZeRO stage, precision, offload_optimizer to CPU): the sources, saved at 2 ranks in one spawn.
SOURCES = {"zero2_fp32": (2, "fp32", False), "zero2_bf16": (2, "bf16", False), "zero1_fp32": (1, "fp32", False),
           "zero2_offload": (2, "fp32", True), "zero2_fp16": (2, "fp16", False)}
#: new world size -> the sources resumed there (offload kept as saved).
LOADS = {1: ["zero2_fp32", "zero1_fp32", "zero2_offload"], 3: ["zero2_fp32", "zero2_bf16", "zero2_fp16"]}
if not _fp16_supported():  # this CPU's oneDNN has no fp16: DeepSpeed's CPU accelerator refuses fp16 training
    del SOURCES["zero2_fp16"]
    LOADS[3].remove("zero2_fp16")
#: fp16's dynamic loss scaler: 2**8, doubled after every clean step but the first (loss_scale_window 1), so the
#: saved state (scale 2**9, iteration 2) differs from a fresh engine's and a reshard that dropped it would be seen
FP16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1, "hysteresis": 2, "min_loss_scale": 1}
SCALER_KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _config(stage: int, dtype: str, offload: bool, world: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    cfg: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "steps_per_print": 10_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": zero,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = dict(FP16)
    return cfg


def _engine(label: str):
    from shardkit.engines.deepspeed import initialize
    from shardkit.engines.model_factory import tiny_llama

    return initialize(tiny_llama("tiny", seed=0), _config(*SOURCES[label], dist.get_world_size()))


def _step(engine, step: int) -> float:
    from shardkit.engines.deepspeed import train_step
    from shardkit.engines.model_factory import synthetic_batch

    world, rank = dist.get_world_size(), dist.get_rank()
    rows = synthetic_batch(engine.module.config.vocab_size, GLOBAL_BATCH, SEQ_LEN, step, rank=0)
    per = GLOBAL_BATCH // world
    t = torch.tensor([train_step(engine, rows[rank * per:(rank + 1) * per])], dtype=torch.float32)
    dist.all_reduce(t)
    return float(t.item()) / world


def _full_states(engine) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's full fp32 master and Adam moments, by name (collectives: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    # DeepSpeed links the moment views of each parameter at its first step (stage_1_and_2.py
    # _lazy_init_hp_params_optimizer_state); right after load_checkpoint they are not linked yet
    engine.optimizer._lazy_init_hp_params_optimizer_state()
    out: dict[str, dict[str, Any]] = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}}
    scaler = engine.optimizer.loss_scaler
    out["loss_scaler"] = {k: getattr(scaler, k, None) for k in SCALER_KEYS}
    for name, p in engine.module.named_parameters():
        out["fp32"][name] = safe_get_full_fp32_param(p).detach().cpu().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[key][name] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
    return out


def save_and_continue(base: str) -> dict[str, Any]:
    """Rank target: per source, SAVE_STEPS steps, save, the full states at the save, RESUME_STEPS more steps."""
    out = {}
    for label in SOURCES:
        engine = _engine(label)
        for s in range(SAVE_STEPS):
            _step(engine, s)
        engine.save_checkpoint(f"{base}/{label}", tag=f"global_step{SAVE_STEPS}")
        states = _full_states(engine)
        out[label] = {"states": states,
                      "losses": [_step(engine, s) for s in range(SAVE_STEPS, SAVE_STEPS + RESUME_STEPS)]}
    return out


def load_all(plans: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank target: per plan, DeepSpeed's plain load_checkpoint at this world size (or its refusal), the full
    states and the next losses."""
    out: dict[str, Any] = {}
    for plan in plans:
        engine = _engine(plan["source"])
        if plan.get("refuse"):
            try:
                engine.load_checkpoint(plan["ckpt"])
                out["refused"] = None
            except Exception as exc:  # DeepSpeed's ZeRORuntimeException
                out["refused"] = str(exc)
            continue
        path, _ = engine.load_checkpoint(plan["ckpt"])
        if path is None:
            raise RuntimeError(f"engine.load_checkpoint({plan['ckpt']!r}) loaded nothing")
        states = _full_states(engine)
        out[plan["source"]] = {"states": states, "global_steps": engine.global_steps,
                               "losses": [_step(engine, s) for s in range(SAVE_STEPS, SAVE_STEPS + RESUME_STEPS)]}
    return out


@pytest.fixture(scope="session")
def sources(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    from shardkit.run.spawn.process import run_ranks

    base = tmp_path_factory.getbasetemp() / "zero12"
    return base, run_ranks(save_and_continue, 2, args=(str(base),), timeout=300, device="cpu")[0].value


@pytest.fixture(scope="session")
def resumed(sources, tmp_path_factory) -> dict[int, dict[str, Any]]:
    """world -> what the loads there saw; each source resharded by the Python API first."""
    from shardkit.checkpoint.ops.reshard import reshard_checkpoint
    from shardkit.run.spawn.process import run_ranks

    base, _ = sources
    out = tmp_path_factory.getbasetemp() / "zero12_resharded"
    results = {}
    for world, labels in LOADS.items():
        plans: list[dict[str, Any]] = []
        if world == 1:
            plans.append({"source": "zero2_fp32", "refuse": True, "ckpt": str(base / "zero2_fp32")})
        for label in labels:
            # DeepSpeed's own saves carry no manifest: the reshard says so, which is expected here
            result = reshard_checkpoint(base / label, out / f"{label}_ws{world}", world, warn=lambda note: None)
            assert result.notes == [], result.notes  # the byte-range route (a torch-route fallback says why in a note)
            plans.append({"source": label, "ckpt": str(out / f"{label}_ws{world}")})
        results[world] = run_ranks(load_all, world, args=(plans,), timeout=300, device="cpu")[0].value
    return results


@pytest.mark.timeout(600)
def test_deepspeed_alone_refuses_another_world_size(resumed):
    refused = resumed[1]["refused"]
    assert refused and "Automatic adjustment of ZeRO's optimizer state partitioning" in refused


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,label", [(w, label) for w, labels in LOADS.items() for label in labels])
def test_resharded_checkpoint_resumes_bit_equal_at_new_world_size(sources, resumed, world, label):
    _, saved = sources
    got = resumed[world][label]
    assert got["global_steps"] == SAVE_STEPS
    # fp16's dynamic loss scaler resumes where it was (bf16/fp32: a static scale of 1 on both sides)
    assert got["states"]["loss_scaler"] == saved[label]["states"]["loss_scaler"]
    for kind in ("fp32", "exp_avg", "exp_avg_sq"):
        want = saved[label]["states"][kind]
        assert got["states"][kind].keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(got["states"][kind][name], tensor), f"{label} at {world} ranks: {kind} of {name} differs"
    # the same global batches as the 2-rank run's continuation: only the all-reduce's summation order differs
    assert got["losses"] == pytest.approx(saved[label]["losses"], rel=1e-5 if SOURCES[label][1] == "fp32" else 1e-2)


def _values_equal(a: Any, b: Any, where: str) -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            _values_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, type(a)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _values_equal(x, y, f"{where}[{i}]")
    elif hasattr(a, "deepspeed_name"):  # DeepSpeed objects read as stand-ins: same class, same state
        assert (a.deepspeed_name, a.args, vars(a)) == (b.deepspeed_name, b.args, vars(b)), where
    else:
        assert a == b, where


def _plan(tag_dir: Path, world: int, monkeypatch: pytest.MonkeyPatch | None = None):
    """The reshard's plan (reader -> writer); with ``monkeypatch``, on the writer's torch route, as if the
    source's bytes could not express the new partitions."""
    from shardkit.checkpoint.ops.reshard_zero12 import plan_zero12_reshard
    from shardkit.checkpoint.writers.zero12 import Zero12Files

    if monkeypatch is not None:
        monkeypatch.setattr(Zero12Files, "_first_not_byte_ranges", lambda self: "forced by the test")
    return plan_zero12_reshard(tag_dir, world)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("torch_route", [False, True], ids=["bytes", "torch"])
@pytest.mark.parametrize("label", sorted(SOURCES))
def test_writer_at_the_source_world_size_reproduces_every_value(sources, tmp_path, monkeypatch, label, torch_route):
    """The bit-equal reference: planned for 2 ranks, the new files hold the source's own values, key for key
    (fp32 partitions, moments with their padding, group_paddings, param_slice_mappings, dp_world_size), on
    either route."""
    tag_dir = sources[0] / label / f"global_step{SAVE_STEPS}"
    planned = _plan(tag_dir, 2, monkeypatch if torch_route else None)
    assert len(planned.jobs) == 3 and bool(planned.notes) == torch_route, planned.notes
    for f in planned.jobs:
        f.write(tmp_path / f.name)
        _values_equal(safe_torch_load(tag_dir / f.name), safe_torch_load(tmp_path / f.name), f.name)


@pytest.mark.timeout(600)
def test_cli_reshard_writes_a_verified_checkpoint(sources, tmp_path, run_cli):
    root = sources[0] / "zero2_bf16"
    out = tmp_path / "ws3"
    code, _, err = run_cli("reshard", root, "--world-size", "3", "-o", out)
    assert code == 0, err
    names = sorted(p.name for p in (out / f"global_step{SAVE_STEPS}").iterdir())
    assert names == sorted([MANIFEST_NAME, "mp_rank_00_model_states.pt",
                            *(f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3))])
    code, _, err = run_cli("verify", out)
    assert code == 0, err
    code, _, err = run_cli("reshard", root, "--world-size", "1", "--sub-group-size", "1000", "-o", tmp_path / "o")
    assert code == 2 and "--sub-group-size 1000: a ZeRO-3 setting" in err
    assert not (tmp_path / "o" / f"global_step{SAVE_STEPS}").exists()


@pytest.mark.timeout(600)
def test_trainer_checkpoint_of_zero2_is_resharded_with_its_files(sources, tmp_path, run_cli):
    import shutil

    trainer = tmp_path / "checkpoint-4"
    shutil.copytree(sources[0] / "zero2_fp32", trainer)
    (trainer / "trainer_state.json").write_text('{"global_step": 4}')
    out = tmp_path / "checkpoint-4-ws3"
    code, stdout, err = run_cli("reshard", trainer, "--world-size", "3", "-o", out)
    assert code == 0, err
    assert "world size 2 -> 3" in stdout and (out / "trainer_state.json").is_file()
    # the global batch note, from the ds_config the reshard read (micro 3 x accumulation 1 x ranks)
    assert "stepped on 3 x 1 x 2 = 6 samples" in " ".join(stdout.split()) and "at 3 ranks it is 9" in " ".join(stdout.split()), stdout
    assert (out / "latest").read_text().strip() == f"global_step{SAVE_STEPS}"
    assert sorted(p.name for p in (out / f"global_step{SAVE_STEPS}").glob("*_optim_states.pt")) == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sealed", [False, True], ids=["deepspeed_save", "sealed"])
def test_two_processes_under_torchrun_write_the_bytes_one_process_writes(sources, tmp_path, sealed):
    """Sealed: each process checks its share of the source files from the bytes its own copies read; a flipped
    bit in the file the second process checks fails the run, naming the file, with nothing published."""
    import os
    import shutil
    import subprocess
    import sys

    from shardkit.storage.manifest import read_manifest, seal
    from tests._corrupt import flip_a_byte

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")}
    src = sources[0] / "zero2_bf16"
    if sealed:
        src = Path(shutil.copytree(src, tmp_path / "src"))
        seal(src / f"global_step{SAVE_STEPS}", engine="deepspeed", world_size=2, zero_stage=2, dtype="bf16")

    def digests(out: Path) -> dict[str, tuple[int, str]]:
        return {e.path: (e.size, e.digest) for e in read_manifest(out / f"global_step{SAVE_STEPS}").files}

    one, two = tmp_path / "one", tmp_path / "two"
    done = subprocess.run([sys.executable, "-m", "shardkit", "reshard", str(src), "--world-size", "3", "-o", str(one)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                           "shardkit", "reshard", str(src), "--world-size", "3", "-o", str(two), "--workers", "1"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "by 2 processes (torchrun): 4 files" in done.stdout, done.stdout
    assert digests(two) == digests(one)  # same names, sizes and digests: byte-identical files
    if sealed:
        victim = src / f"global_step{SAVE_STEPS}" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
        flip_a_byte(victim)
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               "-m", "shardkit", "reshard", str(src), "--world-size", "3", "-o", str(tmp_path / "bad")],
                              env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode != 0 and f"{victim} fails verification" in done.stderr, done.stderr
        assert not (tmp_path / "bad" / f"global_step{SAVE_STEPS}").exists()


# --- the writer's torch-free byte-range route against its torch route -----------------------------------


def _write_both(tag_dir: Path, world: int, out: Path) -> list[str]:
    """Every new file of ``tag_dir`` at ``world`` ranks, written by the byte route into ``out/bytes`` and by the
    torch route into ``out/torch``; returns the file names."""
    planned = _plan(tag_dir, world)
    assert planned.notes == []
    (out / "bytes").mkdir(parents=True)
    (out / "torch").mkdir()
    for f in planned.jobs:
        f.write(out / "bytes" / f.name)
    with pytest.MonkeyPatch.context() as patch:
        forced = _plan(tag_dir, world, patch)
        assert len(forced.notes) == 1 and "forced by the test" in forced.notes[0]
        for f in forced.jobs:
            f.write(out / "torch" / f.name)
    return [f.name for f in planned.jobs]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("label", sorted(SOURCES))
def test_byte_route_files_load_equal_to_the_torch_routes(sources, tmp_path, label):
    """torch.load of each new file: every tensor (dtype, shape, values) and every scalar equal, key order
    included, at fewer, the same and more ranks than saved."""
    tag_dir = sources[0] / label / f"global_step{SAVE_STEPS}"
    for world in (1, 2, 3):
        names = _write_both(tag_dir, world, tmp_path / f"ws{world}")
        assert len(names) == world + 1
        for name in names:
            _values_equal(safe_torch_load(tmp_path / f"ws{world}" / "torch" / name),
                          safe_torch_load(tmp_path / f"ws{world}" / "bytes" / name), f"{label} at {world}: {name}")


@pytest.mark.timeout(300)
def test_reshard_there_and_back_restores_every_value_without_importing_torch(sources, tmp_path):
    """2 -> 3 -> 2 ranks by the byte route in a fresh interpreter that never imports torch: the files hold the
    saved files' values again (the padding moved to the new last rank and back)."""
    import subprocess
    import sys

    src = sources[0] / "zero2_bf16"
    script = (
        "import sys\n"
        "from shardkit.checkpoint.ops.reshard import reshard_checkpoint\n"
        f"for s, d, w in [({str(src)!r}, {str(tmp_path / 'ws3')!r}, 3), ({str(tmp_path / 'ws3')!r}, {str(tmp_path / 'ws2')!r}, 2)]:\n"
        "    r = reshard_checkpoint(s, d, w, warn=lambda note: None)\n"
        "    assert r.notes == [], r.notes\n"
        "assert 'torch' not in sys.modules, 'the byte route imported torch'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    tag = f"global_step{SAVE_STEPS}"
    names = sorted(p.name for p in (src / tag).iterdir())
    assert sorted(p.name for p in (tmp_path / "ws2" / tag).iterdir() if p.name != MANIFEST_NAME) == names
    for name in names:
        _values_equal(safe_torch_load(src / tag / name), safe_torch_load(tmp_path / "ws2" / tag / name), name)


@pytest.mark.timeout(300)
def test_the_reshard_command_never_imports_torch_on_the_byte_route(sources, tmp_path):
    """``shardkit reshard`` as a user runs it (the CLI: argument parsing, the Trainer-folder check, the verify
    of the source's manifest, the output manifest with its library versions) in a fresh interpreter: exit 0,
    and neither torch nor deepspeed was imported on the way (each costs seconds of start-up and, torch,
    hundreds of MiB)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from shardkit.cli import main\n"
        f"code = main(['reshard', {str(sources[0] / 'zero2_bf16')!r}, '--world-size', '3', '-o', "
        f"{str(tmp_path / 'ws3')!r}])\n"
        "heavy = sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules)\n"
        "assert code == 0 and not heavy, (code, heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "world size 2 -> 3" in done.stdout, done.stdout
    assert (tmp_path / "ws3" / f"global_step{SAVE_STEPS}" / MANIFEST_NAME).is_file()


@pytest.mark.timeout(300)
def test_source_the_byte_route_cannot_express_takes_the_torch_route_and_says_why(sources, tmp_path):
    """A rank file whose fp32 slice is a strided view (not a contiguous run of its file: no DeepSpeed save
    writes one, another tool might): the reshard builds the files with torch instead, the note names the
    tensor, and the values are those the byte route writes for the original."""
    import shutil

    from shardkit.checkpoint.ops.reshard import reshard_checkpoint

    tag = f"global_step{SAVE_STEPS}"
    odd = tmp_path / "odd"
    shutil.copytree(sources[0] / "zero2_fp32", odd)
    rank1 = odd / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    sd = safe_torch_load(rank1, real_deepspeed_objects=True)
    flat = sd["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    wide = torch.zeros(2 * flat.numel(), dtype=flat.dtype)
    wide[::2] = flat
    sd["optimizer_state_dict"]["single_partition_of_fp32_groups"][0] = wide[::2]
    torch.save(sd, rank1)
    result = reshard_checkpoint(odd, tmp_path / "via_torch", 3, warn=lambda note: None)
    assert len(result.notes) == 1 and "built in memory with torch" in result.notes[0]
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt: single_partition_of_fp32_groups[0] is not a contiguous" \
        in result.notes[0]
    plain = reshard_checkpoint(sources[0] / "zero2_fp32", tmp_path / "via_bytes", 3, warn=lambda note: None)
    assert plain.notes == []
    for f in plain.files:
        _values_equal(safe_torch_load(f), safe_torch_load(tmp_path / "via_torch" / tag / f.name), f.name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 3, 4])
def test_a_sealed_source_is_verified_from_the_bytes_the_copy_reads(sources, tmp_path, monkeypatch, world):
    """With a manifest, the byte route checks the source from the ranges its copies read (``SourceDigests``),
    not from a second read: the files are byte for byte the unverified route's (one thread per file, the source
    not hashed), almost every source byte is hashed in the copy, and a flipped bit in an old rank's file is
    refused, naming it, with nothing published."""
    import re
    import shutil

    from shardkit.checkpoint.ops.reshard import reshard_checkpoint
    from shardkit.core.errors import CheckpointError
    from shardkit.storage import stream
    from shardkit.storage.manifest import seal
    from tests._corrupt import flip_a_byte

    src = tmp_path / "src"
    shutil.copytree(sources[0] / "zero2_bf16", src)
    tag = src / f"global_step{SAVE_STEPS}"
    seal(tag, engine="deepspeed", world_size=2, zero_stage=2, dtype="bf16")
    in_copy: list[tuple[int, int]] = []
    real_finish = stream.SourceDigests.finish

    def finish(self: stream.SourceDigests, only: Any = None) -> dict[Path, str]:
        in_copy.append((self.hashed_in_copy(), sum(p.stat().st_size for p in tag.glob("*.pt"))))
        return real_finish(self, only)

    monkeypatch.setattr(stream.SourceDigests, "finish", finish)
    verified = reshard_checkpoint(src, tmp_path / "verified", world)
    plain = reshard_checkpoint(src, tmp_path / "plain", world, verify=False, warn=lambda note: None)
    assert (verified.verified, plain.verified, verified.notes) == ("hash", "sizes", [])
    for name in (p.name for p in verified.files):
        assert (verified.output / verified.tag / name).read_bytes() == (plain.output / plain.tag / name).read_bytes(), name
    [(hashed, total)] = in_copy
    assert hashed >= 0.95 * total, (hashed, total)  # the rest: the zip end records after the last tensor, read at the end

    victim = tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    flip_a_byte(victim)
    with pytest.raises(CheckpointError, match=rf"refusing to publish the reshard of .*: {re.escape(str(victim))} fails "
                       r"verification: its blake3 is [0-9a-f]{64}, its manifest says [0-9a-f]{64}.*Nothing was written"):
        reshard_checkpoint(src, tmp_path / "refused", world)
    assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())


@pytest.mark.timeout(300)
def test_a_write_that_fails_for_want_of_space_is_named_without_hashing_the_rest_of_the_source(sources, tmp_path,
                                                                                              monkeypatch):
    """A full disk under a verified reshard is reported at once: the source is not read to its end to check
    digests first (at 2 TB that was hours of hashing before "disk full"); only a failure the source's bytes
    could explain (a write error naming no cause) still checks the source first and names a corrupted file."""
    import errno
    import os
    import re
    import shutil

    from shardkit.checkpoint.ops.reshard import reshard_checkpoint
    from shardkit.core.errors import CheckpointError
    from shardkit.storage import torch_zip
    from shardkit.storage.manifest import seal
    from tests._corrupt import flip_a_byte

    src = tmp_path / "src"
    shutil.copytree(sources[0] / "zero2_bf16", src)
    tag = src / f"global_step{SAVE_STEPS}"
    seal(tag, engine="deepspeed", world_size=2, zero_stage=2, dtype="bf16")
    source_bytes = sum(p.stat().st_size for p in tag.glob("*optim_states.pt"))
    read = [0]
    real_preadv = os.preadv

    def counted_preadv(fd: int, buffers: Any, offset: int, *flags: int) -> int:
        got = real_preadv(fd, buffers, offset, *flags)
        read[0] += max(got, 0)
        return got

    monkeypatch.setattr(os, "preadv", counted_preadv)

    def failing(error: OSError) -> Any:
        def write(self: torch_zip.HashingWriter, data: bytes | memoryview, *, planned: bool = False) -> None:
            raise error
        return write

    monkeypatch.setattr(torch_zip.HashingWriter, "write", failing(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(CheckpointError, match=r"disk full at .*No space left on device"):
        reshard_checkpoint(src, tmp_path / "full", 3)
    assert read[0] < source_bytes, (read[0], source_bytes)  # the old code read all of it (and hashed it) first
    assert not (tmp_path / "full").exists() or not any((tmp_path / "full").iterdir())

    # an I/O error naming nothing the source could not have caused: the source is checked first, its damage named
    victim = tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    flip_a_byte(victim)
    monkeypatch.setattr(torch_zip.HashingWriter, "write", failing(OSError(errno.EIO, "Input/output error")))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(victim))} fails verification"):
        reshard_checkpoint(src, tmp_path / "eio", 3)
