"""Content digests of checkpoint files: BLAKE3 for what shardkit writes, sha256 where a manifest says so.

Every byte shardkit writes is hashed for the manifest, and every byte it reads from a sealed
checkpoint is hashed again to verify it. With sha256 that was most of a reshard's CPU time: 0.57-0.73
core-seconds per GiB on the benchmark machine (with SHA-NI), against 0.18 for BLAKE3 (the ``blake3``
package: the Rust implementation, AVX2/AVX-512, the GIL released on large buffers), which kept a
reshard at 2.3x the time of ``cp -r`` + fsync on 2 cores. Both are cryptographic: a digest still
detects any corruption or edit.

Manifests name the algorithm per file (``FileEntry.sha256`` or ``FileEntry.blake3``), so checkpoints
sealed with sha256 (every shardkit before this change, or ``SHARDKIT_HASH=sha256``) verify as before,
and a byte-for-byte copy keeps its source's algorithm (the copy's digest is the source's check).
"""

from __future__ import annotations

import hashlib
from typing import Mapping, Protocol

from shardkit.core.env_settings import read_choice
from shardkit.core.errors import CheckpointError

#: What a manifest entry may name, in order of preference.
ALGORITHMS: tuple[str, ...] = ("blake3", "sha256")
#: ``SHARDKIT_HASH=sha256`` seals new checkpoints with sha256 (for tools that only know sha256).
HASH_ENV = "SHARDKIT_HASH"


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def blake3_available() -> bool:
    try:
        import blake3  # noqa: F401
    except ImportError:
        return False
    return True


def default_algorithm(environ: Mapping[str, str] | None = None, *, during_run: bool = True) -> str:
    """The algorithm new manifests use: ``SHARDKIT_HASH`` when set, else blake3 where its package is
    installed (a dependency of shardkit; a platform without its wheel falls back to sha256).

    A value that is not one of the choices is, ``during_run`` (the default: a library save reads
    this mid-run, inside someone's training loop, where an exception would lose the steps since the
    last checkpoint), warned about once on stderr and the default used; with ``during_run=False``
    refused (``UsageError`` naming the variable, the value and the choices). The CLI refuses it at
    start either way (``env_settings.check_all``), before any work."""
    fallback = "blake3" if blake3_available() else "sha256"
    # blake3 chosen without its package: refused by read_choice (SETTINGS' needs), by the CLI at start
    # (check_all); a run already under way is warned and falls back to sha256 rather than fail a save
    return read_choice(HASH_ENV, fallback, environ, during_run=during_run)


def new_hasher(algorithm: str) -> Hasher:
    """A fresh hash object of ``algorithm`` ('blake3' or 'sha256')."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "blake3":
        try:
            from blake3 import blake3
        except ImportError:
            raise CheckpointError("this checkpoint's manifest lists blake3 digests, but the blake3 package is not "
                                  "installed: pip install blake3 (a shardkit dependency), then run again") from None
        hasher: Hasher = blake3()
        return hasher
    raise ValueError(f"unknown digest algorithm {algorithm!r}; known: {list(ALGORITHMS)}")
