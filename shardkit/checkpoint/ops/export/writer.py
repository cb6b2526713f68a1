"""Write safetensors shards from ``Piece``s, streaming: the header first (computed from names,
dtypes and shapes), then every piece to its byte offset. A piece already in the output dtype is
copied file to file in the kernel (``os.copy_file_range``: nothing paged into this process);
one that needs a cast is read ``CHUNK_BYTES`` at a time (``model.tensors.read_slice``), cast, and
written. Memory per writer thread is one chunk and its cast, whatever the model size.

``write_shards`` runs one thread per shard file (each thread owns whole files, so no two threads
write one file); ``stop`` is checked between chunks so Ctrl-C/SIGTERM ends the writers promptly.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shardkit.checkpoint.model.tensors import SourceTensor, read_slice
from shardkit.checkpoint.ops.export.shard_plan import Shard
from shardkit.core import progress
from shardkit.core.errors import UsageError
from shardkit.core.files import regular_fd
from shardkit.storage.safetensors_file import TensorEntry, copy_bytes, header_layout, write_header
from shardkit.storage.stream import join_pool, submit_all
from shardkit.storage.torch_load import ITEMSIZE

if TYPE_CHECKING:
    import torch

#: Bytes of source data read per cast step: large enough to amortize the syscalls, small enough
#: that a writer thread's memory stays a few tens of MB.
CHUNK_BYTES = 16 << 20

#: What a source file that ends before a piece's bytes is told to do.
_TRUNCATED = "the file is truncated; restore it from a good copy or export another checkpoint"
#: ``--dtype`` of export and consolidate -> the safetensors dtype of the floating-point tensors written.
OUTPUT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def output_dtype(dtype: str) -> str:
    """``dtype`` (an ``--dtype`` choice) as the safetensors dtype name; UsageError naming the choices."""
    if dtype not in OUTPUT_DTYPES:
        raise UsageError(f"--dtype {dtype!r}: choose one of {list(OUTPUT_DTYPES)}")
    return OUTPUT_DTYPES[dtype]


class Stopped(Exception):
    """The writers were asked to stop (the main thread is unwinding an interrupt or an error)."""


@dataclass(frozen=True)
class ShardJob:
    shard: Shard
    tensors: dict[str, SourceTensor]
    """Output name -> source tensor, for this shard's names."""
    out_dtype: str
    """torch dtype name floating-point tensors are written as; others keep theirs."""


def entry_dtype(t: SourceTensor, out_dtype: str) -> str:
    return out_dtype if t.is_float else t.dtype


class SourceFiles:
    """The source files a writer reads, each opened once (read-only) and shared by its threads: positional
    reads and ``copy_file_range`` carry their own offsets. ``close`` closes them all."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: Path) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = regular_fd(path)
            return fd

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def write_shard(path: Path, job: ShardJob, stop: threading.Event) -> int:
    """Write one shard file at ``path``; returns its size in bytes."""
    entries = {n: TensorEntry(n, entry_dtype(t, job.out_dtype), tuple(t.shape)) for n, t in job.tensors.items()}
    header, data_start = header_layout(entries)
    total = data_start + sum(e.nbytes for e in entries.values())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sources = SourceFiles()
    try:
        write_header(fd, header, total)
        for name, t in job.tensors.items():
            e = entries[name]
            write_elements(fd, data_start + e.start, t, e.dtype, sources, stop)
        os.fsync(fd)
    finally:
        os.close(fd)
        sources.close()
    return total


def write_elements(fd: int, at: int, t: SourceTensor, out: str, sources: SourceFiles, stop: threading.Event,
                   lo: int = 0, hi: int | None = None) -> int:
    """Write elements ``[lo, hi)`` (default all) of ``t`` as ``out`` into ``fd``, whose element 0 goes to
    byte ``at``; returns the pieces read (``SourceTensor.pieces_in``: only those overlapping the window)."""
    if stop.is_set():
        raise Stopped()
    hi = t.numel if hi is None else hi
    out_size = ITEMSIZE[out]
    if t.load is not None:
        _write_cast(fd, at + lo * out_size, t.load().reshape(-1)[lo:hi], out)
        return 1
    if out != t.dtype:  # a cast: CHUNK_BYTES of the source at a time, read (model.tensors.read_slice) and cast
        per = max(1, CHUNK_BYTES // ITEMSIZE[t.dtype])
        for start in range(lo, hi, per):
            if stop.is_set():
                raise Stopped()
            _write_cast(fd, at + start * out_size, read_slice(t, start, min(hi, start + per), _TRUNCATED), out)
        return sum(1 for _ in t.pieces_in(lo, hi))
    count = 0
    for p in t.pieces_in(lo, hi):
        count += 1
        copy_bytes(sources.fd(p.file), fd, p.numel * ITEMSIZE[t.dtype], p.offset, at + p.start * out_size)
    return count


def _write_cast(fd: int, at: int, tensor: "torch.Tensor", out: str) -> None:
    import torch

    flat = tensor.detach().reshape(-1)
    if flat.is_floating_point():
        flat = flat.to(getattr(torch, out))
    _pwrite_all(fd, flat.contiguous().view(torch.uint8).numpy().data, at)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done:], offset + done)
        done += n
        progress.advance(n)


def write_shards(folder: Path, jobs: list[ShardJob], workers: int) -> list[int]:
    """Write every job's shard into ``folder``, ``workers`` files at once; sizes in job order.

    The first failure stops the other writers (between chunks) and is raised; so is an interrupt
    of the main thread (Ctrl-C, or SIGTERM turned into one by the CLI) once the writers stopped.
    """
    stop = threading.Event()
    progress.expect(sum(j.shard.nbytes for j in jobs))  # the tensor bytes every shard will hold
    if workers <= 1 or len(jobs) <= 1:
        return [write_shard(folder / j.shard.filename, j, stop) for j in jobs]
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shardkit-export")
    try:
        # submitted inside the try, with an interrupt held until all are queued (stream.submit_all: one
        # landing in a thread's start left a thread the pool never joined, writing after the clean-up)
        futures = submit_all(pool, write_shard, [(folder / j.shard.filename, j, stop) for j in jobs])
        return [f.result() for f in futures]
    except BaseException:
        stop.set()  # the others stop at their next chunk; join_pool below waits for them
        raise
    finally:
        join_pool(pool)
