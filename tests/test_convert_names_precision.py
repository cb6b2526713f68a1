"""`shardkit convert --to zero3` against what the resuming DeepSpeed run really is: its
precision (the optim files' ``bf16_`` names) inferred from the source or refused naming
``--ds-config``; a resuming model wrapped in ``module.`` (names mapped with and without the prefix,
ambiguity refused); frozen parameters never loaded whole (peak RSS of a LoRA-style conversion
measured against a fully trained one of the same size, both directions); links out of the source
never read.

The FSDP2 sources are written in this process (no FSDP: a plain module's state dict saved by
``save_fsdp_checkpoint``, one chunk per tensor); the ZeRO-3 sides are real DeepSpeed engines on
gloo in spawned ranks with hard timeouts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.model.tensors import SourceTensor
from shardkit.checkpoint.ops.convert.to_zero3 import convert_to_zero3
from shardkit.checkpoint.ops.convert.to_zero3_plan import SourcePrecision, decide_precision, target_names
from shardkit.checkpoint.readers.dcp import precision_seen
from shardkit.core.errors import CheckpointError, UsageError
from shardkit.storage.manifest import Manifest
from shardkit.storage.torch_load import safe_torch_load

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
DIM = 64
#: LoRA-style size for the peak-memory comparison: 4 base layers of 2048 x 2048 (64 MiB of fp32 weights)
BIG = 2048
BIG_LAYERS = 4


class Net(torch.nn.Module):
    """Two layers, a norm with a buffer; ``frozen``: the first layer is not trained."""

    def __init__(self, dim: int = DIM, layers: int = 2, frozen: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))
        self.adapter = torch.nn.Linear(dim, 8, bias=False)
        self.head = torch.nn.Linear(8, dim, bias=False)
        self.register_buffer("scale", torch.full((dim,), 0.5))
        for layer in self.layers if frozen else ():
            layer.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return (x + self.head(self.adapter(x))) * self.scale


class Wrapper(torch.nn.Module):
    """What DDP (and DeepSpeed's own engine) do to names: the model held as ``.module``."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.module = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _train_and_save(model: torch.nn.Module, root: Path, steps: int = 2) -> None:
    from shardkit.checkpoint.ops.fsdp_checkpoint import save_fsdp_checkpoint

    dtype = next(model.parameters()).dtype
    dim = next(model.parameters()).shape[-1]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
    for step in range(steps):
        x = torch.randn(4, dim, generator=torch.Generator().manual_seed(step)).to(dtype)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: no process group, one process (intended)
        save_fsdp_checkpoint(model, opt, root, step=steps)


def _ds_config(world: int, bf16: bool = False) -> dict[str, Any]:
    cfg: dict[str, Any] = {"train_batch_size": 4 * world, "train_micro_batch_size_per_gpu": 4,
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
                           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                           "steps_per_print": 10_000}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("names_precision")
    out = {"fp32": base / "fp32", "bf16": base / "bf16", "wrapped": base / "wrapped", "odd": base / "odd"}
    _train_and_save(Net(), out["fp32"])
    _train_and_save(Net().to(torch.bfloat16), out["bf16"])
    _train_and_save(Wrapper(Net()), out["wrapped"])

    class Odd(torch.nn.Module):  # a submodule really called 'module' beside others: not a wrapper
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(DIM, DIM)
            self.head = torch.nn.Linear(DIM, DIM)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.module(x))

    _train_and_save(Odd(), out["odd"])
    return out


# --- A: precision ----------------------------------------------------------------------------------


def test_a_float32_source_without_ds_config_is_refused_naming_the_option_and_the_value(sources, tmp_path):
    with pytest.raises(UsageError) as err:
        convert_to_zero3(sources["fp32"], tmp_path / "out", world_size=2)
    msg = str(err.value)
    assert "no --ds-config given and the source does not tell the precision of the resuming run: its manifest's " \
           "dtype 'float32'" in msg, msg
    assert "FSDP2 keeps float32 parameters also when a MixedPrecisionPolicy trains in bf16" in msg
    assert "bf16: bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt; fp32: zero_pp_rank_0_mp_rank_00_optim_states.pt" in msg
    assert "Pass the resuming run's DeepSpeed config: --ds-config ds_config.json" in msg
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_a_bf16_source_gets_bf16_file_names_without_a_config(sources, tmp_path):
    r = convert_to_zero3(sources["bf16"], tmp_path / "out", world_size=2)
    names = sorted(f.name for f in (tmp_path / "out" / "step2").iterdir())
    assert "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in names, names
    assert not any(n.startswith("zero_pp_rank") and n.endswith("optim_states.pt") for n in names), names
    (note,) = [n for n in r.notes if n.startswith("precision bf16")]
    assert note.startswith("precision bf16 taken from the source (its manifest's dtype 'bfloat16'): the optim files "
                           "are named bf16_zero_pp_rank_*")
    # bf16 moments and parameters are cast to the fp32 masters and moments: the torch route, said and named
    assert r.route == "torch"
    (route,) = [n for n in r.notes if n.startswith("written through torch (slower, more memory): ")]
    assert re.search(r": layers\.0\.weight is bfloat16, the ZeRO-3 files hold it as float32 \(a cast\)", route), route
    model = safe_torch_load(tmp_path / "out" / "step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert model["ds_config"]["bf16"] == {"enabled": True}
    assert all(v.dtype == torch.bfloat16 for k, v in model["module"].items() if k != "scale")
    # a config saying otherwise wins, and the disagreement is said
    r = convert_to_zero3(sources["bf16"], tmp_path / "fp32", world_size=2, ds_config=_ds_config(2))
    assert (tmp_path / "fp32" / "step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()
    assert any(n.startswith("the source trained in bf16 (its manifest's dtype 'bfloat16'); the files are written for "
                            "the given config's fp32") for n in r.notes), r.notes


def test_the_precision_a_zero3_origin_recorded_is_certain_and_fp16_is_refused(tmp_path):
    ckpt = TrainingCheckpoint("dcp", tmp_path, {})
    came = {"engine": "deepspeed", "precision": "bf16"}
    m = Manifest(engine="fsdp2", tag="t", world_size=1, dtype="float32", extra={"converted_from": came})
    precision, seen = precision_seen(ckpt, m, came)
    assert precision == "bf16" and "extra.converted_from.precision 'bf16'" in seen
    m = Manifest(engine="fsdp2", tag="t", world_size=1, dtype="float16")
    with pytest.raises(UsageError, match=r"trained in fp16 \(its manifest's dtype 'float16'\) and no --ds-config was "
                       r"given: an fp16 ZeRO-3 run needs its loss-scaler state"):
        decide_precision(None, "fp32", SourcePrecision(*precision_seen(ckpt, m, {})), tmp_path, [])


# --- B: module. names ------------------------------------------------------------------------------


def test_names_mapped_with_and_without_the_module_prefix_and_ambiguity_refused(sources, tmp_path):
    wrapped = convert_to_zero3(sources["fp32"], tmp_path / "wrapped", world_size=1, ds_config=_ds_config(1),
                                   name_prefix="module.")
    model = safe_torch_load(tmp_path / "wrapped" / "step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert list(model["module"]) == [f"module.{n}" for n in Net().state_dict()]
    assert model["buffer_names"] == ["module.scale"]
    assert all(n.startswith("module.") for g in model["param_shapes"] for n in g)
    assert any(n.startswith("names written with the prefix 'module.'") for n in wrapped.notes)
    unwrapped = convert_to_zero3(sources["wrapped"], tmp_path / "unwrapped", world_size=1, ds_config=_ds_config(1),
                                     name_prefix="")
    model = safe_torch_load(tmp_path / "unwrapped" / "step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert list(model["module"]) == list(Net().state_dict())
    assert any(n.startswith("the prefix 'module.' removed from every name") for n in unwrapped.notes)
    # kept as they are without name_prefix, and said so
    kept = convert_to_zero3(sources["wrapped"], tmp_path / "kept", world_size=1, ds_config=_ds_config(1))
    assert any("every name starts with 'module.'" in n and "name_prefix=''" in n for n in kept.notes)
    for prefix in ("module.", ""):
        with pytest.raises(UsageError, match=r"cannot give every name the prefix .* some model keys have 'module\.' "
                           r"\(\['module\.weight', 'module\.bias'\]\) and some do not \(\['head\.weight', 'head\.bias'\]\), "
                           r"so which of them belong to a wrapper is ambiguous"):
            convert_to_zero3(sources["odd"], tmp_path / f"odd{prefix}", world_size=1, ds_config=_ds_config(1),
                                 name_prefix=prefix)
    with pytest.raises(UsageError, match=r"name_prefix 'model\.': must be 'module\.'"):
        convert_to_zero3(sources["fp32"], tmp_path / "bad", world_size=1, ds_config=_ds_config(1), name_prefix="model.")


def test_a_zero3_origins_prefix_comes_back_without_being_asked():
    ckpt = TrainingCheckpoint("dcp", Path("x"), {n: SourceTensor(n, "float32", (1,)) for n in ("a.weight", "b")},
                              scalars={"source": {"engine": "deepspeed", "name_prefix": "module."}})
    notes: list[str] = []
    assert target_names(ckpt, None, notes) == {"a.weight": "module.a.weight", "b": "module.b"}
    assert "recorded when this checkpoint was converted from ZeRO-3" in notes[-1]


def load_into_engines(ckpts: dict[str, str]) -> dict[str, Any]:
    """Rank target: DeepSpeed engines over Net (wrapped or not, bf16 or not) load each checkpoint
    with the plain engine.load_checkpoint; what each load did."""
    import deepspeed
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for label, ckpt in ckpts.items():
        wrapped, bf16 = label.startswith("wrapped"), label.endswith("bf16")
        net = Wrapper(Net()) if wrapped else Net()
        engine, *_ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                                          config=_ds_config(dist.get_world_size(), bf16))
        try:
            path, _ = engine.load_checkpoint(ckpt)
            out[label] = "loaded" if path is not None else "nothing loaded"
        except Exception as exc:  # what the user would see
            out[label] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return out


def test_deepspeed_loads_what_was_converted_for_its_names_and_precision(sources, tmp_path):
    from shardkit.run.spawn.process import run_ranks

    convert_to_zero3(sources["fp32"], tmp_path / "wrapped", world_size=2, ds_config=_ds_config(2), name_prefix="module.")
    convert_to_zero3(sources["fp32"], tmp_path / "plain", world_size=2, ds_config=_ds_config(2))
    convert_to_zero3(sources["bf16"], tmp_path / "bf16", world_size=2)  # no config: bf16 from the source
    ckpts = {"wrapped": str(tmp_path / "wrapped"), "wrapped_given_plain": str(tmp_path / "plain"),
             "unwrapped_bf16": str(tmp_path / "bf16")}
    got = run_ranks(load_into_engines, 2, args=(ckpts,), timeout=300, device="cpu")
    for r in got:
        assert r.value["wrapped"] == "loaded", r.value
        assert r.value["unwrapped_bf16"] == "loaded", r.value  # it used to look for bf16_ files that were never written
        # what name_prefix is for: unprefixed names into a wrapped model fail DeepSpeed's strict load
        assert r.value["wrapped_given_plain"].startswith("RuntimeError: Error(s) in loading state_dict"), r.value


# --- E: frozen parameters stay on disk -------------------------------------------------------------

# The conversion's own peak, not ru_maxrss: Linux carries the RSS high-water mark of the process
# that (v)forked the child across execve into ru_maxrss (this pytest process: hundreds of MiB after
# building the models), and importing deepspeed alone peaks near 300 MiB here, above what a 64 MiB
# difference adds later. So the child imports everything first, resets its high-water mark
# (``5 > /proc/self/clear_refs``, Linux >= 4.0) and reads VmHWM after the conversion.
_PEAK = """
import importlib, json, sys, warnings
warnings.simplefilter("ignore")
convert = getattr(importlib.import_module("shardkit.checkpoint.ops.convert." + sys.argv[1]), sys.argv[2])
import deepspeed, torch.distributed.checkpoint  # imported by the conversion: their import peak is not its own
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
convert(sys.argv[3], sys.argv[4], **json.loads(sys.argv[5]))
print(int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1]) // 1024)
"""


def _peak_mib(module: str, function: str, src: Path, out: Path, kwargs: dict[str, Any]) -> int:
    """Peak RSS (MiB) of one conversion in a fresh process, measured from after its imports."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("/proc/self/clear_refs is not writable here: the peak RSS of the conversion alone cannot be read")
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-c", _PEAK, module, function, str(src), str(out), json.dumps(kwargs)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.strip().splitlines()[-1])


def zero3_save(root: str, frozen: bool) -> None:
    """Rank target: the BIG net (LoRA-style: base layers frozen, or all trained), one step, saved."""
    import deepspeed
    import torch.distributed as dist

    net = Net(BIG, BIG_LAYERS, frozen=frozen)
    cfg = {**_ds_config(dist.get_world_size()), "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                                      config=cfg)
    x = torch.randn(4, BIG, generator=torch.Generator().manual_seed(0))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    engine.save_checkpoint(root, tag="global_step1")


def test_a_mostly_frozen_model_converts_at_the_peak_memory_of_a_fully_trained_one(tmp_path):
    """64 MiB of frozen base weights. Loaded whole, as before the fix, they raised the peak by
    133 MiB (to zero3: 442 against 309 MiB) and 178 MiB (to fsdp2: 488 against 310); streamed as
    byte ranges like the trained masters they add nothing (308 and 311 MiB)."""
    from shardkit.run.spawn.process import run_ranks

    peaks: dict[str, int] = {}
    for label, frozen in (("lora", True), ("full", False)):
        _train_and_save(Net(BIG, BIG_LAYERS, frozen=frozen), tmp_path / f"dcp_{label}", steps=1)
        peaks[f"to_zero3_{label}"] = _peak_mib("to_zero3", "convert_to_zero3", tmp_path / f"dcp_{label}",
                                               tmp_path / f"z3_{label}", {"world_size": 2, "ds_config": _ds_config(2)})
        run_ranks(zero3_save, 2, args=(str(tmp_path / f"ds_{label}"), frozen), timeout=300, device="cpu")
        peaks[f"to_fsdp2_{label}"] = _peak_mib("to_dcp", "convert_to_dcp", tmp_path / f"ds_{label}",
                                               tmp_path / f"fsdp_{label}", {})
    print(f"peak RSS, MiB: {peaks}")  # -s shows the numbers the docs quote
    frozen_mib = BIG * BIG * 4 * BIG_LAYERS >> 20
    for direction in ("to_zero3", "to_fsdp2"):
        lora, full = peaks[f"{direction}_lora"], peaks[f"{direction}_full"]
        assert lora <= full + frozen_mib // 4, (direction, peaks)
    # and what was converted is right: the frozen weights, bit for bit, on the ZeRO-3 side
    model = safe_torch_load(tmp_path / "z3_lora" / "step1" / "zero_pp_rank_1_mp_rank_00_model_states.pt")
    full = Net(BIG, BIG_LAYERS, frozen=True).layers[0].weight.detach().reshape(-1)
    half = full.numel() // 2
    assert torch.equal(model["frozen_param_fragments"]["layers.0.weight"], full[half:])


# --- C: links out of the source ----------------------------------------------------------------------


def test_convert_refuses_a_source_with_a_link_leading_outside_even_without_a_manifest(sources, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(sources["fp32"] / "step2", src)
    (src / "shardkit_manifest.json").unlink()  # not verifiable: only the link check stands between
    victim = next(src.glob("*.distcp"))
    outside = tmp_path / "elsewhere.distcp"
    shutil.move(victim, outside)
    victim.symlink_to(outside)
    with pytest.raises(CheckpointError, match=rf"refusing to (convert|read) {src}: {victim}: a symlink to '{outside}', which "
                       r"leads outside the checkpoint folder"):
        convert_to_zero3(src, tmp_path / "out", world_size=1, ds_config=_ds_config(1))
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


# --- D: the torch-free route --------------------------------------------------------------------------


def _torch_route(monkeypatch, everything: bool) -> None:
    """What a source the byte route cannot take goes through: buffers, steps and param-group values
    read by dcp.load (``everything``: the flat tensors and fragments too)."""
    from shardkit.checkpoint.dcp import slices as dcp_slices
    from shardkit.checkpoint.writers.zero3 import RankStates

    monkeypatch.setattr(RankStates, "_rest_plain", lambda self: False)
    if everything:
        monkeypatch.setattr(dcp_slices.DcpSlices, "chunks", lambda self, key: None)
        monkeypatch.setattr(dcp_slices.DcpSlices, "tensor_ref", lambda self, key: None)
        monkeypatch.setattr(dcp_slices.DcpSlices, "value", lambda self, key: (False, None))


@pytest.mark.parametrize("optimizer", ["torch", "FusedAdam"])
def test_the_usual_route_imports_no_torch_and_writes_what_torch_writes(sources, tmp_path, monkeypatch, optimizer):
    """`shardkit convert --to zero3` reads the .metadata, the param-group values, the Adam steps and
    the buffers straight from the files and writes the rank files without importing torch (1.2 s,
    224 MB). Its files equal, byte for byte, those of the torch route (dcp.load of the small items;
    and of everything): a torch optimizer's step tensors, a buffer, frozen fragments, FusedAdam's
    groups. DeepSpeed loads of those files are tested above and in test_convert_fsdp_to_zero3.py."""
    frozen = tmp_path / "frozen_src"
    _train_and_save(Net(frozen=True), frozen)
    cfg = _ds_config(3)
    if optimizer == "torch":
        del cfg["optimizer"]  # a client torch AdamW: step kept as a 0-dim float32 tensor
    cfg_path = tmp_path / "ds.json"
    cfg_path.write_text(json.dumps(cfg))
    for src in (sources["fp32"], frozen):
        out = tmp_path / f"plain_{src.name}"
        code = ("import sys; from shardkit.cli import main; "
                f"code = main(['convert', {str(src)!r}, '--to', 'zero3', '--world-size', '3', '--ds-config', "
                f"{str(cfg_path)!r}, '-o', {str(out)!r}]); "
                "print('imported:', sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', "
                "'numpy'))); sys.exit(code)")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stderr + done.stdout
        assert "imported: []" in done.stdout and "written through torch" not in done.stdout, done.stdout[:3000]
        written = sorted(p.name for p in (out / "step2").glob("*.pt"))
        assert len(written) == 6
        for everything in (False, True):
            with monkeypatch.context() as m:
                _torch_route(m, everything)
                ref = convert_to_zero3(src, tmp_path / f"torch_{src.name}_{everything}", world_size=3,
                                           ds_config=cfg_path)
            assert ref.route == "torch"
            (note,) = [n for n in ref.notes if n.startswith("written through torch (slower, more memory): ")]
            assert ("is read through a loader (its stored chunks are not byte ranges)" if everything
                    else "buffers, Adam steps or param-group values are not stored as plain records") in note, note
            for name in written:
                a, b = (out / "step2" / name).read_bytes(), (ref.output / "step2" / name).read_bytes()
                assert a == b, (src.name, everything, name)
    model = safe_torch_load(tmp_path / "plain_frozen_src" / "step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert model["buffer_names"] == ["scale"] and torch.equal(model["module"]["scale"], torch.full((DIM,), 0.5))
    assert list(model["frozen_param_fragments"]) == ["layers.0.weight", "layers.0.bias", "layers.1.weight",
                                                     "layers.1.bias"]
    optim = safe_torch_load(tmp_path / "plain_fp32" / "step2" / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    step = optim["optimizer_state_dict"]["optimizer_state_dict"]["state"][0]["step"]
    assert (step == 2) and (isinstance(step, int) if optimizer == "FusedAdam" else step.dtype == torch.float32)


class _RunsCode:
    """Pickles as a call that creates a marker file when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def test_a_param_group_value_that_would_run_code_is_refused_by_name_and_never_run(tmp_path):
    """The torch-free value reader takes no global at all; a value it refuses goes to torch's
    weights_only reader, which refuses it by name: nothing from the file runs, nothing is written."""
    from shardkit.checkpoint.ops.fsdp_checkpoint import save_fsdp_checkpoint

    marker = tmp_path / "ran"
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, DIM)).pow(2).mean().backward()
    opt.step()
    opt.param_groups[0]["note"] = _RunsCode(marker)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: no process group, one process (intended)
        save_fsdp_checkpoint(model, opt, tmp_path / "src", step=1)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match=r"DCP item 'optim\.param_groups\.0\.note': refused to load: it holds "
                                              r"objects outside torch's weights_only allow-list"):
        convert_to_zero3(tmp_path / "src", tmp_path / "out", world_size=2, ds_config=_ds_config(2))
    assert not marker.exists()
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
