"""shardkit's streaming torch-zip writer: the bytes torch.save writes, hashed while written, lazy
tensors copied from byte ranges of other files through a small buffer."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from shardkit.storage.stream import LazyTensor, Segment, copy_file_hashed, stream_save

SID = ".data/serialization_id"  # random per save in torch too


def _state() -> dict:
    base = torch.arange(100, dtype=torch.int64)
    return {
        "fp32": torch.randn(10),
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "empty": torch.empty(0),
        "views": [base[3:7], base[10:20]],  # one storage, saved once
        "nested": {"step": 5, "lr": 1e-3, "t": torch.zeros(2, 3)},
    }


def test_the_file_is_torch_saves_record_for_record(tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "mine").mkdir()
    sd = _state()
    torch.save(sd, tmp_path / "torch" / "x.pt")
    stream_save(sd, tmp_path / "mine" / "x.pt")
    ref, mine = zipfile.ZipFile(tmp_path / "torch" / "x.pt"), zipfile.ZipFile(tmp_path / "mine" / "x.pt")
    a, b = ref.infolist(), mine.infolist()
    assert [i.filename for i in a] == [i.filename for i in b]
    for x, y in zip(a, b):
        # same offsets (alignment padding), flags (data descriptors, none for empty records), extras
        assert (x.header_offset, x.file_size, x.flag_bits, x.extra) == (y.header_offset, y.file_size, y.flag_bits, y.extra), x.filename
        if not x.filename.endswith(SID):
            assert ref.read(x) == mine.read(y) and x.CRC == y.CRC, x.filename
    assert (tmp_path / "torch" / "x.pt").stat().st_size == (tmp_path / "mine" / "x.pt").stat().st_size
    assert mine.testzip() is None  # every crc32 is right
    for mmap in (False, True):
        loaded = torch.load(tmp_path / "mine" / "x.pt", mmap=mmap, weights_only=True)
        assert torch.equal(loaded["fp32"], sd["fp32"]) and torch.equal(loaded["views"][1], sd["views"][1])
        assert loaded["views"][0].untyped_storage().data_ptr() == loaded["views"][1].untyped_storage().data_ptr()
        assert loaded["nested"]["step"] == 5 and loaded["empty"].numel() == 0


def _blake3(data: bytes) -> str:
    import blake3

    return blake3.blake3(data).hexdigest()


def test_the_returned_digest_is_the_digest_of_the_bytes_on_disk(tmp_path):
    written = stream_save(_state(), tmp_path / "x.pt")
    data = (tmp_path / "x.pt").read_bytes()
    import blake3

    assert written.size == len(data) and written.algorithm == "blake3"
    assert written.digest == blake3.blake3(data).hexdigest()


def test_lazy_segments_are_copied_from_other_files_and_zero_runs(tmp_path):
    src = torch.randn(1000)
    (tmp_path / "src.bin").write_bytes(b"header" + src.numpy().tobytes())
    path = str(tmp_path / "src.bin")
    segs = [Segment(path, 6, 400), Segment(None, 0, 40), Segment(path, 406, 3600)]
    lazy = LazyTensor(1010, torch.float32, lambda: torch.zeros(0), lambda: segs)
    # a 96-byte buffer: every segment crosses buffer boundaries
    written = stream_save({"t": lazy, "n": 3}, tmp_path / "x.pt", chunk_bytes=96)
    assert zipfile.ZipFile(tmp_path / "x.pt").testzip() is None
    assert written.digest == _blake3((tmp_path / "x.pt").read_bytes())
    t = torch.load(tmp_path / "x.pt", weights_only=True)["t"]
    assert torch.equal(t[:100], src[:100]) and not t[100:110].any() and torch.equal(t[110:], src[100:])


def test_segments_must_add_up_and_a_short_source_is_named(tmp_path):
    (tmp_path / "src.bin").write_bytes(bytes(100))
    path = str(tmp_path / "src.bin")
    wrong = LazyTensor(10, torch.float32, lambda: torch.zeros(0), lambda: [Segment(path, 0, 36)])
    with pytest.raises(RuntimeError, match=r"record data/0: segments hold 36 bytes, expected 40"):
        stream_save({"t": wrong}, tmp_path / "a.pt")
    short = LazyTensor(30, torch.float32, lambda: torch.zeros(0), lambda: [Segment(path, 0, 120)])
    with pytest.raises(OSError, match=r"ended at byte 100, 20 bytes short of the tensor data") as short_read:
        stream_save({"t": short}, tmp_path / "b.pt")
    assert short_read.value.filename == path  # the CLI's OSError line names the file by it


def test_a_lazy_tensor_without_segments_is_produced_whole(tmp_path):
    lazy = LazyTensor(4, torch.float32, lambda: torch.arange(4, dtype=torch.float32))
    stream_save([lazy], tmp_path / "x.pt")
    assert torch.equal(torch.load(tmp_path / "x.pt", weights_only=True)[0], torch.arange(4, dtype=torch.float32))


def test_copy_file_hashed_is_a_new_file_never_a_link(tmp_path):
    src = tmp_path / "a.pt"
    src.write_bytes(os.urandom(3 << 20) + b"tail")
    written = copy_file_hashed(src, tmp_path / "b.pt", chunk_bytes=1 << 20)
    copy = tmp_path / "b.pt"
    assert copy.read_bytes() == src.read_bytes() and written.size == src.stat().st_size
    assert written.digest == _blake3(src.read_bytes())
    assert copy.stat().st_ino != src.stat().st_ino and src.stat().st_nlink == 1
    with pytest.raises(FileExistsError):
        copy_file_hashed(src, copy)  # never overwrites
    assert Path(copy).read_bytes() == src.read_bytes()


def test_deepspeed_stand_ins_are_written_back_under_deepspeeds_names(tmp_path):
    """A reshard never imports DeepSpeed: the loss scaler and ZeroStageEnum read as safe_load's inert
    stand-ins pickle to the same opcodes the real objects do."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from shardkit.storage.torch_load import DeepSpeedObjectStub, safe_torch_load

    real = {"zero_stage": ZeroStageEnum(3), "loss_scaler": LossScaler(scale=4.0), "t": torch.ones(2)}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    torch.save(real, tmp_path / "a" / "x.pt")
    stubs = safe_torch_load(tmp_path / "a" / "x.pt")
    assert isinstance(stubs["loss_scaler"], DeepSpeedObjectStub)
    stream_save(stubs, tmp_path / "b" / "x.pt")
    assert zipfile.ZipFile(tmp_path / "a" / "x.pt").read("x/data.pkl") == zipfile.ZipFile(tmp_path / "b" / "x.pt").read("x/data.pkl")
    back = safe_torch_load(tmp_path / "b" / "x.pt", real_deepspeed_objects=True)
    assert back["zero_stage"] is ZeroStageEnum(3) and vars(back["loss_scaler"]) == vars(real["loss_scaler"])


def test_zip64_records_and_offsets_are_read_by_torch_and_zipfile(tmp_path, monkeypatch):
    """Every rank file above 4 GiB takes the zip64 branches (a record or its offset >= 4 GiB). The
    threshold is lowered to 1000 bytes so they run here on a few KB: the small first records stay
    32-bit, the rest are zip64 by size, by offset or both (local extra, 64-bit data descriptor,
    central directory sentinel + extra, end record)."""
    import struct

    import shardkit.storage.torch_zip as torch_zip

    monkeypatch.setattr(torch_zip, "ZIP64_AT", 1000)
    src = torch.randn(600)
    (tmp_path / "src.bin").write_bytes(src.numpy().tobytes())
    lazy = LazyTensor(700, torch.float32, lambda: torch.zeros(0),
                      lambda: [Segment(str(tmp_path / "src.bin"), 0, 2400), Segment(None, 0, 400)])
    sd = {"small": torch.arange(3, dtype=torch.int64), "big": torch.randn(2000), "lazy": lazy, "step": 7}
    written = stream_save(sd, tmp_path / "x.pt", chunk_bytes=512)
    raw = (tmp_path / "x.pt").read_bytes()
    assert written.size == len(raw) and written.digest == _blake3(raw)
    zf = zipfile.ZipFile(tmp_path / "x.pt")
    assert zf.testzip() is None  # every crc32, read through the zip64 sizes and offsets
    kinds = set()
    for info in zf.infolist():
        big_size, big_offset = info.file_size >= 1000, info.header_offset >= 1000
        kinds.add((big_size, big_offset))
        # central directory: the 0xFFFFFFFF sentinels with the real values in the zip64 extra
        assert info.extra.startswith(struct.pack("<H", 1)) == (big_size or big_offset), info.filename
        # local header -> data -> data descriptor, 64-bit where the record is zip64
        name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
        data = info.header_offset + 30 + name_len + extra_len
        assert data % 64 == 0 and raw[data:data + info.file_size] == zf.read(info)
        if info.file_size:
            fmt = "<IIQQ" if big_size or big_offset else "<IIII"
            assert struct.unpack_from(fmt, raw, data + info.file_size) == (0x08074B50, info.CRC, info.file_size, info.file_size)
    assert {(False, False), (True, True), (False, True)} <= kinds
    for mmap in (False, True):
        loaded = torch.load(tmp_path / "x.pt", mmap=mmap, weights_only=True)
        assert torch.equal(loaded["big"], sd["big"]) and torch.equal(loaded["small"], sd["small"]) and loaded["step"] == 7
        assert torch.equal(loaded["lazy"][:600], src) and not loaded["lazy"][600:].any()


def test_write_parallel_fsyncs_each_file_keeps_order_and_cancels_after_the_first_failure(tmp_path, monkeypatch):
    import threading
    import time

    import shardkit.storage.stream as stream
    from shardkit.storage.stream import write_parallel

    synced: list[Path] = []
    real_fsync = stream.fsync_file
    monkeypatch.setattr(stream, "fsync_file", lambda p: (synced.append(Path(p)), real_fsync(p)))
    jobs = [(tmp_path / f"{i}.pt", lambda p, i=i: stream_save({"i": torch.full((i + 1,), i)}, p)) for i in range(5)]
    digests = write_parallel(jobs, 3, outcome="nothing kept")
    assert [d.digest for d in digests] == [_blake3(p.read_bytes()) for p, _ in jobs]
    assert sorted(synced) == sorted(p for p, _ in jobs)  # each file fsynced by the thread that wrote it

    started: list[int] = []
    lock = threading.Lock()

    def job(i: int):
        def write(p: Path):
            with lock:
                started.append(i)
            if i == 0:
                raise OSError("rank 0 failed")
            time.sleep(0.3)  # still writing when rank 0 fails: the queued jobs must not start
            return stream_save({"i": i}, p)
        return write

    with pytest.raises(OSError, match="rank 0 failed"):
        write_parallel([(tmp_path / f"f{i}.pt", job(i)) for i in range(12)], 2, outcome="nothing kept")
    # the two first jobs, at most one more per thread that was free before the cancel: never all 12
    assert len(started) <= 4 and 0 in started


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failed_write_without_a_file_name_is_named_by_its_file(tmp_path, workers):
    """A write or fsync on an open descriptor fails without a file name (EIO); the error the user
    sees must still say which file (os_errors_named turns it into one CheckpointError line)."""
    import errno

    from shardkit.core.errors import CheckpointError
    from shardkit.storage.atomic import os_errors_named
    from shardkit.storage.stream import write_parallel

    def broken(p: Path):
        raise OSError(errno.EIO, "Input/output error")

    @os_errors_named("converting the checkpoint")
    def convert() -> None:
        write_parallel([(tmp_path / "ok.pt", lambda p: stream_save({"i": 1}, p)),
                        (tmp_path / "bad.pt", broken)], workers, outcome="nothing kept")

    with pytest.raises(CheckpointError, match=r"bad\.pt: converting the checkpoint failed \(OSError: Input/output error\)"):
        convert()


@pytest.mark.slow
def test_the_fast_crc32_is_zlib_s_crc32():
    """torch_zip takes ISA-L's crc32 when installed: it must give zlib's values (the zip format's
    CRC-32), chained over chunks of any size, or every record's crc would be wrong."""
    import os
    import zlib

    from shardkit.storage import torch_zip

    data = memoryview(os.urandom(3 * (1 << 20) + 12345))
    for cut in (1, 4096, 1 << 20, 777_777):
        fast = slow = 0
        for at in range(0, len(data), cut):
            fast, slow = torch_zip.crc32(data[at : at + cut], fast), zlib.crc32(data[at : at + cut], slow)
        assert fast == slow == zlib.crc32(data)
    assert torch_zip.crc32(b"") == 0


def test_several_produced_tensors_in_one_file_pickle_as_torch_save_does(tmp_path):
    """LazyTensors (stream_save) and NewTensors (torch_pickle, the torch-free writers) in one file:
    each gets its own size and stride tuples, as torch's do. A shared ``(1,)`` constant was memoized
    and written as a back-reference torch.save never writes (loaded the same, but not its bytes)."""
    from shardkit.storage.torch_pickle import NewTensor, pickle_structure
    from shardkit.storage.torch_zip import write_torch_zip

    tensors = [torch.arange(4.0), torch.arange(3.0), torch.empty(0), torch.ones(2)]
    raw = tmp_path / "raw.bin"
    raw.write_bytes(b"".join(t.numpy().tobytes() for t in tensors))
    news, at = [], 0
    for t in tensors:
        n = t.numel() * 4
        news.append(NewTensor("float32", t.numel(), [Segment(str(raw), at, n)] if n else []))
        at += n
    for d in ("torch", "lazy", "new"):
        (tmp_path / d).mkdir()
    torch.save({"x": tensors}, tmp_path / "torch" / "x.pt")
    stream_save({"x": [LazyTensor(t.numel(), t.dtype, lambda t=t: t) for t in tensors]}, tmp_path / "lazy" / "x.pt")
    write_torch_zip(tmp_path / "new" / "x.pt", *pickle_structure({"x": news}))
    ref = zipfile.ZipFile(tmp_path / "torch" / "x.pt")
    for d in ("lazy", "new"):
        mine = zipfile.ZipFile(tmp_path / d / "x.pt")
        assert [i.filename for i in ref.infolist()] == [i.filename for i in mine.infolist()], d
        for x in ref.infolist():
            if not x.filename.endswith(SID):
                assert ref.read(x) == mine.read(x.filename), (d, x.filename)


def _old_rank_file(tmp_path: Path) -> tuple[Path, list[tuple[int, int]]]:
    """A stand-in for an old rank's file: a header, then three 'flat buffers' of random bytes with small gaps
    between them (zip headers) and a tail nothing copies; returns the file and each buffer's (offset, size)."""
    rng = np.random.default_rng(0)
    parts, flats, at = [], [], 0
    for size in (300_000, 300_004, 299_996):
        gap = rng.bytes(97)  # a record's zip header: read by no copy
        parts += [gap, rng.bytes(size)]
        flats.append((at + len(gap), size))
        at += len(gap) + size
    parts.append(b"central directory and the end records")
    path = tmp_path / "old_rank_0.pt"
    path.write_bytes(b"".join(parts))
    return path, flats


def test_interleaved_files_equal_their_own_writes_and_hash_the_source_from_the_copy(tmp_path):
    """Two new ranks cut from one old rank's buffers (ZeRO-2 2 -> 4): written from one thread, each file is byte
    for byte what ``write_torch_zip`` writes alone, and the old file's digest comes from the copy's own reads,
    every byte the copies take read only once (what is left to ``finish``: the tail after the last buffer)."""
    from shardkit.storage.manifest import file_digest
    from shardkit.storage.stream import SourceDigests, write_interleaved
    from shardkit.storage.torch_zip import SegmentedRecord, write_torch_zip

    src, flats = _old_rank_file(tmp_path)
    path = str(src)

    def new_rank(half: int) -> tuple[bytes, list]:
        records = []
        for i, (offset, size) in enumerate(flats):
            lo = 0 if half == 0 else size // 2
            hi = size // 2 if half == 0 else size
            segs = [Segment(path, offset + lo, hi - lo)] + ([Segment(None, 0, 4)] if half else [])
            records.append((str(i), SegmentedRecord(hi - lo + (4 if half else 0), segs)))
        return f"pickle of rank {half}".encode(), records

    files = [(tmp_path / f"new_{r}.pt", *new_rank(r)) for r in (0, 1)]
    digests = SourceDigests([(src, "blake3")], gap_bytes=200)  # a zip header, never another rank's half
    written = write_interleaved(files, on_read=digests.seen, chunk_bytes=65536)
    (tmp_path / "alone").mkdir()
    alone = [write_torch_zip(tmp_path / "alone" / f"new_{r}.pt", pkl, records, chunk_bytes=65536)
             for r, (_, pkl, records) in enumerate(files)]
    for r in (0, 1):
        assert (tmp_path / f"new_{r}.pt").read_bytes() == (tmp_path / "alone" / f"new_{r}.pt").read_bytes()
        assert written[r].digest == alone[r].digest and written[r].size == alone[r].size
    assert digests.hashed_in_copy() == flats[-1][0] + flats[-1][1]  # up to the end of the last buffer, in order
    assert digests.finish() == {src: file_digest(src, "blake3")}


@pytest.mark.parametrize("order", ["forward", "backward", "shuffled"])
def test_source_digests_hash_every_byte_once_in_any_read_order(tmp_path, order):
    """Windows delivered out of order (threads of other files reading the same source) are left and read again
    at the end: the digest is the file's in every order, and a changed byte changes it."""
    import random

    from shardkit.storage.manifest import file_digest
    from shardkit.storage.stream import SourceDigests

    src, _ = _old_rank_file(tmp_path)
    data = src.read_bytes()
    windows = [(o, min(50_000, len(data) - o)) for o in range(0, len(data), 50_000)]
    if order == "backward":
        windows.reverse()
    elif order == "shuffled":
        random.Random(1).shuffle(windows)
    digests = SourceDigests([(src, "blake3")], gap_bytes=100)
    for offset, size in windows:
        digests.seen(str(src), offset, memoryview(data[offset:offset + size]))
    digests.seen(str(tmp_path / "another_file"), 0, memoryview(b"not one of the checked files"))
    assert digests.finish() == {src: file_digest(src, "blake3")}
    # one bit flipped on disk: the copy reads it, the digest is no longer the one the good file had
    good = file_digest(src, "blake3")
    bad = data[:1000] + bytes([data[1000] ^ 1]) + data[1001:]
    src.write_bytes(bad)
    changed = SourceDigests([(src, "blake3")])
    changed.seen(str(src), 0, memoryview(bad[:5000]))
    assert changed.finish()[src] != good
