"""A FIFO, device, socket or folder where a checkpoint file belongs is refused by name, never read.

A reader that opens a FIFO waits for a writer for ever (`shardkit verify` of a plain ZeRO-3 save whose
rank 1 model file was a FIFO hung, as did verify of a DCP folder whose `.metadata` was one, inspect and
verify of a Trainer checkpoint-N whose trainer_state.json was one, inspect of a DCP folder whose
`__0_0.distcp` was one); a device streams without end. Every read now goes through
shardkit.core.files (tests/test_one_way_to_open.py holds the package to it), which opens with
O_NONBLOCK and checks the open descriptor. Here: the helper on each kind of file, then every command
that reads these folders on a FIFO in each of those places, each in a subprocess with a hard timeout
(a hang fails the test, never stalls it): exit 1, the file and "FIFO" named, nothing written.

The sources are real: DeepSpeed's own 2-rank ZeRO-3 save and its DCP conversion (the hostile sweep's,
built once per session) with the manifest removed, as torch's own DCP save has none; the Trainer
checkpoint-N is that DeepSpeed save with the Trainer's trainer_state.json beside it, as the Trainer
lays its folder out.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shardkit.core.errors import CheckpointError
from shardkit.core.files import (
    NotRegularFileError,
    copy_regular,
    fd_path,
    not_regular,
    open_regular,
    read_regular_text,
    regular_fd,
)

TAG = "global_step2"
#: A command that hangs is killed here; export imports transformers (seconds on a loaded machine).
TIMEOUT_S = 90


def _never_blocks(fn, seconds: float = 10.0):
    """``fn()``'s result or exception, run in a thread; the test fails (not hangs) if it blocks."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"blocked for {seconds} s"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]


@pytest.fixture
def specials(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    (tmp_path / "dev").symlink_to("/dev/zero")
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_bytes(b"abc")
    yield tmp_path
    sock.close()


KINDS = {
    "pipe": r"pipe: is a FIFO \(named pipe\), not a regular file, so it is not read \(reading a FIFO waits for a writer",
    "sock": r"sock: is a socket, not a regular file, so it is not read",
    "dev": r"dev \(a symlink to /dev/zero\): is a character device, not a regular file, so it is not read \(a device "
           r"can stream without end\)",
    "folder": r"folder: is a folder, not a regular file, so it is not read",
}


@pytest.mark.parametrize("name", sorted(KINDS))
def test_the_helper_refuses_each_kind_by_name_without_blocking(specials, name):
    for opener in (open_regular, regular_fd, read_regular_text, lambda p: copy_regular(p, specials / "copy")):
        with pytest.raises(NotRegularFileError, match=KINDS[name]) as info:
            _never_blocks(lambda: opener(specials / name))
        assert isinstance(info.value, CheckpointError) and not isinstance(info.value, (OSError, ValueError))
        assert str(info.value).endswith("or pass another path")  # the fix
    assert str(not_regular(specials / name)) == str(info.value)  # the same words from a stat alone
    assert not (specials / "copy").exists()


def test_the_helper_reads_a_regular_file_and_raises_open_s_own_error_for_a_missing_one(specials):
    with open_regular(specials / "file") as fh:
        assert fh.read() == b"abc" and fh.name == str(specials / "file")
    assert read_regular_text(specials / "file") == "abc" and not_regular(specials / "file") is None
    with pytest.raises(FileNotFoundError):
        open_regular(specials / "none")


def test_what_is_read_is_what_was_checked_even_when_the_path_is_swapped(tmp_path):
    """``fd_path`` names the open file itself: a FIFO swapped in at the path after the check is never read
    (torch.load(mmap=True) takes only a path; handed this one, it maps the checked file)."""
    import torch

    f = tmp_path / "t.pt"
    torch.save({"x": torch.arange(4)}, f)
    with open_regular(f) as fh:
        f.unlink()
        os.mkfifo(f)
        loaded = _never_blocks(lambda: torch.load(fd_path(fh, f), mmap=True, weights_only=True))
    assert loaded["x"].tolist() == [0, 1, 2, 3]


# --- every command on a FIFO in place of each file ------------------------------------------------


@pytest.fixture(scope="module")
def sources(sweep_sources, tmp_path_factory) -> dict[str, Path]:
    """zero3: DeepSpeed's plain save (a root); dcp: a DCP root without a manifest; trainer: an output_dir holding
    checkpoint-2."""
    base = tmp_path_factory.mktemp("special_sources")
    dcp = base / "dcp"
    shutil.copytree(sweep_sources.root("fsdp2_converted"), dcp, symlinks=True)
    (dcp / TAG / "shardkit_manifest.json").unlink()
    trainer = base / "trainer" / "checkpoint-2"
    shutil.copytree(sweep_sources.root("zero3"), trainer, symlinks=True)
    (trainer / "trainer_state.json").write_text(json.dumps({"global_step": 2, "log_history": [], "epoch": 1.0}))
    return {"zero3": sweep_sources.root("zero3"), "dcp": dcp, "trainer": trainer.parent,
            "model_config": sweep_sources.root("model_config")}


#: (source, the file a FIFO replaces, the commands that read that folder)
CASES = [
    ("zero3", f"{TAG}/zero_pp_rank_1_mp_rank_00_model_states.pt",
     ("inspect", "verify", "reshard", "consolidate", "convert", "export")),
    ("dcp", f"{TAG}/.metadata", ("inspect", "verify", "consolidate", "convert", "export")),
    ("dcp", f"{TAG}/__0_0.distcp", ("inspect", "verify", "consolidate", "convert", "export")),
    ("trainer", "checkpoint-2/trainer_state.json", ("inspect", "verify", "reshard")),
]


def _argv(command: str, kind: str, src: Path, out: Path, model_config: Path) -> list[object]:
    return {
        "inspect": ["inspect", src],
        "verify": ["verify", src, "--json"],
        "reshard": ["reshard", src, "--world-size", "3", "-o", out],
        "consolidate": ["consolidate", src, "-o", out / "model.safetensors"],
        "convert": ["convert", src, "--to", "zero3" if kind == "dcp" else "fsdp2", "-o", out,
                    *(["--world-size", "2"] if kind == "dcp" else [])],
        "export": ["export", src, "-o", out, "--model-config", model_config],
    }[command]


@pytest.mark.slow
@pytest.mark.parametrize("kind,rel,command", [(k, r, c) for k, r, cs in CASES for c in cs],
                         ids=[f"{k}-{r.rsplit('/', 1)[-1]}-{c}" for k, r, cs in CASES for c in cs])
def test_a_fifo_in_place_of_a_checkpoint_file_is_named_by_every_command(sources, tmp_path, kind, rel, command):
    src = tmp_path / "src"
    shutil.copytree(sources[kind], src, symlinks=True)
    fifo = src / rel
    fifo.unlink()
    os.mkfifo(fifo)
    out = tmp_path / "out"
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "shardkit", *map(str, _argv(command, kind, src, out,
                                                                              sources["model_config"]))],
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"shardkit {command} blocked on the FIFO {fifo} for {TIMEOUT_S} s")
    took = time.monotonic() - start
    said = done.stdout if command == "verify" else done.stderr
    if command == "verify":  # one JSON object; the table would wrap the path
        said = " ".join(f["message"] for f in json.loads(done.stdout)["findings"] if f["severity"] == "error")
    assert done.returncode == 1 and "Traceback" not in done.stderr, (took, done.stdout, done.stderr)
    assert f"{fifo}: is a FIFO (named pipe), not a regular file, so it is not read" in said, (done.stdout, done.stderr)
    assert not out.exists() or not any(out.rglob("*")), sorted(out.rglob("*"))


def test_a_dcp_load_names_a_fifo_in_place_of_a_distcp_file(tmp_path):
    """load_dcp_state (load_fsdp_checkpoint's reader) opens the .distcp files through torch's FileSystemReader,
    whose own ``path.open`` waited for ever on a FIFO: its files are opened through core.files too."""
    import torch
    import torch.distributed.checkpoint as dcp

    from shardkit.checkpoint.dcp.safe_load import load_dcp_state

    d = tmp_path / "dcp"
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(d), no_dist=True)
    (distcp,) = d.glob("*.distcp")
    distcp.unlink()
    os.mkfifo(distcp)
    with pytest.raises(CheckpointError, match=rf"{distcp}: is a FIFO \(named pipe\), not a regular file"):
        _never_blocks(lambda: load_dcp_state({"w": torch.zeros(6)}, d))
