"""Findings and reports: plain data shared by the CLI table, ``--json`` output and tests."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable


class Severity(str, Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


@dataclass(frozen=True)
class Finding:
    """One thing a check noticed about a config, a version or a checkpoint."""

    severity: Severity
    """error: the run will fail or silently misbehave; warning: legitimate but likely a mistake."""
    key: str
    """Dotted key path the finding is about (``zero_optimization.offload_param.device``)."""
    value: Any
    """The value seen at ``key`` (``None`` when the key is absent)."""
    message: str
    """What is wrong and why, citing the upstream issue where one exists."""
    fix: str
    """What to change so the finding goes away."""
    rule: str = ""
    """Stable identifier of the rule that produced it, for filtering and tests."""

    def to_dict(self) -> dict[str, Any]:
        # not dataclasses.asdict: it recurses into the value and overflows on deeply nested configs
        return {
            "severity": self.severity.value,
            "key": self.key,
            "value": _jsonable(self.value),
            "message": self.message,
            "fix": self.fix,
            "rule": self.rule,
        }


@dataclass
class Report:
    """Findings about one subject (a config file, a checkpoint ...)."""

    subject: str
    findings: list[Finding] = field(default_factory=list)

    def add(self, finding: Finding) -> None:
        self.findings.append(finding)

    def extend(self, findings: Iterable[Finding]) -> None:
        self.findings.extend(findings)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.ERROR]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.WARNING]

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "subject": self.subject,
            "ok": self.ok,
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "findings": [f.to_dict() for f in self.findings],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError, RecursionError):
        text = repr(value) if not isinstance(value, (dict, list)) else f"<{type(value).__name__} too deep to show>"
        return text
