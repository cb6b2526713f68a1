"""What a split run was asked to do, as one small description every process computes from its own
arguments, so the processes of one ``srun``/``torchrun`` run can check that they were all asked the
same thing before any of them writes a byte.

Under a launcher each process parses its own command line: a wrapper that adds ``--world-size
$((RANK+2))``, a per-node script with another ``-o``, or a typo in one ``srun`` line gives processes
different requests, and each would write its share of a different checkpoint into one folder that
rank 0 then seals (once, "world size 2 -> 2" was published holding a rank file no 2-rank run writes,
which ``shardkit verify`` refuses). So every split command builds a :class:`RunRequest` (command,
source, output, tag, every option that changes the bytes written, the shardkit release) and the
processes compare it once, at first contact (``storage.shared_meet``): each compares the digest of its
own request with rank 0's; only when the digests differ are the two compared field by field, to
name the difference (field, this process's value, rank 0's value, the fix). Nothing here grows with
ranks or tensors: one request per process, one digest compared.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Union

from shardkit.platform import versions

#: What an option's value may be: a count, a flag, a name, or unset.
OptionValue = Union[int, float, bool, str, None]

#: The field every request names its release with; compared first (another release may lay out, name
#: or hash its share differently, whatever the arguments say).
RELEASE = "shardkit release"
OUTPUT = "-o"


@dataclass(frozen=True)
class RunRequest:
    """One process's request of a split command, in the terms a user typed."""

    command: str
    """The command as typed, e.g. 'reshard', 'convert --to fsdp2', 'consolidate'."""
    source: str
    """The source's tag folder, resolved (the tag 'latest' named at the time this process resolved it)."""
    output: str
    """The output, resolved: the checkpoint root (reshard, convert) or the file (consolidate)."""
    tag: str | None
    """The output's tag (None where the output is a file)."""
    options: Mapping[str, OptionValue] = field(default_factory=dict)
    """Every other option that changes the bytes written, by its flag ('--world-size': 3); effective
    values where a default was resolved (the sub-group size read from the source's config)."""
    release: str = ""
    """The shardkit release this process runs (default: this one)."""

    def __post_init__(self) -> None:
        if not self.release:
            object.__setattr__(self, "release", versions.SHARDKIT_VERSION)

    def fields(self) -> dict[str, OptionValue]:
        """Every compared field under the name a message shows, release first."""
        return {RELEASE: self.release, "command": self.command, "source": self.source, OUTPUT: self.output,
                "--tag": self.tag, **dict(self.options)}

    def to_json(self) -> dict[str, Any]:
        return {"command": self.command, "source": self.source, "output": self.output, "tag": self.tag,
                "options": dict(self.options), "release": self.release}

    @classmethod
    def from_json(cls, data: Any) -> RunRequest | None:
        """The request another process wrote, or None when ``data`` is not one (an older release)."""
        if not isinstance(data, dict) or not isinstance(data.get("options"), dict):
            return None
        try:
            return cls(str(data["command"]), str(data["source"]), str(data["output"]),
                       None if data.get("tag") is None else str(data["tag"]), dict(data["options"]),
                       str(data["release"]))
        except KeyError:
            return None

    def digest(self) -> str:
        """sha256 of every field but the output's path: processes that met in one staging folder
        write one output whatever path each node mounts it under (where they meet is the output
        comparison, ``shared_meet``); the output's name is still compared through the tag."""
        body = self.to_json()
        del body["output"]
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class Difference:
    """One field two requests disagree on."""

    field: str
    mine: OptionValue
    rank0: OptionValue


def differences(mine: RunRequest, rank0: RunRequest, *, with_output: bool = True) -> list[Difference]:
    """The fields ``mine`` and ``rank0`` disagree on, release first. ``with_output=False``: not the
    output's path (the two met in one staging folder, so it is one output under two paths)."""
    a, b = mine.fields(), rank0.fields()
    return [Difference(k, a.get(k), b.get(k)) for k in [*a, *(k for k in b if k not in a)]
            if a.get(k) != b.get(k) and (with_output or k != OUTPUT)]


def shown(field_name: str, value: OptionValue) -> str:
    """A field's value as a user would type or read it."""
    if isinstance(value, bool) and field_name.startswith("--"):
        return "given" if value else "not given"
    if value is None:
        return "not given" if field_name.startswith("--") else "none"
    return repr(value) if isinstance(value, str) else str(value)


def mismatch_message(rank: int, world: int, host: str, rank0_host: str, diffs: list[Difference]) -> str:
    """The one message every process of the run fails with: each field with both values, and the fix.

    Written to be read from any process (the one that differs, rank 0, the others that agreed)."""
    first = diffs[0]
    if first.field == RELEASE:
        return (f"rank {rank} of {world} (host {host}) runs shardkit {first.mine}, rank 0 (host {rank0_host!r}) runs "
                f"shardkit {first.rank0}: every process of one run must run the same release (each writes a share of "
                "one checkpoint). Nothing was written. Install the same shardkit on every node, then run again")
    listed = "; ".join(f"{d.field}: {shown(d.field, d.mine)} on rank {rank}, {shown(d.field, d.rank0)} on rank 0"
                       for d in diffs)
    fixes = [_FIXES[d.field] for d in diffs if d.field in _FIXES]
    return (f"rank {rank} of {world} (host {host}) was asked for another run than rank 0 (host {rank0_host!r}): "
            f"{listed}. Every process of one split run writes a share of one output, so each must be given the same "
            "command line (torchrun and srun give each process the same one; a wrapper script or an environment "
            "variable that differs per process changed it). Nothing was written. Fix: give every process the same "
            f"arguments{(', ' + '; '.join(dict.fromkeys(fixes))) if fixes else ''}, then run again")


_FIXES = {
    "source": "and the source at the same path on every node",
    OUTPUT: "and -o the same folder, on storage every node mounts at the same path",
    "--tag": "and the same --tag (or none)",
}


def source_of(tag_dir: Path) -> str:
    """The source as a request names it: its tag folder, resolved."""
    return str(Path(tag_dir).resolve())
