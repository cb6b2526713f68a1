"""The hostile sweep, edited fields: a field of a manifest (digests, sizes, paths,
format_version, algorithm, duplicate or missing entries), of a DeepSpeed rank file's pickled dict
(dp_world_size, param_shapes, partition_count, ds_version, zero_stage, tensors...: re-saved with
torch.save), of a DCP ``.metadata`` (sizes, chunks, storage offsets, lengths, paths) or of
``latest`` replaced by a hostile value or deleted; hostile pickles (a global that runs code) in a
rank file and in ``.metadata``. Where the source has a manifest, an edited data file is also
re-sealed (its size and digest written into the manifest, as a buggy writer would), so the edit
reaches the readers behind verification. The per-case rule is in tests/_hostile_sweep.py.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis import strategies as st

from tests import _hostile_sweep as H

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("sweep_tally")]

# No shrinking: the first failing case is reported as drawn; derandomize: the same cases every run.
SWEEP = settings(phases=[Phase.explicit, Phase.generate], deadline=None, derandomize=True, database=None,
                 max_examples=int(os.environ.get("HOSTILE_SWEEP_EXAMPLES", "50")),
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
DELETE = object()


def _hostile_scalars() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(), st.booleans(), st.sampled_from([0, -1, 1, 2, 3, 7, 2**31, 2**63, 10**30, -(2**70)]),
        st.integers(-(2**70), 2**70), st.sampled_from([math.nan, math.inf, -math.inf, 0.5, -0.0, 1e308]),
        st.sampled_from(["", "../../etc/passwd", "/etc/passwd", "global_step2", "md5", "sha256", "blake3",
                         "0.0.1", "x" * 300, "__0_0.distcp", ".metadata", "\x00", "latest"]),
        st.text(max_size=10))


HOSTILE = st.recursive(_hostile_scalars(), lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)), max_leaves=6)


# --- structure editing ---------------------------------------------------------------------------


def _children(obj: Any) -> list[tuple[Any, Any]]:
    import torch

    if isinstance(obj, torch.Tensor):
        return []
    if isinstance(obj, dict):
        return list(obj.items())
    if isinstance(obj, (list, tuple)):
        return list(enumerate(obj))
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("torch.distributed"):
        return list(vars(obj).items())  # DCP's metadata dataclasses
    return []


def paths(obj: Any, prefix: tuple[Any, ...] = (), depth: int = 0) -> list[tuple[Any, ...]]:
    """Every place in ``obj`` a value can be edited (dict values, list/tuple items, DCP fields)."""
    out = [prefix] if prefix else []
    if depth < 6:
        for key, child in _children(obj):
            out.extend(paths(child, (*prefix, key), depth + 1))
    return out


def replaced(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    """A copy of ``obj`` with the place at ``path`` set to ``value`` (DELETE: removed); only the
    containers along the path are copied."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(obj, dict):
        new = copy.copy(obj)
        if rest or value is not DELETE:
            new[key] = replaced(obj[key], rest, value)
        else:
            del new[key]
        return new
    if isinstance(obj, (list, tuple)):
        items = list(obj)
        if rest or value is not DELETE:
            items[key] = replaced(obj[key], rest, value)
        else:
            del items[key]
        if isinstance(obj, list):
            return items
        try:
            return type(obj)(items)
        except TypeError:
            return tuple(items)
    new = copy.copy(obj)
    object.__setattr__(new, key, replaced(getattr(obj, key), rest, value) if rest or value is not DELETE else None)
    return new


def reseal(src: Path, rel: str) -> None:
    """Write ``rel``'s new size and digest into its manifest (the edit then passes verification)."""
    from shardkit.storage.manifest import file_digest

    tag, name = rel.split("/", 1)
    manifest = src / tag / H.MANIFEST
    if not manifest.is_file():
        return
    doc = json.loads(manifest.read_text())
    for entry in doc["files"]:
        if entry["path"] == name:
            entry["size"] = (src / rel).stat().st_size
            algorithm = "blake3" if "blake3" in entry else "sha256"
            entry[algorithm] = file_digest(src / rel, algorithm)
    manifest.write_text(json.dumps(doc, indent=1))


_LOADED: dict[Path, Any] = {}


def _load(path: Path) -> Any:
    """The unmodified object a source file holds (trusted: the session's own fixture), cached."""
    if path not in _LOADED:
        if path.name == ".metadata":
            with open(path, "rb") as fh:
                _LOADED[path] = pickle.load(fh)
        else:
            import torch

            _LOADED[path] = torch.load(path, weights_only=False, map_location="cpu")
    return _LOADED[path]


def _save(obj: Any, path: Path) -> None:
    if path.name == ".metadata":
        path.write_bytes(pickle.dumps(obj))
    else:
        import torch

        torch.save(obj, path)


def _tensor_values() -> st.SearchStrategy[Any]:
    import torch

    return st.sampled_from([torch.zeros(0), torch.zeros(3, dtype=torch.int8), torch.zeros(2, 2),
                            torch.zeros(1, dtype=torch.bfloat16), torch.Size([2**40]), torch.Size([-1, 3]),
                            torch.Size([]), torch.tensor(math.nan)])


# --- the sweeps ----------------------------------------------------------------------------------


def _pickled_files(sources: H.Sources, kind: str) -> list[str]:
    return [f for f in sources.files(kind) if f.endswith((".pt", ".metadata"))]


def _run(sources: H.Sources, kind: str, data: st.DataObject, mutate: Any, what: str, *, may_differ: bool) -> None:
    command = data.draw(st.sampled_from(H.commands_for(kind)), label="command")
    with H.case_folder(sources.base / "sweep_cases") as case_dir:
        src = sources.copy(kind, case_dir)
        mutate(src)
        label = H.judge(sources, kind, command, case_dir, src, may_differ=may_differ)
    H.record(f"{what} ({kind})", command, label)


@SWEEP
@given(kind=st.sampled_from(H.KINDS), data=st.data())
def test_an_edited_field_of_a_pickled_file(sweep_sources, kind, data):
    rel = data.draw(st.sampled_from(_pickled_files(sweep_sources, kind)), label="file")
    original = _load(sweep_sources.root(kind) / rel)
    path = data.draw(st.sampled_from(paths(original)), label="field")
    value = data.draw(st.one_of(st.just(DELETE), HOSTILE, _tensor_values()), label="value")

    try:
        pickle.dumps(replaced(original, path, value))
    except Exception:
        reject()  # an edit the file's own classes cannot even pickle (torch refuses a None memory_format)

    def mutate(src: Path) -> None:
        _save(replaced(original, path, value), src / rel)
        reseal(src, rel)

    what = "a .metadata field edited" if rel.endswith(".metadata") else "a rank file field edited, re-saved"
    # resealed, the manifest vouches for the edited file, as for a writer's bug: the output must
    # still verify and load, but it may carry the edit
    _run(sweep_sources, kind, data, mutate, what, may_differ=True)


@SWEEP
@given(kind=st.sampled_from([k for k in H.KINDS if k != "zero3"]), data=st.data())
def test_an_edited_manifest(sweep_sources, kind, data):
    root = sweep_sources.root(kind)
    rel = next(f for f in sweep_sources.files(kind) if f.endswith(H.MANIFEST))
    doc = json.loads((root / rel).read_text())
    action = data.draw(st.sampled_from(["set a field", "delete a field", "duplicate an entry", "drop an entry"]),
                       label="action")
    if action in ("set a field", "delete a field"):
        path = data.draw(st.sampled_from(paths(doc)), label="field")
        value = DELETE if action == "delete a field" else data.draw(HOSTILE, label="value")
        edited = replaced(doc, path, value)
    else:
        i = data.draw(st.integers(0, len(doc["files"]) - 1), label="entry")
        files = list(doc["files"])
        files[i:i + 1] = [files[i], files[i]] if action == "duplicate an entry" else []
        edited = {**doc, "files": files}

    def mutate(src: Path) -> None:
        (src / rel).write_text(json.dumps(edited))

    _run(sweep_sources, kind, data, mutate, f"manifest: {action}", may_differ=False)


LATEST = st.one_of(st.sampled_from(["", "..", ".", "/etc", "../x", "global_step2/..", "global_step2\n", " global_step2 ",
                                    "global_step2\x00", "step2", "global_step2/shardkit_manifest.json",
                                    ".shardkit-tmp-global_step2", "x" * 5000]), st.text(max_size=20))


@SWEEP
@given(kind=st.sampled_from(H.KINDS), content=LATEST, data=st.data())
def test_an_edited_latest(sweep_sources, kind, content, data):
    def mutate(src: Path) -> None:
        (src / "latest").write_bytes(content.encode("utf-8", "surrogateescape"))

    _run(sweep_sources, kind, data, mutate, "latest edited", may_differ=False)


class _RunsCode:
    """Unpickled, it would call ``fn(*args)``: what a malicious checkpoint carries."""

    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.fn, self.args


def _payloads(sentinel: Path) -> dict[str, Any]:
    import builtins
    import os
    import subprocess

    return {"os.system": _RunsCode(os.system, (f"touch {sentinel}",)),
            "builtins.exec": _RunsCode(builtins.exec, (f"open({str(sentinel)!r}, 'w')",)),
            "subprocess.call": _RunsCode(subprocess.call, (["touch", str(sentinel)],))}


@pytest.mark.parametrize("kind", H.KINDS)
@pytest.mark.parametrize("payload", ["os.system", "builtins.exec", "subprocess.call"])
def test_a_pickle_that_would_run_code_runs_nothing(sweep_sources, kind, payload):
    # A reshard to the source's own world size copies the rank files: each copied file's pickle is
    # read through the allow-list first, so a model_states file no reader parses (rank > 0) cannot
    # carry its payload into a sealed output (found by this sweep; DeepSpeed's own load would run it).
    for rel in _pickled_files(sweep_sources, kind)[:3]:
        for command in H.commands_for(kind):
            with H.case_folder(sweep_sources.base / "sweep_cases") as case_dir:
                sentinel = case_dir / "ran"
                src = sweep_sources.copy(kind, case_dir)
                evil = _payloads(sentinel)[payload]
                _save(replaced(_load(src / rel), (next(iter(_load(src / rel) if isinstance(_load(src / rel), dict)
                                                             else vars(_load(src / rel)))),), evil), src / rel)
                reseal(src, rel)
                label = H.judge(sweep_sources, kind, command, case_dir, src, may_differ=False)
                # nothing runs; an exit 0 (a file the command never reads) published an output that
                # loads with weights_only (judge's check): the payload was not carried into it
                assert not sentinel.exists(), f"{command} on {rel} with a {payload} pickle ran it"
            H.record(f"a pickle calling {payload} ({kind})", command, label)


@pytest.mark.parametrize("kind, rel, path, value, command", [
    # a model-states file whose buffer_names holds lists: a TypeError out of the ZeRO-3 reader before
    ("zero3", "global_step2/zero_pp_rank_0_mp_rank_00_model_states.pt", ("buffer_names",), [[], [], {"x": 0.0}],
     "reshard"),
    # a .metadata chunk whose first size is deleted, one left for a 2-D weight: an IndexError out of the coverage check before
    ("fsdp2_converted", "global_step2/.metadata",
     ("state_dict_metadata", "model.model.layers.1.post_attention_layernorm.weight", "chunks", 0, "sizes", 0),
     DELETE, "convert --to zero3"),
])
def test_edits_the_field_sweep_found_are_named(sweep_sources, kind, rel, path, value, command):
    """The two edits the sweep above drew that ended in a traceback, pinned: each is now a refusal naming the file
    (H.judge fails on a traceback, a hang or an output that does not verify)."""
    original = _load(sweep_sources.root(kind) / rel)
    with H.case_folder(sweep_sources.base / "sweep_cases") as case_dir:
        src = sweep_sources.copy(kind, case_dir)
        _save(replaced(original, path, value), src / rel)
        reseal(src, rel)
        H.judge(sweep_sources, kind, command, case_dir, src, may_differ=True)
