"""safe_torch_load: weights_only loading with exactly DeepSpeed's allow-list; unsafe, truncated,
corrupted and empty files are refused with a CheckpointError naming the file (and the global)."""

from __future__ import annotations

import builtins
import os
import pickle
import pickletools
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from shardkit.core.errors import CheckpointError
from shardkit.storage.torch_load import (
    DEEPSPEED_SAFE_GLOBALS,
    DeepSpeedObjectStub,
    read_structure,
    safe_torch_load,
)
from tests import _ranks_zero3 as R


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    return R.build_sources(tmp_path_factory.getbasetemp() / "zero3")


def _rank_files(sources) -> list[Path]:
    files = []
    for label in sources.labels():  # fp16 only where this machine can train it
        files += sorted((Path(sources[label])).glob("*/*.pt"))
    return files


def _pickle_globals(path: Path) -> set[str]:
    """Every GLOBAL the file's pickle names (read with pickletools: nothing is executed)."""
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            found.add(f"{strings[-2]}.{strings[-1]}")
    return found


@pytest.mark.slow
def test_every_zero3_file_loads_weights_only_and_plain_weights_only_does_not(sources):
    files = _rank_files(sources)
    assert len(files) == 4 * len(sources.labels())  # per checkpoint: 2 ranks x (model, optim)
    for f in files:
        sd = safe_torch_load(f)
        assert isinstance(sd, dict)
    optim = [f for f in files if f.name.endswith("optim_states.pt")]
    with pytest.raises(pickle.UnpicklingError, match="ZeroStageEnum"):
        torch.load(optim[0], weights_only=True)  # why the allow-list exists


@pytest.mark.slow
def test_allow_list_is_exactly_what_deepspeed_zero3_checkpoints_hold(sources):
    non_torch = set()
    for f in _rank_files(sources):
        non_torch |= {g for g in _pickle_globals(f) if not g.startswith(("torch.", "collections.OrderedDict"))}
    # bf16/fp32 save a LossScaler, fp16 a DynamicLossScaler; ZeRO-1/2's fragment_address is the only other entry
    expected = set(DEEPSPEED_SAFE_GLOBALS) - {"deepspeed.utils.tensor_fragment.fragment_address"}
    if not sources.available("fp16"):  # no fp16 checkpoint on this machine to hold a DynamicLossScaler
        expected -= {"deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"}
    assert non_torch == expected


@pytest.mark.slow
def test_reading_never_imports_deepspeed_unless_real_objects_are_asked_for(sources, python_exe):
    optim = sorted(Path(sources["fp16"]).glob("*/*optim_states.pt"))[0]
    code = (
        "import sys; from shardkit.storage.torch_load import safe_torch_load\n"
        f"sd = safe_torch_load({str(optim)!r}, mmap=True)['optimizer_state_dict']\n"
        "assert 'deepspeed' not in sys.modules, 'deepspeed was imported'\n"
        "print(sd['zero_stage'].value, sd['loss_scaler'].cur_scale)\n"
    )
    out = subprocess.run([python_exe, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "256"]  # ZeRO stage 3, fp16 initial_scale_power 8

    real = safe_torch_load(optim, real_deepspeed_objects=True)["optimizer_state_dict"]
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    assert real["zero_stage"] is ZeroStageEnum.weights
    assert isinstance(real["loss_scaler"], DynamicLossScaler) and real["loss_scaler"].cur_scale == 256


def test_stub_objects_refuse_to_be_saved_again(tmp_path):
    stub = DeepSpeedObjectStub(3)
    with pytest.raises(TypeError, match="inert stand-in"):
        pickle.dumps(stub)


class _RunsCode:
    """A pickle payload that runs ``func(*args)`` when unpickled by an unrestricted loader."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


@pytest.mark.parametrize(
    "func, global_name",
    [(os.system, "posix.system"), (builtins.exec, "builtins.exec"), (subprocess.call, r"(subprocess|commands)\.call")],
    ids=["os.system", "exec", "subprocess.call"],
)
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_pickle_that_would_run_code_is_refused_without_running_it(tmp_path, func, global_name, legacy):
    marker = tmp_path / "ran"
    cmd = f"touch {marker}" if func is not builtins.exec else f"open({str(marker)!r}, 'w').close()"
    payload = _RunsCode(func, ["touch", str(marker)]) if func is subprocess.call else _RunsCode(func, cmd)
    # hidden inside an otherwise ordinary DeepSpeed-shaped model-states dict (as client state)
    state = {"module": {"w": torch.zeros(2)}, "dp_world_size": 2, "my_client_state": payload}
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    torch.save(state, path, _use_new_zipfile_serialization=not legacy)
    with pytest.raises(CheckpointError, match=rf"{path}: refused to load: .*global '{global_name}'") as info:
        safe_torch_load(path)
    assert not marker.exists(), "the payload ran"
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no raw unpickling traceback
    if not legacy:  # the torch-free structure reader refuses it the same way
        with pytest.raises(CheckpointError, match=rf"{path}: refused to load: .*global '(posix|builtins|subprocess|commands)\.(system|exec|call)'"):
            read_structure(path)
        assert not marker.exists(), "the payload ran"


def test_extra_globals_lets_a_trusted_class_through(tmp_path):
    import argparse

    path = tmp_path / "megatron_style.pt"
    torch.save({"args": argparse.Namespace(lr=0.1)}, path)
    with pytest.raises(CheckpointError, match="argparse.Namespace"):
        safe_torch_load(path)
    assert safe_torch_load(path, extra_globals=[argparse.Namespace])["args"].lr == 0.1


@pytest.fixture
def good_file(tmp_path) -> tuple[Path, bytes]:
    path = tmp_path / "good.pt"
    torch.save({"fp32_flat_groups": [torch.arange(4096, dtype=torch.float32)], "step": 3}, path)
    return path, path.read_bytes()


@pytest.mark.parametrize("cut", [0.5, 0.9, 0.01])
def test_truncated_file_names_the_file(tmp_path, good_file, cut):
    _, data = good_file
    bad = tmp_path / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    bad.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(CheckpointError, match=rf"{bad}: .*(truncated or corrupted|refused to load)"):
        safe_torch_load(bad)


def test_empty_file_names_the_file(tmp_path):
    bad = tmp_path / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    bad.write_bytes(b"")
    with pytest.raises(CheckpointError, match=rf"{bad}: checkpoint file is empty \(0 bytes\)"):
        safe_torch_load(bad)


def test_missing_file_and_directory_name_the_path(tmp_path):
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'nope.pt'}: checkpoint file does not exist"):
        safe_torch_load(tmp_path / "nope.pt")
    with pytest.raises(CheckpointError, match=rf"{tmp_path}: is a directory"):
        safe_torch_load(tmp_path)


def test_corrupted_pickle_and_garbage_name_the_file(tmp_path, good_file):
    _, data = good_file
    corrupt = bytearray(data)
    at = corrupt.find(b"data.pkl") + 60
    corrupt[at : at + 40] = b"\xff" * 40
    bad = tmp_path / "corrupt.pt"
    bad.write_bytes(bytes(corrupt))
    with pytest.raises(CheckpointError, match=rf"{bad}: "):
        safe_torch_load(bad)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(os.urandom(4096))
    with pytest.raises(CheckpointError, match=rf"{garbage}: "):
        safe_torch_load(garbage)


@pytest.mark.slow
def test_structure_reader_finds_every_tensor_in_the_file(sources):
    for f in _rank_files(sources):
        refs = read_structure(f)
        real = safe_torch_load(f)
        if "optimizer_state_dict" not in real:
            assert refs["param_shapes"][0] == {k: tuple(v) for k, v in real["param_shapes"][0].items()}
            continue
        for ref, t in zip(refs["optimizer_state_dict"]["fp32_flat_groups"], real["optimizer_state_dict"]["fp32_flat_groups"]):
            assert ref.shape == tuple(t.shape) and ref.dtype == "float32"
            with open(f, "rb") as fh:
                fh.seek(ref.file_offset)
                assert fh.read(t.numel() * 4) == t.detach().numpy().tobytes()


def test_structure_reader_names_a_truncated_file(tmp_path, good_file):
    _, data = good_file
    bad = tmp_path / "cut.pt"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{bad}: cannot be read as a torch checkpoint"):
        read_structure(bad)


def test_mmap_load_reads_the_same_values(good_file):
    path, _ = good_file
    a = safe_torch_load(path)
    b = safe_torch_load(path, mmap=True)
    assert torch.equal(a["fp32_flat_groups"][0], b["fp32_flat_groups"][0]) and b["step"] == 3


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


# ---- torch.distributed.checkpoint (FSDP2) directories ---------------------------------------------


class _MakesMarker:
    """Pickles as a call that creates a marker file when unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _dcp_dir(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    d = tmp_path / "dcp"
    dcp.save({"w": torch.arange(6.0), "lr": 0.25}, checkpoint_id=str(d), no_dist=True)
    return d


def test_dcp_state_loads_through_the_safe_reader(tmp_path):
    from shardkit.checkpoint.dcp.safe_load import load_dcp_state

    d = _dcp_dir(tmp_path)
    state = {"w": torch.zeros(6), "lr": 0.0}
    load_dcp_state(state, d)
    assert torch.equal(state["w"], torch.arange(6.0)) and state["lr"] == 0.25


def test_poisoned_dcp_metadata_is_refused_without_running_it(tmp_path):
    from shardkit.checkpoint.dcp.safe_load import load_dcp_state

    d = _dcp_dir(tmp_path)
    marker = tmp_path / "ran"
    (d / ".metadata").write_bytes(pickle.dumps(_MakesMarker(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata: refused to load: .*global builtins\.exec"):
        load_dcp_state({"w": torch.zeros(6), "lr": 0.0}, d)
    assert not marker.exists()


def test_dcp_bytes_item_that_would_run_code_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    from shardkit.checkpoint.dcp.safe_load import load_dcp_state

    marker = tmp_path / "ran"
    d = tmp_path / "dcp"
    dcp.save({"w": torch.arange(6.0), "obj": _MakesMarker(marker)}, checkpoint_id=str(d), no_dist=True)
    with pytest.raises(CheckpointError, match=r"DCP item 'obj': refused to load"):
        load_dcp_state({"w": torch.zeros(6), "obj": None}, d)
    assert not marker.exists()



def test_a_file_this_user_cannot_read_is_named_as_a_permission_problem_not_as_damage(tmp_path, monkeypatch):
    """A rank file another user saved with mode 600 must not be reported as "truncated or corrupted, re-copy
    it". chmod 000 stops every user but root; as root (this sandbox: the interpreter itself lives under
    /root, so a child cannot drop to another user) the permission check is told the file is unreadable."""
    from shardkit.storage import checkpoint_file

    f = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"w": torch.ones(4)}, f)
    f.chmod(0)
    if os.geteuid() == 0:
        real = os.access
        monkeypatch.setattr(checkpoint_file.os, "access", lambda p, mode: False if Path(p) == f else real(p, mode))
    for read in (read_structure, safe_torch_load):
        with pytest.raises(CheckpointError) as err:
            read(f)
        text = str(err.value)
        assert f"{f}: permission denied" in text and "chmod a+r" in text and "corrupted" not in text, text
