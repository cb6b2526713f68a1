"""The hostile sweep, the library readers and the configs: the torch-free and torch
readers (io.torch_load read_structure/safe_torch_load, readers.zero3_open, readers.zero3, dcp.plain_metadata,
dcp.slices, io.manifest, io.verify) called directly on damaged files return or raise a
ShardkitError, never anything else and never a hang; DeepSpeed configs given to ``convert --to
zero3 --ds-config`` and ``check``, and a model config.json given to ``export``, with fields of
wrong types, huge numbers, NaN or deep nesting, follow the command rule of tests/_hostile_sweep.py.
Regression tests for the reader fixes the sweep led to are at the end.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from shardkit.core.errors import CheckpointError, ShardkitError
from tests import _hostile_sweep as H
from tests.test_hostile_sweep_bytes import MUTATIONS
from tests.test_hostile_sweep_fields import DELETE, HOSTILE, paths, replaced

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("sweep_tally")]

SWEEP = settings(phases=[Phase.explicit, Phase.generate], deadline=None, derandomize=True, database=None,
                 max_examples=int(os.environ.get("HOSTILE_SWEEP_EXAMPLES", "50")),
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
READER_TIMEOUT_S = 20


def _readers(src: Path, rel: str) -> dict[str, Any]:
    """The readers that take the file ``rel`` of the checkpoint ``src``, by name."""
    from shardkit.checkpoint.dcp.plain_metadata import read_plain_metadata
    from shardkit.checkpoint.dcp.slices import DcpSlices
    from shardkit.checkpoint.readers.zero3 import read_zero3
    from shardkit.checkpoint.readers.zero3_open import open_zero3_layout
    from shardkit.storage.manifest import read_manifest
    from shardkit.storage.torch_load import read_structure, safe_torch_load
    from shardkit.storage.verify import verify_checkpoint

    f, tag = src / rel, src / rel.split("/")[0]

    def slices() -> None:
        s = DcpSlices(tag)
        try:
            for key in s.md.keys:
                s.chunks(key)
                s.value(key)
                ref = s.tensor_ref(key)
                if ref is not None and ref.is_contiguous():
                    s.read_ref(ref)
        finally:
            s.close()

    readers: dict[str, Any] = {"io.verify": lambda: verify_checkpoint(src), "io.manifest": lambda: read_manifest(tag)}
    if f.suffix == ".pt":
        readers.update({"io.torch_load.read_structure": lambda: read_structure(f),
                        "io.torch_load.safe_torch_load": lambda: safe_torch_load(f),
                        "readers.zero3_open": lambda: open_zero3_layout(tag),
                        "readers.zero3": lambda: read_zero3(tag)})
    if (tag / ".metadata").exists():
        readers.update({"dcp.plain_metadata": lambda: read_plain_metadata(tag / ".metadata"), "dcp.slices": slices})
    return readers


@SWEEP
@given(kind=st.sampled_from(H.KINDS), data=st.data())
def test_readers_on_damaged_files_return_or_name_the_problem(sweep_sources, kind, data):
    rel = data.draw(st.sampled_from([f for f in sweep_sources.files(kind) if "/" in f]), label="file")
    name = data.draw(st.sampled_from(sorted(MUTATIONS)), label="mutation")
    fn, args = data.draw(MUTATIONS[name], label="how")
    with H.case_folder(sweep_sources.base / "sweep_cases") as case_dir:
        src = sweep_sources.copy(kind, case_dir)
        fn(src / rel, *args)
        for reader, call in _readers(src, rel).items():
            try:
                with H.time_limit(READER_TIMEOUT_S, f"{reader} on {rel}"):
                    call()
                label = "returned"
            except ShardkitError as exc:
                label = f"{type(exc).__name__}: {H.message_shape('error: ' + str(exc))}"
            H.record(f"{name} ({kind})", reader, label)


# --- configs -------------------------------------------------------------------------------------


@st.composite
def hostile_configs(draw: Any, base: dict[str, Any]) -> dict[str, Any]:
    cfg = base
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["set", "delete", "nest"]))
        places = paths(cfg)
        if not places:
            break
        place = draw(st.sampled_from(places))
        if action == "nest":
            deep: Any = draw(HOSTILE)
            for _ in range(draw(st.sampled_from([2, 63, 65, 500]))):
                deep = {"x": deep}
            cfg = replaced(cfg, place, deep)
        else:
            cfg = replaced(cfg, place, DELETE if action == "delete" else draw(HOSTILE))
    return cfg


def _write_config(path: Path, cfg: dict[str, Any], as_yaml: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if as_yaml:
        import yaml

        try:
            path.write_text(yaml.safe_dump(cfg))
            return
        except (yaml.YAMLError, RecursionError):
            pass
    try:
        path.write_text(json.dumps(cfg))
    except (ValueError, RecursionError):
        path.write_text("{}")


@SWEEP
@given(data=st.data())
def test_hostile_ds_config_for_convert_to_zero3_and_check(sweep_sources, data):
    base = json.loads(sweep_sources.root("ds_config").read_text())
    cfg = data.draw(hostile_configs(base), label="config")
    command = data.draw(st.sampled_from(["convert --to zero3", "check"]), label="command")
    as_yaml = command == "check" and data.draw(st.booleans(), label="yaml")
    with H.case_folder(sweep_sources.base / "sweep_cases") as case_dir:
        ds = case_dir / ("ds.yaml" if as_yaml else "ds.json")
        _write_config(ds, cfg, as_yaml)
        if command == "check":
            done = H.run_cli(["check", ds])
            assert done.code in (0, 1, 2) and "Traceback" not in done.out + done.err, done.out + done.err
            label = f"exit {done.code}" + (f": {H.message_shape(done.err)}" if done.code == 2 else "")
        else:
            src = sweep_sources.copy("fsdp2_converted", case_dir)
            label = H.judge(sweep_sources, "fsdp2_converted", command, case_dir, src, may_differ=True, ds_config=ds)
    H.record("a DeepSpeed config field edited", command, label)


@SWEEP
@given(data=st.data())
def test_hostile_model_config_for_export(sweep_sources, data):
    base = json.loads((sweep_sources.root("model_config") / "config.json").read_text())
    cfg = data.draw(hostile_configs(base), label="config")
    kind = data.draw(st.sampled_from(["zero3_sealed", "fsdp2_converted"]), label="source")
    with H.case_folder(sweep_sources.base / "sweep_cases") as case_dir:
        _write_config(case_dir / "cfg" / "config.json", cfg, as_yaml=False)
        src = sweep_sources.copy(kind, case_dir)
        label = H.judge(sweep_sources, kind, "export", case_dir, src, may_differ=True, model_config=case_dir / "cfg")
    H.record("a model config.json field edited", "export", label)


# --- regression tests for the fixes the sweep led to ----------------------------------------------


def _edited_rank0(sweep_sources: H.Sources, tmp_path: Path, file: str, edit: Any) -> Path:
    import torch

    src = sweep_sources.copy("zero3", tmp_path)
    f = src / "global_step2" / file
    obj = torch.load(f, weights_only=False)
    edit(obj)
    torch.save(obj, f)
    return src


@pytest.mark.parametrize("value", [2**63, "2", 2.0, True, None, -3])
def test_a_dp_world_size_that_is_no_count_is_named_at_once(sweep_sources, tmp_path, value):
    from shardkit.checkpoint.readers.zero3 import read_zero3
    from shardkit.checkpoint.readers.zero3_open import open_zero3_layout

    src = _edited_rank0(sweep_sources, tmp_path, "zero_pp_rank_0_mp_rank_00_model_states.pt",
                        lambda d: d.__setitem__("dp_world_size", value))
    for read in (open_zero3_layout, lambda src: read_zero3(src / "global_step2")):
        with H.time_limit(10, "open_zero3_layout"):
            with pytest.raises(CheckpointError, match=r"model_states\.pt: dp_world_size is .*expected a positive int"
                                                      r"|rank_2_mp_rank_00_model_states\.pt: missing, but dp_world_size "
                                                      r"is 9223372036854775808 so"):
                read(src)


@pytest.mark.parametrize("value", [{}, "x", [1, 2]])
def test_a_rank_file_holding_no_tensor_where_one_belongs_is_named(sweep_sources, tmp_path, value):

    def edit(d: dict[str, Any]) -> None:
        d["optimizer_state_dict"]["fp32_flat_groups"][0] = value

    src = _edited_rank0(sweep_sources, tmp_path, "zero_pp_rank_0_mp_rank_00_optim_states.pt", edit)
    done = H.run_cli(["export", src, "-o", tmp_path / "out", "--model-config", sweep_sources.root("model_config")])
    assert done.code == 1 and "Traceback" not in done.err, done.err
    assert re.search(r"global_step2: its rank files hold a structure DeepSpeed does not write \(TypeError: a \w+ where "
                     r"a tensor belongs\)", done.err), done.err
    assert not (tmp_path / "out").exists()


def test_a_dcp_metadata_whose_chunks_do_not_fit_is_named(sweep_sources, tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from shardkit.checkpoint.dcp.safe_load import load_dcp_state

    src = sweep_sources.copy("fsdp2", tmp_path)
    tag = src / "step2"
    md = pickle.loads((tag / ".metadata").read_bytes())
    key = next(k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks") and len(v.size) == 2)
    meta = md.state_dict_metadata[key]
    meta.chunks[0] = ChunkStorageMetadata(offsets=__import__("torch").Size([0]), sizes=meta.chunks[0].sizes)
    (tag / ".metadata").write_bytes(pickle.dumps(md))
    import torch

    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
             if hasattr(v, "chunks")}
    with pytest.raises(CheckpointError, match=r"\.metadata: rank 0: torch's DCP load failed on it \(IndexError: .*\): "
                                              r"its chunks, sizes or storage entries do not describe the files"):
        load_dcp_state(state, tag)


@pytest.mark.parametrize("field, value, message", [
    ("num_hidden_layers", 10**9, r"num_hidden_layers is 1,000,000,000, more than 10,000: a typo\?"),
    ("num_attention_heads", "x", r"transformers cannot build a (config|model) from it \(\w+: "),
    ("hidden_size", None, r"transformers cannot build a (config|model) from it \(\w+: "),
])
def test_export_names_a_model_config_transformers_cannot_build(sweep_sources, tmp_path, field, value, message):
    cfg = json.loads((sweep_sources.root("model_config") / "config.json").read_text())
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps({**cfg, field: value}))
    done = H.run_cli(["export", sweep_sources.root("zero3_sealed"), "-o", tmp_path / "out", "--model-config",
                      tmp_path / "cfg"], timeout=30)
    assert done.code == 2 and "Traceback" not in done.err, done.err
    assert re.search(rf"cfg/config\.json: {message}", done.err), done.err
    assert not (tmp_path / "out").exists()
