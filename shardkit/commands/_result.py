"""The one JSON object a ``shardkit`` run ends with under ``--json`` / ``--json-file`` (docs/cli.md,
"JSON results"), whatever ends it: the command's own result, a usage error argparse raised, a bad
``SHARDKIT_*`` variable, a refusal, a signal before, during or after the command body.

A command hands its result to ``emit_json``; inside ``shardkit.cli.main`` that result is held in the
run's :class:`Ending` and written once, by ``main`` as its last act (signals held), so a failure or a
SIGTERM after the command produced its result still gives one object, and the object's ``exit_code``
is the status the process exits with. Called outside ``main`` (a test calling a command function),
``emit_json`` writes at once as before.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence, TextIO

#: Options of ``shardkit launch`` itself; what follows them is the launcher's and the script's.
_LAUNCH_OWN = {"--no-preflight", "--dry-run", "--json", "-h", "--help"}
_LAUNCH_OWN_WITH_VALUE = {"--launcher", "--json-file"}
#: Commands that once took ``--json FILE`` (the path after ``--json`` is a --json-file).
_JSON_TAKES_FILE = {"smoke", "preflight"}


@dataclass
class JsonRequest:
    """Where the run's JSON result goes, as the command line asks."""

    stdout: bool = False
    """``--json``: the object alone on stdout."""
    file: str | None = None
    """``--json-file PATH``: the object written to PATH."""

    @property
    def wanted(self) -> bool:
        return self.stdout or bool(self.file)


def command_of(argv: Sequence[str]) -> str | None:
    """The command a command line names (its first word that is not an option), even one argparse
    then refuses: a usage error's JSON says which command it was meant for."""
    return next((a for a in argv if not a.startswith("-")), None)


def json_request(argv: Sequence[str]) -> JsonRequest:
    """What ``--json`` / ``--json-file`` the command line holds, read from the words themselves, so
    a command line argparse refuses still gets its JSON object. ``shardkit launch``: only its own
    options count (a ``--json`` after the script is the script's)."""
    command = command_of(argv)
    words = list(argv)
    if command == "launch":
        words = launch_own_options(words[words.index("launch") + 1:])
    request = JsonRequest()
    for i, word in enumerate(words):
        if word == "--":
            break
        following = words[i + 1] if i + 1 < len(words) else None
        if word == "--json":
            if command in _JSON_TAKES_FILE and following not in (None, "-") and not following.startswith("-"):
                request.file = following
            else:
                request.stdout = True
        elif word == "--json-file" and following is not None:
            request.file = following
        elif word.startswith("--json-file="):
            request.file = word.split("=", 1)[1]
    return request


def launch_own_options(words: list[str]) -> list[str]:
    """The words at the front of ``shardkit launch``'s arguments that are shardkit's own options (each with
    its value); the launcher's options and the script start after them. launch's parser and the JSON request
    read the same split."""
    own: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word in _LAUNCH_OWN:
            own.append(word)
        elif word in _LAUNCH_OWN_WITH_VALUE:
            own += words[i:i + 2]
            i += 1
        elif word.startswith(("--launcher=", "--json-file=")):
            own.append(word)
        else:
            break
        i += 1
    return own


@dataclass
class Ending:
    """How one ``shardkit.cli.main`` run ends: the status, the error line, the command's own result."""

    command: str | None
    request: JsonRequest
    code: int = 0
    error: str | None = None
    """The failure's one line (what main prints after 'error: '); None when the command ended by itself."""
    result: dict[str, Any] | None = None
    """The command's own JSON result, handed to ``emit_json``, written by :meth:`write` only."""
    args: argparse.Namespace | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields a failure adds (a usage error's usage line)."""
    written: bool = False

    def bind(self, args: argparse.Namespace) -> None:
        """The command line parsed: argparse's reading of --json/--json-file replaces the words' one."""
        self.args, self.command = args, getattr(args, "command", None) or self.command
        self.request = JsonRequest(stdout=bool(getattr(args, "json", False)),
                                   file=getattr(args, "json_file", None) or None)

    def fail(self, code: int, error: str, **extra: Any) -> None:
        self.code, self.error = code, error
        self.extra.update(extra)

    def final_object(self) -> dict[str, Any]:
        """The one object: the command's result with the run's status folded in, or the failure alone."""
        data: dict[str, Any] = dict(self.result) if self.result is not None else {"command": self.command}
        data.setdefault("command", self.command)
        if self.error is not None:
            data.update(ok=False, exit_code=self.code, error=self.error, **self.extra)
        elif self.result is None:
            # a command that ended with a status and no result of its own: its reason is on stderr
            data.update(ok=self.code == 0, exit_code=self.code,
                        error=None if self.code == 0 else f"exit status {self.code}; the reason is on stderr")
        else:
            data.setdefault("ok", self.code == 0)
            data.setdefault("exit_code", self.code)
            if self.code != 0:
                data.setdefault("error", _first_error(data) or f"exit status {self.code}; the reason is on stderr")
        return data

    def write(self, stdout: TextIO) -> None:
        """Write the object once: on ``stdout`` with --json, to PATH with --json-file (atomically). A
        --json-file the command's ranks wrote themselves (preflight) is left as they wrote it, even
        when the run then failed (their failure record names each rank's error)."""
        if self.written or not self.request.wanted:
            return
        self.written = True
        written_by_ranks = self.result is None and bool(getattr(self.args, "json_emitted", False))
        path = self.request.file if self.request.file != "-" else None
        if path and not written_by_ranks:
            from shardkit.storage.atomic import atomic_write_text

            try:
                atomic_write_text(path, json.dumps(self.final_object(), indent=2, default=_plain) + "\n")
            except OSError as exc:
                why = f"--json-file {path}: cannot be written ({exc.strerror or exc}); pass a path in a folder you can write"
                print(f"shardkit {self.command}: error: {why}", file=sys.stderr)
                self.fail(1, why)
        if self.request.stdout or self.request.file == "-":
            stdout.write(json.dumps(self.final_object(), indent=2, default=_plain) + "\n")
            stdout.flush()


def _first_error(data: dict[str, Any]) -> str | None:
    """A report's first error-level finding as one line (check, verify, versions: the findings say why)."""
    for finding in data.get("findings") or []:
        if isinstance(finding, dict) and finding.get("severity") == "error":
            where = f"{finding.get('key')}: " if finding.get("key") else ""
            return f"{where}{finding.get('message')}" + (f" ({finding['fix']})" if finding.get("fix") else "")
    return None


#: The run in progress (shardkit.cli.main pushes one per call; main may run inside main in tests).
ACTIVE: list[Ending] = []


def _plain(value: Any) -> Any:
    import os

    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return repr(value)
