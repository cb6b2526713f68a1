"""``shardkit_manifest.json``: what a checkpoint holds and what it needs to be resumed safely.

Written last into each checkpoint (tag) directory, so its presence is the completion marker (the
role torchtitan gives DCP's ``.metadata``). It lists every file with its size and digest (BLAKE3, or
sha256 in older manifests: ``digest``), and the facts resume compares before touching a tensor:
engine, world size, ZeRO stage, offload devices, dtype, library versions and a digest of the
training config.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal

from shardkit.core.errors import CheckpointError
from shardkit.core.files import FileReadError, open_regular, read_regular_file, regular_fd
from shardkit.platform.dist import all_gather_object, broadcast_object, rank_world
from shardkit.platform.versions import library_versions
from shardkit.storage.atomic import atomic_write_text
from shardkit.storage.digest import ALGORITHMS, default_algorithm, new_hasher
from shardkit.storage.listing import walk
from shardkit.storage.tags import STAGING_PREFIX, tag_problem

MANIFEST_NAME = "shardkit_manifest.json"
#: 2: files may carry a ``blake3`` digest instead of ``sha256`` (a manifest is written as 1 when none does).
FORMAT_VERSION = 2
Engine = Literal["deepspeed", "fsdp2", "torch"]
ENGINES: tuple[str, ...] = ("deepspeed", "fsdp2", "torch")
_CHUNK = 8 << 20  # 8 MiB: hashing streams, memory stays flat for multi-GB rank files


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint."""

    path: str
    """Path relative to the checkpoint (tag) directory, '/'-separated."""
    size: int
    """Size in bytes; a shorter file on disk means a truncated write."""
    sha256: str | None = None
    """Hex sha256 of the content (manifests before blake3, ``SHARDKIT_HASH=sha256``, and byte-for-byte
    copies of such files); a mismatch means corruption (or a file rewritten after save)."""
    blake3: str | None = None
    """Hex BLAKE3 of the content (``digest``): what shardkit writes by default. Exactly one of the two is set."""

    @classmethod
    def of(cls, path: str, size: int, algorithm: str, digest: str) -> "FileEntry":
        """The entry of a file hashed with ``algorithm`` ('blake3' or 'sha256')."""
        return cls(path, size, blake3=digest) if algorithm == "blake3" else cls(path, size, sha256=digest)

    @property
    def algorithm(self) -> str:
        return "blake3" if self.blake3 is not None else "sha256"

    @property
    def digest(self) -> str:
        return self.blake3 if self.blake3 is not None else (self.sha256 or "")

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, self.algorithm: self.digest}


@dataclass
class Manifest:
    """Everything shardkit records about one checkpoint."""

    engine: str
    """'deepspeed', 'fsdp2' or 'torch': which loader can read the files."""
    tag: str
    """Name of the checkpoint directory (DeepSpeed's tag, e.g. 'global_step100')."""
    world_size: int
    """Ranks that wrote it. DeepSpeed's plain load_checkpoint needs the same number to resume."""
    files: list[FileEntry] = field(default_factory=list)
    """Every file in the directory except the manifest itself."""
    step: int | None = None
    """Training step at save time, when the caller knows it."""
    zero_stage: int | None = None
    """ZeRO stage (DeepSpeed only)."""
    offload_optimizer: str | None = None
    """offload_optimizer.device at save time ('cpu', 'nvme', 'none'); DeepSpeed only."""
    offload_param: str | None = None
    """offload_param.device at save time; DeepSpeed only."""
    dtype: str | None = None
    """Training precision ('bf16', 'fp16', 'fp32')."""
    versions: dict[str, str] = field(default_factory=dict)
    """torch / deepspeed / shardkit versions that wrote it."""
    config_digest: str | None = None
    """sha256 of the canonical JSON of the training config, to notice a changed config on resume."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Engine-specific facts (e.g. DCP's sharding); free-form, JSON only."""
    format_version: int = FORMAT_VERSION
    """Manifest schema version; readers refuse newer ones."""
    created_unix: float = field(default_factory=time.time)
    """When the manifest was written (seconds since the epoch)."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["files"] = [f.to_dict() for f in self.files]
        # 2 only where a file is hashed with blake3: a sha256-only manifest stays readable by the
        # shardkit releases before blake3, which refuse format versions above 1
        out["format_version"] = 2 if any(f.blake3 is not None for f in self.files) else 1
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "manifest") -> "Manifest":
        """Build a Manifest from parsed JSON, after checking every field's type and range: a
        manifest is input (copied, edited, or planted next to someone else's files), and verify and
        the loaders size loops by ``world_size`` and open the paths it lists."""
        for key, kinds in _FIELD_TYPES.items():
            if key in data and not _is(data[key], kinds):
                raise CheckpointError(
                    f"{source}: field {key} must be {_kind_names(kinds)}, got {_show(data[key])} "
                    f"({type(data[key]).__name__}); the manifest was edited or corrupted. Re-save the checkpoint, "
                    "or restore the manifest from a good copy"
                )
        for key in ("engine", "tag", "world_size"):
            if key not in data:
                raise CheckpointError(f"{source}: field {key} is missing; every shardkit manifest has it, so the "
                                      "file was edited or not written by shardkit. Re-save the checkpoint")
        raw_files = data.get("files", [])
        if not isinstance(raw_files, list):
            raise CheckpointError(f"{source}: field files must be a list, got {type(raw_files).__name__}")
        for i, f in enumerate(raw_files):
            if not isinstance(f, dict):
                raise CheckpointError(f"{source}: files[{i}] must be an object, got {_show(f)}")
            for key, kinds in _FILE_FIELD_TYPES.items():
                if not _is(f.get(key), kinds):
                    raise CheckpointError(
                        f"{source}: field files[{i}].{key} must be {_kind_names(kinds)}, got {_show(f.get(key))}; "
                        "the manifest was edited or corrupted. Re-save the checkpoint"
                    )
        _check_ranges(data, raw_files, source)
        try:
            files = [FileEntry(**f) for f in raw_files]
            known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "files"}
            m = cls(files=files, **known)
        except TypeError as exc:
            raise CheckpointError(f"{source}: manifest fields are not what shardkit writes ({exc})") from exc
        if m.format_version > FORMAT_VERSION:
            raise CheckpointError(
                f"{source}: manifest format_version {m.format_version!r} is newer than this shardkit reads "
                f"({FORMAT_VERSION}); upgrade shardkit"
            )
        return m


_NONE = type(None)
#: JSON types each manifest field may hold (bool is refused where an int is meant: json gives True/False).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "engine": (str,), "tag": (str,), "world_size": (int,), "step": (int, _NONE), "zero_stage": (int, _NONE),
    "offload_optimizer": (str, _NONE), "offload_param": (str, _NONE), "dtype": (str, _NONE),
    "versions": (dict,), "config_digest": (str, _NONE), "extra": (dict,), "format_version": (int,),
    "created_unix": (int, float),
}
_FILE_FIELD_TYPES: dict[str, tuple[type, ...]] = {"path": (str,), "size": (int,), "sha256": (str, _NONE),
                                                  "blake3": (str, _NONE)}


def _is(value: Any, kinds: tuple[type, ...]) -> bool:
    return isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)


def _kind_names(kinds: tuple[type, ...]) -> str:
    names = {str: "a string", int: "an int", float: "a number", dict: "an object", _NONE: "null"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


#: More ranks than any training run uses; verify loops over ranks, so an absurd value (10**12)
#: must be refused before it is used, not discovered by the OOM killer.
MAX_WORLD_SIZE = 1 << 20
#: A manifest lists each file in ~200 bytes: 64 MiB covers several hundred thousand files. Larger
#: is not a manifest shardkit wrote, and is never read into memory.
MAX_MANIFEST_BYTES = 64 << 20
#: shardkit writes manifests 3 levels deep (plus what callers put in ``extra``); json's C parser
#: overflows the interpreter's recursion limit near 1000.
MAX_MANIFEST_DEPTH = 64
_MAX_INT = (1 << 63) - 1  # sizes and steps: what a 64-bit file offset / counter can hold
_MAX_NAME = 256  # engine, dtype, offload device names
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _show(value: Any, limit: int = 80) -> str:
    """repr of a value, cut to ``limit`` characters (a planted 10-MB string must not fill the terminal)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def path_problem(rel: str) -> str | None:
    """Why ``rel`` cannot be a file path inside a checkpoint folder, or None when it can."""
    if not rel:
        return "an empty path"
    if "\0" in rel:
        return "contains NUL"
    if rel.startswith("/") or rel.startswith("\\") or (len(rel) > 1 and rel[1] == ":"):
        return "an absolute path: files must be inside the checkpoint folder"
    parts = rel.split("/")
    if any(part == ".." for part in parts):
        return "contains '..': files must be inside the checkpoint folder"
    if any(part in ("", ".") for part in parts) or "\\" in rel:
        return "not a normalized '/'-separated relative path"
    if rel == MANIFEST_NAME:
        return "the manifest cannot list itself"
    return None


def _check_ranges(data: dict[str, Any], raw_files: list[dict[str, Any]], source: str) -> None:
    """Values of the right JSON type but outside what any checkpoint can hold."""

    def bad(key: str, value: Any, why: str) -> CheckpointError:
        return CheckpointError(f"{source}: field {key} is {_show(value)}: {why}; the manifest was edited or "
                               "corrupted. Re-save the checkpoint, or restore the manifest from a good copy")

    if data["engine"] not in ENGINES:
        raise bad("engine", data["engine"], f"must be one of {list(ENGINES)}")
    why = tag_problem(data["tag"])
    if why is not None:
        raise bad("tag", data["tag"], why)
    if not 1 <= data["world_size"] <= MAX_WORLD_SIZE:
        raise bad("world_size", data["world_size"], f"must be between 1 and {MAX_WORLD_SIZE:,} ranks")
    step = data.get("step")
    if step is not None and not 0 <= step <= _MAX_INT:
        raise bad("step", step, "must be a step count >= 0")
    stage = data.get("zero_stage")
    if stage is not None and stage not in (0, 1, 2, 3):
        raise bad("zero_stage", stage, "ZeRO stages are 0, 1, 2 and 3")
    for key in ("offload_optimizer", "offload_param", "dtype"):
        value = data.get(key)
        if value is not None and not (0 < len(value) <= _MAX_NAME and value.isprintable()):
            raise bad(key, value, f"must be a short printable name (1 to {_MAX_NAME} characters)")
    for name, version in data.get("versions", {}).items():
        if not isinstance(version, str) or len(version) > _MAX_NAME or len(name) > _MAX_NAME:
            raise bad(f"versions.{name[:_MAX_NAME]}", version, "must be a version string")
    digest = data.get("config_digest")
    if digest is not None and not _SHA256.match(digest):
        raise bad("config_digest", digest, "must be 64 lowercase hex digits (a sha256)")
    fv = data.get("format_version", FORMAT_VERSION)
    if fv < 1:
        raise bad("format_version", fv, "format versions start at 1")
    created = data.get("created_unix", 0)
    if not ((isinstance(created, int) or math.isfinite(created)) and 0 <= created <= _MAX_INT):
        raise bad("created_unix", created, "must be a finite time in seconds since the epoch")
    seen: set[str] = set()
    for i, f in enumerate(raw_files):
        rel = f["path"]
        why = path_problem(rel)
        if why is not None:
            raise bad(f"files[{i}].path", rel, why)
        if rel in seen:
            raise bad(f"files[{i}].path", rel, "listed twice")
        seen.add(rel)
        if not 0 <= f["size"] <= _MAX_INT:
            raise bad(f"files[{i}].size", f["size"], "must be a byte count >= 0")
        named = [a for a in ALGORITHMS if f.get(a) is not None]
        if len(named) != 1:
            raise bad(f"files[{i}]", {k: f.get(k) for k in ALGORITHMS},
                      "must have exactly one digest, sha256 or blake3")
        if not _SHA256.match(f[named[0]]):
            raise bad(f"files[{i}].{named[0]}", f[named[0]], "must be 64 lowercase hex digits")


def _depth_exceeds(obj: Any, limit: int) -> bool:
    """True when ``obj`` nests lists/objects deeper than ``limit`` (iterative: no recursion)."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False


def file_digest(path: str | os.PathLike[str], algorithm: str, chunk: int = _CHUNK, *, inside: Path | None = None) -> str:
    """Hex digest (``algorithm``: 'blake3' or 'sha256') of a file, streamed in chunks.

    ``inside``: the (resolved) checkpoint folder the file must be in. The file is then opened by its
    resolved path with ``O_NOFOLLOW``, so a link swapped in after verify looked at the path (a
    rank file replaced by ``-> /elsewhere``) is refused by the kernel (ELOOP) instead of hashed:
    what is hashed is what was checked to be inside."""
    h = new_hasher(algorithm)
    if inside is None:
        fh = open_regular(path)
    else:
        real = Path(os.path.realpath(path))
        if not real.is_relative_to(inside):
            raise CheckpointError(f"{path}: leads outside the checkpoint folder {inside} (to {real}); it is not read. "
                                  "Replace the link with the real file, or resume from another tag")
        try:
            fd = regular_fd(real, follow_links=False)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CheckpointError(f"{path}: became a symlink while it was being verified (a save or a copy is "
                                      "changing the checkpoint); it is not read. Re-run when nothing writes to it") from None
            raise
        fh = os.fdopen(fd, "rb")
    with fh:
        while True:
            block = fh.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def checkpoint_files(tag_dir: str | os.PathLike[str]) -> list[str]:
    """Relative paths of every file under ``tag_dir`` except the manifest and temporaries, sorted."""
    root = Path(tag_dir)
    out = []
    for dirpath, dirnames, filenames in walk(root):  # ``root`` itself: the command's one listing of a source
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(STAGING_PREFIX))
        for name in filenames:
            rel = Path(dirpath, name).relative_to(root).as_posix()
            if rel == MANIFEST_NAME or (name.startswith(".") and ".tmp-" in name):
                continue
            out.append(rel)
    return sorted(out)


def describe_files(tag_dir: str | os.PathLike[str], rel_paths: Iterable[str]) -> list[FileEntry]:
    """Size and digest (``default_algorithm``) of each of ``rel_paths`` under ``tag_dir``."""
    root = Path(tag_dir)
    algorithm = default_algorithm()
    return [FileEntry.of(p, (root / p).stat().st_size, algorithm, file_digest(root / p, algorithm)) for p in rel_paths]


def describe_files_distributed(tag_dir: str | os.PathLike[str], exclude: set[str] | None = None) -> list[FileEntry]:
    """Like ``describe_files`` for the whole directory, with the hashing split across the ranks of
    the default process group (file i goes to rank i % world), so a 2-GB checkpoint written by 8
    ranks is hashed in parallel. Every rank returns the full list (less ``exclude``). Collective: call on
    all ranks."""
    rels = [r for r in checkpoint_files(tag_dir) if r not in (exclude or ())]
    rank, world = rank_world()  # (0, 1) without a process group, and no torch import to learn it
    if world == 1:
        return describe_files(tag_dir, rels)
    # rank 0's listing is authoritative: every rank must hash the same set
    rels = broadcast_object(rels, src=0)
    mine = describe_files(tag_dir, rels[rank::world])
    entries = [FileEntry(**d) for part in all_gather_object([asdict(e) for e in mine]) for d in part]
    return sorted(entries, key=lambda e: e.path)


def write_manifest(tag_dir: str | os.PathLike[str], manifest: Manifest) -> Path:
    """Write the manifest atomically into ``tag_dir`` (the last file a save writes)."""
    path = Path(tag_dir) / MANIFEST_NAME
    atomic_write_text(path, json.dumps(manifest.to_dict(), indent=1, sort_keys=True) + "\n")
    return path


def read_manifest(tag_dir: str | os.PathLike[str]) -> Manifest:
    """Read ``tag_dir/shardkit_manifest.json``; CheckpointError naming the file (and the field,
    the value and why, for a manifest that parses but cannot be right) when it is missing,
    malformed, too large or too deeply nested."""
    path = Path(tag_dir) / MANIFEST_NAME
    if path.is_symlink():
        # a manifest vouches for the folder it is in; one borrowed from elsewhere through a link
        # (-> another run's manifest) would make that folder's files look verified
        real = Path(os.path.realpath(path))
        if not real.is_relative_to(Path(tag_dir).resolve()):
            raise CheckpointError(f"{path}: a symlink leading outside the checkpoint folder (to {real}); a manifest "
                                  "must be the folder's own file, so it is not read. Replace the link with the "
                                  "checkpoint's own manifest, or re-save the checkpoint")
    try:
        # the type is checked on the open descriptor: a FIFO swapped in after a check never blocks
        raw = read_regular_file(path, MAX_MANIFEST_BYTES)
    except FileReadError as exc:
        if exc.reason == "missing":
            raise CheckpointError(
                f"{path}: no {MANIFEST_NAME}; the checkpoint is incomplete (a save was interrupted) or was not "
                "written by shardkit. Resume from a complete checkpoint, or re-save with shardkit"
            ) from None
        if exc.reason == "too_large":
            raise CheckpointError(f"{path}: larger than {MAX_MANIFEST_BYTES >> 20} MiB, far more than a manifest of "
                                  "any real checkpoint; the file was replaced or corrupted. Re-save the checkpoint") from None
        if exc.reason == "unreadable":
            raise CheckpointError(f"{exc}; check its permissions") from exc
        raise CheckpointError(f"{exc}; a manifest is a JSON file written by shardkit. Re-save the checkpoint") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise CheckpointError(f"{path}: manifest JSON is nested too deeply to parse (more than "
                              f"{MAX_MANIFEST_DEPTH} levels; shardkit writes 3); the file was replaced or "
                              "corrupted. Re-save the checkpoint") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, ints past the digit limit
        raise CheckpointError(f"{path}: manifest is not valid JSON ({_show(str(exc), 200)}); the file is "
                              "corrupted") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: manifest must be a JSON object, got {type(data).__name__}")
    if _depth_exceeds(data, MAX_MANIFEST_DEPTH):
        raise CheckpointError(f"{path}: manifest JSON is nested more than {MAX_MANIFEST_DEPTH} levels deep "
                              "(shardkit writes 3); the file was replaced or corrupted. Re-save the checkpoint")
    return Manifest.from_dict(data, source=str(path))


def seal(tag_dir: str | os.PathLike[str], *, engine: str, world_size: int = 1, **facts: Any) -> Manifest:
    """Describe every file under ``tag_dir`` (single process) and write the manifest last."""
    tag_dir = Path(tag_dir)
    m = Manifest(engine=engine, tag=facts.pop("tag", tag_dir.name), world_size=world_size,
                 files=describe_files(tag_dir, checkpoint_files(tag_dir)),
                 versions=facts.pop("versions", None) or library_versions(), **facts)
    write_manifest(tag_dir, m)
    return m
