"""The byte-level half of verifying a checkpoint that has no shardkit manifest: one file at a time,
nothing kept but a few scalars per file, so a 1,024-rank folder costs one file's structure at once.

- a torch zip file (``torch.save``'s format: rank files, ``*.bin``): its central directory reads,
  every record's local header and data lie inside the file (a truncated copy loses the directory
  or the tail of a record), and where a reader will parse it, ``data.pkl`` parses through the
  allow-list (``storage.torch_load.read_structure``), tensors as offsets, never their bytes;
- a DCP folder: ``.metadata`` parses (``dcp.plain_metadata``, no torch), every ``.distcp`` file it
  references is there and holds every byte range it names, every tensor chunk has a storage entry.

Digests cannot be checked (there are none to compare with): what these checks see is a file that
is missing, cut short, or whose structure no longer parses, not a changed byte inside a tensor.
"""

from __future__ import annotations

import os
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from shardkit.checkpoint.dcp.plain_metadata import read_plain_metadata
from shardkit.core.errors import CheckpointError
from shardkit.core.files import NotRegularFileError, not_regular, open_regular
from shardkit.storage.listing import list_folder
from shardkit.storage.structure_observers import observe_structures
from shardkit.storage.torch_load import DeepSpeedObjectStub, read_structure

#: A zip record's local header: signature, then fixed fields; name and extra lengths at bytes 26-30.
_LOCAL_HEADER = 30
_LOCAL_SIGNATURE = b"PK\x03\x04"
#: General-purpose flag bit 3: the record's crc and sizes follow its data (a data descriptor), optionally signed.
_DESCRIPTOR_FLAG = 0x08
_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
#: Items named per file in a message (a file that lost its tail loses many items at once).
_SHOWN = 3


@dataclass(frozen=True)
class FileProblem:
    """One thing wrong with one file, as a verify finding needs it."""

    file: str
    """The file, relative to the folder checked (``zero_pp_rank_5_mp_rank_00_optim_states.pt``)."""
    message: str
    fix: str
    rule: str
    warning: bool = False
    """True for what does not stop a resume (a .distcp file nothing references)."""


RECOPY = "re-copy the file from the machine that saved it, or resume from another checkpoint"


def torch_zip_problem(path: Path) -> str | None:
    """What is wrong with the zip structure of ``path`` (None: every record lies inside the file).

    Reads the central directory and 30 bytes per record (a DeepSpeed rank file has a few dozen)."""
    try:
        with open_regular(path) as fh, zipfile.ZipFile(fh) as z:
            records = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, struct.error) as exc:
        return _unreadable(path, exc)
    return zip_records_problem(path, records)


def zip_records_problem(path: Path, records: list[zipfile.ZipInfo]) -> str | None:
    """``torch_zip_problem`` of ``path`` from its central directory ``records``, already read (by the reader's
    parse: ``storage.structure_observers``): 30 bytes per record are read here, the directory not again."""
    try:
        size = os.stat(path).st_size
        with open_regular(path) as fh:
            for info in records:
                fh.seek(info.header_offset)
                header = fh.read(_LOCAL_HEADER)
                if len(header) < _LOCAL_HEADER or header[:4] != _LOCAL_SIGNATURE:
                    return (f"record {info.filename} should start at byte {info.header_offset} but no zip record "
                            f"header is there (the file has {size:,} bytes): overwritten or spliced")
                name_len, extra_len = struct.unpack("<HH", header[26:30])
                end = info.header_offset + _LOCAL_HEADER + name_len + extra_len + info.compress_size
                if end > size:
                    return (f"record {info.filename} ends at byte {end:,} but the file has {size:,} bytes: "
                            "cut short (an interrupted save or copy)")
                disagree = _own_size_problem(fh, info, header, end)
                if disagree is not None:
                    return f"record {info.filename}: {disagree}"
    except (OSError, ValueError, struct.error) as exc:
        return _unreadable(path, exc)
    return None


def _own_size_problem(fh: BinaryIO, info: zipfile.ZipInfo, header: bytes, end: int) -> str | None:
    """The record's own crc and size (its data descriptor, right after its data, where flag bit 3 is set, as
    torch's writer and shardkit's set it; else its local header) against what the central directory says.

    A directory entry whose size was rewritten (the file's size unchanged) still lies inside the file, and the
    pickle still parses: only here does it show, where torch.load stops with 'record size ... does not match'."""
    flags = struct.unpack("<H", header[6:8])[0]
    if flags & _DESCRIPTOR_FLAG:
        fh.seek(end)
        tail = fh.read(24)
        body = tail[4:] if tail[:4] == _DESCRIPTOR_SIGNATURE else tail
        # 12 bytes (crc, sizes as 4 bytes) or, for a zip64 record, 20 (sizes as 8 bytes)
        own = [struct.unpack(f, body[:n]) for f, n in (("<II", 8), ("<IQ", 12)) if len(body) >= n]
        if (info.CRC, info.compress_size) in own:
            return None
        found = (f"its data descriptor says {own[0][1]:,} bytes (crc {own[0][0]:08x})" if tail[:4] == _DESCRIPTOR_SIGNATURE
                 else f"no data descriptor follows where that many bytes would end (byte {end:,})")
    else:
        seen = struct.unpack("<II", header[14:22])
        if seen[1] == 0xFFFFFFFF or seen == (info.CRC, info.compress_size):  # zip64: the size is in its extra field
            return None
        found = f"its local header says {seen[1]:,} bytes (crc {seen[0]:08x})"
    return (f"the central directory says {info.compress_size:,} bytes (crc {info.CRC:08x}), but {found}: the zip's "
            "directory was edited or the file is damaged (torch.load refuses it)")


def _unreadable(path: Path, exc: Exception) -> str:
    try:
        size = f"{os.stat(path).st_size:,} bytes"
    except OSError:
        size = "size unknown"
    return (f"not a readable torch zip file ({type(exc).__name__}: {exc}; {size}): truncated (the zip directory is at "
            "the end of the file, so a cut copy loses it) or overwritten")


def check_torch_zip(folder: Path, rel: str) -> FileProblem | None:
    """What is wrong with the zip structure of ``folder/rel``, as a finding; None: every record lies inside it."""
    path = folder / rel
    problem = torch_zip_problem(path)
    return None if problem is None else _zip_finding(path, rel, problem)


def _zip_finding(path: Path, rel: str, problem: str) -> FileProblem:
    return FileProblem(rel, f"{path}: {problem}", RECOPY, "ckpt.structure.zip")


def parse_torch_file(folder: Path, rel: str) -> tuple[Any, FileProblem | None]:
    """(its structure, None) or (None, its problem) for ``folder/rel``: its zip structure (``torch_zip_problem``)
    and its pickle, the central directory read once (the parse's, ``zip_records_problem``) where it parses; a zip
    problem is the one named where both are wrong, as when the zip was checked first."""
    path = folder / rel
    seen: list[list[zipfile.ZipInfo]] = []
    try:
        with observe_structures(lambda p, _structure, records: seen.append(records) if p == path else None):
            structure = read_structure(path)
    except NotRegularFileError as exc:  # a FIFO, device or socket: named as what it is, never opened again
        return None, FileProblem(rel, str(exc), RECOPY, "ckpt.structure.not_regular")
    except CheckpointError as exc:  # read_structure names a damaged length or nesting field too
        problem = torch_zip_problem(path)
        if problem is not None:
            return None, _zip_finding(path, rel, problem)
        return None, FileProblem(rel, str(exc), RECOPY, "ckpt.structure.pickle")
    problem = zip_records_problem(path, seen[-1]) if seen else torch_zip_problem(path)
    if problem is not None:
        return None, _zip_finding(path, rel, problem)
    return structure, None


def _inside(rel: str) -> bool:
    parts = Path(rel).parts
    return bool(parts) and not Path(rel).is_absolute() and ".." not in parts


def dcp_problems(folder: Path, *, prefix: str = "") -> list[FileProblem]:
    """What is wrong with the DCP folder ``folder`` (``.metadata`` and the ``.distcp`` files it names);
    file names are reported as ``prefix + name`` (the folder's path inside the checkpoint)."""
    meta = folder / ".metadata"
    try:
        md = read_plain_metadata(meta)
    except CheckpointError as exc:  # read_plain_metadata names a damaged length or nesting field too
        return [FileProblem(f"{prefix}.metadata", str(exc), "re-copy .metadata from the machine that saved it (it "
                            "is written last, by rank 0), or resume from another checkpoint", "ckpt.structure.metadata")]
    out: list[FileProblem] = []
    # per file: the furthest byte any item needs, and which item that is (one pass, one entry per file)
    reach: dict[str, tuple[int, str]] = {}
    items: dict[str, int] = {}
    for (key, _offsets), info in md.storage.items():
        rel = info.relative_path
        if not _inside(rel):
            out.append(FileProblem(f"{prefix}.metadata", f"{meta}: item {key!r} is stored in {rel!r}, outside the "
                                   "folder: not what torch's FileSystemWriter writes", "re-copy .metadata, or resume "
                                   "from another checkpoint", "ckpt.structure.metadata"))
            continue
        end = info.offset + info.length
        if end > reach.get(rel, (-1, ""))[0]:
            reach[rel] = (end, key)
        items[rel] = items.get(rel, 0) + 1
    for rel in sorted(reach):
        end, key = reach[rel]
        path = folder / rel
        if path.is_dir():
            out.append(FileProblem(f"{prefix}{rel}", f"{path}: is a directory, not the .distcp file {meta} places "
                                   f"{items[rel]:,} item(s) in (e.g. {key!r})", "a copy made a folder of the file: "
                                   "replace it with the file from the machine that saved it, or resume from another "
                                   "checkpoint", "ckpt.structure.distcp"))
            continue
        refusal = not_regular(path)
        if refusal is not None:  # a FIFO, device or socket: named as what it is, never opened
            out.append(FileProblem(f"{prefix}{rel}", str(refusal), RECOPY, "ckpt.structure.not_regular"))
            continue
        if not path.is_file():
            out.append(FileProblem(f"{prefix}{rel}", f"{path}: missing; {meta} places {items[rel]:,} item(s) in it "
                                   f"(e.g. {key!r})", "re-copy it from the machine that saved it (each rank writes "
                                   "its own .distcp file), or resume from another checkpoint", "ckpt.structure.distcp"))
            continue
        size = path.stat().st_size
        if size < end:
            out.append(FileProblem(f"{prefix}{rel}", f"{path}: {size:,} bytes, but {meta} places item {key!r} up to "
                                   f"byte {end:,}: cut short (an interrupted save or copy)", RECOPY,
                                   "ckpt.structure.distcp"))
    for name, tensor in md.tensors.items():
        lost = [c.offsets for c in tensor.chunks if md.storage_info(name, c.offsets) is None]
        if lost:
            out.append(FileProblem(f"{prefix}.metadata", f"{meta}: tensor {name!r} has {len(lost)} chunk(s) with no "
                                   f"storage entry (offsets {lost[:_SHOWN]}): its bytes are nowhere",
                                   "re-copy .metadata, or resume from another checkpoint", "ckpt.structure.metadata"))
    for extra in sorted(n for n in list_folder(folder).names if n.endswith(".distcp") and n not in reach):
        out.append(FileProblem(f"{prefix}{extra}", f"{folder / extra}: a .distcp file {meta} does not reference (from "
                               "another save into the same folder?); no load reads it", "remove it if it is left "
                               "over from another save", "ckpt.structure.distcp_extra", warning=True))
    return out


def _value(obj: Any) -> Any:
    """A ZeroStageEnum stand-in's value, lists of them as lists; plain values as they are."""
    if isinstance(obj, (list, tuple)):
        return [_value(v) for v in obj]
    return obj.value if isinstance(obj, DeepSpeedObjectStub) else obj


def deepspeed_facts(structure: Any) -> dict[str, Any]:
    """The run-wide values a DeepSpeed rank file records that every rank must agree on (only those
    present): ``dp_world_size``, ``global_steps``, ``ds_version`` from model states; ``zero_stage``,
    ``partition_count`` from optimizer states."""
    if not isinstance(structure, dict):
        return {}
    out = {k: structure[k] for k in ("dp_world_size", "global_steps", "ds_version") if k in structure}
    osd = structure.get("optimizer_state_dict")
    if isinstance(osd, dict):
        for key in ("zero_stage", "partition_count"):
            if key in osd:
                out[key] = _value(osd[key])
    return {k: v for k, v in out.items() if isinstance(v, (int, str, list)) and not isinstance(v, bool)}
