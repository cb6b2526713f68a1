"""The hostile sweep's shared pieces (tests/test_hostile_sweep_*.py): the real sources built once
per session, the commands run on copies of them in this process, the per-case rule and the tally.

The per-case rule (docs/reliability.md, "The hostile sweep"): exit 0, 1 or 2; no traceback (in
process: no exception other than SystemExit leaves ``shardkit.cli.main``); done within
``CASE_TIMEOUT_S`` (a SIGALRM in the main thread interrupts a blocked read); and a command that
exits 0 with an output published an output that ``shardkit verify`` passes (a folder) or that loads
(a safetensors file) and whose tensors equal what the same command writes from the unmodified
source. The one exception: a source without a manifest gives no way to see a changed byte, so
there the output must still verify and load, but its values (and, after a field edit, its layout)
may follow the edit; the tally says which.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CASE_TIMEOUT_S = 60
TALLY_ENV = "HOSTILE_SWEEP_TALLY"  # a file the tally is appended to (scripts/hostile_sweep_tally.py)
MANIFEST = "shardkit_manifest.json"
ZERO3_KINDS = ("zero3", "zero3_sealed")
DCP_KINDS = ("fsdp2", "fsdp2_converted")
KINDS = (*ZERO3_KINDS, *DCP_KINDS)
COMMANDS = {
    "zero3": ("verify", "reshard", "consolidate", "convert --to fsdp2", "export"),
    "fsdp2": ("verify", "convert --to zero3", "export"),
}
TALLY: Counter[tuple[str, str, str]] = Counter()


class Hang(BaseException):
    """Raised in the main thread when a case outlives CASE_TIMEOUT_S (not an Exception: no
    ``except Exception`` in the code under test may swallow it)."""


@dataclass
class Outcome:
    code: int
    out: str
    err: str
    seconds: float


@contextlib.contextmanager
def time_limit(seconds: float, what: str) -> Any:
    """Raise Hang in the main thread after ``seconds`` (PEP 475: a blocked read is interrupted)."""
    def on_alarm(signum: int, frame: Any) -> None:
        raise Hang(f"{what}: still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_cli(argv: list[Any], timeout: float = CASE_TIMEOUT_S) -> Outcome:
    """``shardkit.cli.main(argv)`` in this process, its output captured; an exception other than
    SystemExit propagates (the test fails with it: that is a traceback a user would see)."""
    from shardkit.cli import main

    args = [str(a) for a in argv]
    out, err = io.StringIO(), io.StringIO()
    sigterm = signal.getsignal(signal.SIGTERM)
    start = time.monotonic()
    try:
        with time_limit(timeout, f"shardkit {' '.join(args)}"), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code if isinstance(exc.code, int) else 2
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    return Outcome(int(code), out.getvalue(), err.getvalue(), time.monotonic() - start)


_DIGEST = re.compile(r"\b[0-9a-f]{40,}\b")
_PATH = re.compile(r"(/[^\s:'\"),]+)+")
_NUMBER = re.compile(r"\d[\d,._]*")


def message_shape(text: str) -> str:
    """The first error line of ``text`` (of a ``--json`` report: its first error's rule and message)
    with paths, digests and numbers generalized, for the tally."""
    if text.lstrip().startswith("{"):
        findings = [f for f in json.loads(text).get("findings", []) if f["severity"] == "error"]
        text = f"error: [{findings[0]['rule']}] {findings[0]['message']}" if findings else text
    lines = [ln for ln in text.splitlines() if "error:" in ln] or [ln for ln in text.splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    line = line.split("error:", 1)[-1].strip()
    line = _NUMBER.sub("N", _PATH.sub("<path>", _DIGEST.sub("<digest>", line)))
    return line[:110]


def record(kind: str, command: str, label: str) -> None:
    TALLY[(kind, command, label)] += 1


def write_tally() -> None:
    """Append this process's tally to $HOSTILE_SWEEP_TALLY (one JSON line per key) and clear it."""
    target = os.environ.get(TALLY_ENV)
    if target and TALLY:
        with open(target, "a") as fh:
            for (kind, command, label), n in sorted(TALLY.items()):
                fh.write(json.dumps({"mutation": kind, "command": command, "outcome": label, "cases": n}) + "\n")
    TALLY.clear()


# --- sources -----------------------------------------------------------------------------------


class Sources:
    """The real checkpoints the sweep mutates, built on first use, once per session.

    ``zero3``: DeepSpeed's own 2-rank ZeRO-3 save (no manifest; shared with tests/_ranks_zero3's
    other users of the same base). ``zero3_sealed``: it resharded to 3 ranks by shardkit (a
    manifest). ``fsdp2``: a real 2-rank FSDP2 save (DCP, manifest). ``fsdp2_converted``: ``convert
    --to fsdp2`` of ``zero3`` (DCP, manifest). ``model_config``: the tiny Llama's config.json, for
    export. ``ds_config``: a DeepSpeed config for ``convert --to zero3``.
    """

    def __init__(self, base: Path) -> None:
        self.base = base
        self._roots: dict[str, Path] = {}
        self._references: dict[tuple[str, str], Any] = {}

    def root(self, kind: str) -> Path:
        if kind not in self._roots:
            self._roots[kind] = self._build(kind)
        return self._roots[kind]

    def _build(self, kind: str) -> Path:
        from tests import _ranks_zero3 as R
        from tests._fixtures_shared import built_once

        if kind == "zero3":
            return Path(R.build_sources(self.base / "zero3")["fp32"])
        out = self.base / f"sweep_{kind}"
        built_once(out, lambda folder: self._save(kind, folder))  # once per run, for both xdist workers
        return out / "ds.json" if kind == "ds_config" else out

    def _save(self, kind: str, out: Path) -> None:
        from tests import _ranks_zero3 as R

        if kind == "zero3_sealed":
            from shardkit.checkpoint.ops.reshard import reshard_checkpoint

            reshard_checkpoint(self.root("zero3"), out, 3)
        elif kind == "fsdp2_converted":
            from shardkit.checkpoint.ops.convert.to_dcp import convert_to_dcp

            convert_to_dcp(self.root("zero3"), out, warn=lambda _: None)
        elif kind == "fsdp2":
            from shardkit.run.spawn.process import run_ranks
            from tests import _ranks_ckpt

            run_ranks(_ranks_ckpt.fsdp_train_save_continue, 2, args=(str(out), str(self.base / "fsdp2.safetensors")),
                      timeout=300, backend="gloo")
        elif kind == "model_config":
            from shardkit.engines.model_factory import tiny_llama

            tiny_llama("tiny").config.save_pretrained(out)
        elif kind == "ds_config":
            out.mkdir(parents=True)
            (out / "ds.json").write_text(json.dumps(R.ds_config("fp32", False, 2)))

    def files(self, kind: str) -> list[str]:
        """Every regular file of the source, relative to its root (``latest`` included)."""
        root = self.root(kind)
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

    def copy(self, kind: str, case_dir: Path) -> Path:
        dst = case_dir / "src"
        shutil.copytree(self.root(kind), dst, symlinks=True)
        return dst

    def command(self, name: str, src: Path, case_dir: Path, *, ds_config: Path | None = None,
                model_config: Path | None = None) -> tuple[list[Any], Path | None]:
        """argv of ``name`` on ``src`` and the output it publishes (None: verify); ``ds_config`` and
        ``model_config`` replace the session's own (a hostile config's sweep)."""
        if name == "verify":
            return ["verify", src, "--json"], None
        if name == "reshard":
            return ["reshard", src, "--world-size", "3", "-o", case_dir / "out"], case_dir / "out"
        if name == "consolidate":
            return ["consolidate", src, "-o", case_dir / "model.safetensors"], case_dir / "model.safetensors"
        if name == "convert --to fsdp2":
            return ["convert", src, "--to", "fsdp2", "-o", case_dir / "out"], case_dir / "out"
        if name == "convert --to zero3":
            return (["convert", src, "--to", "zero3", "--world-size", "2", "--ds-config", ds_config or self.root("ds_config"),
                     "-o", case_dir / "out"], case_dir / "out")
        if name == "export":
            return ["export", src, "-o", case_dir / "out", "--model-config", model_config or self.root("model_config")], case_dir / "out"
        raise KeyError(name)

    def reference(self, kind: str, name: str) -> dict[str, tuple[str, tuple[int, ...], str]]:
        """The tensors ``name`` writes from the unmodified ``kind`` (computed once)."""
        key = (kind, name)
        if key not in self._references:
            with case_folder(self.base) as case_dir:
                argv, output = self.command(name, self.copy(kind, case_dir), case_dir)
                done = run_cli(argv)
                assert done.code == 0 and output is not None, f"the unmodified {kind} fails {name}: {done.err}"
                self._references[key] = tensors_of(output)
        return self._references[key]


_SOURCES: dict[Path, Sources] = {}


def sources_for(base: Path) -> Sources:
    """One Sources per base folder for the whole session (every sweep module's fixture shares it); the
    folder both xdist workers share, so each source is built once per run."""
    from tests._fixtures_shared import across_workers

    base = across_workers(base)
    if base not in _SOURCES:
        _SOURCES[base] = Sources(base)
    return _SOURCES[base]


@contextlib.contextmanager
def case_folder(base: Path) -> Any:
    base.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="case-", dir=base))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# --- outputs -----------------------------------------------------------------------------------


def _flatten(obj: Any, prefix: str, out: dict[str, Any]) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}/{k}", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}/{i}", out)


def tensors_of(output: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """Every tensor an output holds: name -> (dtype, shape, sha256 of its bytes)."""
    import torch

    found: dict[str, Any] = {}
    if output.is_file():
        from safetensors.torch import load_file

        found = dict(load_file(output))
    else:
        tag = output / (output / "latest").read_text().strip() if (output / "latest").is_file() else output
        if (tag / ".metadata").is_file():
            import warnings

            from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
                _flatten(_load_state_dict_from_keys(checkpoint_id=str(tag)), "", found)
        for f in sorted(tag.iterdir()):
            if f.suffix == ".pt":
                from shardkit.storage.torch_load import safe_torch_load

                _flatten(safe_torch_load(f), f.name, found)
            elif f.suffix == ".safetensors":
                from safetensors.torch import load_file

                found.update({f"{f.name}/{k}": v for k, v in load_file(f).items()})
    return {k: (str(v.dtype), tuple(v.shape), hashlib.sha256(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                                                               .tobytes()).hexdigest() if v.numel() else "")
            for k, v in found.items()}


def judge(sources: Sources, kind: str, name: str, case_dir: Path, src: Path, *, may_differ: bool,
          label_prefix: str = "", **configs: Path) -> str:
    """Run ``name`` on the mutated ``src`` and apply the per-case rule; returns the tally label."""
    argv, output = sources.command(name, src, case_dir, **configs)
    done = run_cli(argv)
    text = done.out + done.err
    assert done.code in (0, 1, 2), f"exit {done.code} from {argv}:\n{text}"
    assert "Traceback" not in text, f"a traceback from {argv}:\n{text}"
    if done.code != 0:
        report = done.out if done.out.lstrip().startswith("{") else done.err or done.out
        return f"{label_prefix}exit {done.code}: {message_shape(report)}"
    if output is None:
        return f"{label_prefix}exit 0 (verify passed)"
    assert output.exists(), f"exit 0 from {argv} but nothing at {output}:\n{text}"
    if output.is_dir():
        check = run_cli(["verify", output])
        assert check.code == 0, f"{argv} published {output}, which fails verify:\n{check.out}{check.err}"
    got, want = tensors_of(output), sources.reference(kind, name)
    if got == want:
        return f"{label_prefix}exit 0: output verifies, tensors equal the unmodified source's"
    assert may_differ, f"{argv} published tensors that differ from the unmodified source's: " \
                       f"{sorted(set(got.items()) ^ set(want.items()))[:4]}"
    same_layout = {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in want.items()}
    return f"{label_prefix}exit 0: output verifies; {'values' if same_layout else 'layout'} follow the unverifiable edit"


def commands_for(kind: str) -> tuple[str, ...]:
    return COMMANDS["zero3" if kind in ZERO3_KINDS else "fsdp2"]


def has_manifest(sources: Sources, kind: str) -> bool:
    """Whether the source has a shardkit manifest (a changed byte of a listed file must then be caught)."""
    return any(sources.root(kind).glob(f"*/{MANIFEST}"))

