"""Schema rule: DeepSpeed's own config classes are the ground truth.

Each top-level section is parsed on its own with ``deepspeed.runtime.config.DeepSpeedConfig`` so
every section's errors are reported (DeepSpeed stops at the first) and each pydantic error gets its
full key path. A final parse of the whole config catches cross-section checks, and a key-tracking
dict reveals top-level keys DeepSpeed never reads (it ignores them silently: a typo such as
``zero_optimisation`` quietly means ZeRO stage 0).

"auto" values are removed before parsing (the auto rule reports them): DeepSpeed drops them itself.
The batch keys are owned by the batch rule, which knows the world size; DeepSpeed offline assumes 1.
"""

from __future__ import annotations

import collections.abc as cabc
import contextlib
import difflib
import io
import logging
import sys
from typing import Any, Iterator

from shardkit.config.paths import get, guess_key, segment, strip_auto
from shardkit.config.view import enabled
from shardkit.core.findings import Finding, Severity

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# DeepSpeed fails hard without one of these; the batch rule reports a missing/bad value.
_PLACEHOLDER_BATCH = {"train_micro_batch_size_per_gpu": 1}
_DS_LOGGERS = ("DeepSpeed", "deepspeed")


def deepspeed_schema_findings(cfg: dict[str, Any]) -> list[Finding]:
    """Findings for every section DeepSpeed's parser rejects, plus keys it would ignore."""
    config_cls = _import_deepspeed_config()
    if config_cls is None:
        return [
            Finding(
                Severity.WARNING,
                "<top level>",
                None,
                "deepspeed is not importable here, so DeepSpeed's own schema was not applied "
                "(unknown keys, wrong types and bad enum values go unreported)",
                'pip install "deepspeed>=0.16.0,<0.20" and run the check again',
                "schema-unavailable",
            )
        ]
    clean = strip_auto(cfg)
    findings: list[Finding] = []
    failed_sections: set[str] = set()
    with _captured_deepspeed_logs() as records:
        for section, value in clean.items():
            if section in BATCH_KEYS:
                continue
            found = _parse(config_cls, {**_PLACEHOLDER_BATCH, section: value}, section, clean)
            if found:
                failed_sections.add(section)
                findings.extend(found)
        whole = {k: v for k, v in clean.items() if k not in failed_sections and k not in BATCH_KEYS}
        if enabled(whole.get("fp16")) and (enabled(whole.get("bf16")) or enabled(whole.get("bfloat16"))):
            # owned by the precision rule, which names the key; let the parse check the rest
            whole["fp16"] = {**whole["fp16"], "enabled": False}
        tracker = _KeyTracker({**_PLACEHOLDER_BATCH, **whole})
        findings.extend(_parse(config_cls, tracker, None, clean))
    findings.extend(_unread_keys(cfg, tracker.seen | set(BATCH_KEYS)))
    findings.extend(_log_findings(records, clean))
    return findings


def _import_deepspeed_config() -> Any:
    """Import DeepSpeedConfig with its import-time log lines kept off stdout (``--json`` owns it)."""
    if "deepspeed.runtime.config" not in sys.modules:
        buf = io.StringIO()
        real_stdout = sys.stdout
        try:
            with contextlib.redirect_stdout(buf):
                from deepspeed.runtime.config import DeepSpeedConfig  # noqa: F401
        except Exception:  # deepspeed missing or broken: reported as a finding by the caller
            return None
        finally:
            # DeepSpeed's handlers captured sys.stdout at creation; point them back at the real one.
            for lg in [logging.getLogger(n) for n in _DS_LOGGERS] + [logging.getLogger()]:
                for h in lg.handlers:
                    if isinstance(h, logging.StreamHandler) and h.stream is buf:
                        h.setStream(real_stdout)
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
    except Exception:
        return None
    return DeepSpeedConfig


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _captured_deepspeed_logs() -> Iterator[list[logging.LogRecord]]:
    """Collect DeepSpeed's warnings during parsing instead of printing them."""
    handler = _ListHandler()
    saved = []
    for name in _DS_LOGGERS:
        lg = logging.getLogger(name)
        saved.append((lg, list(lg.handlers), lg.propagate))
        lg.handlers = [handler]
        lg.propagate = False
    try:
        yield handler.records
    finally:
        for lg, handlers, propagate in saved:
            lg.handlers = handlers
            lg.propagate = propagate


class _KeysView(cabc.KeysView):
    def __init__(self, mapping: dict[str, Any], seen: set[str]) -> None:
        super().__init__(mapping)
        self._seen = seen

    def __contains__(self, key: object) -> bool:
        self._seen.add(key)  # type: ignore[arg-type]
        return key in self._mapping


class _KeyTracker(dict):
    """A dict that remembers which keys DeepSpeed looked up (copies share the record)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.__dict__.setdefault("seen", set())

    def __getitem__(self, key: Any) -> Any:
        self.seen.add(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.seen.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.seen.add(key)
        return super().__contains__(key)

    def keys(self) -> Any:  # type: ignore[override]
        return _KeysView(dict(self), self.seen)


def _parse(config_cls: Any, data: dict[str, Any], section: str | None, cfg: dict[str, Any]) -> list[Finding]:
    """Run DeepSpeedConfig on ``data``; turn whatever it raises into findings."""
    from pydantic import ValidationError

    try:
        config_cls(data)
        return []
    except ValidationError as exc:
        return _validation_findings(exc, section, cfg)
    except RecursionError:
        return [_refused(section or "<top level>", None, "the value is nested too deeply to parse", "schema")]
    except Exception as exc:  # DeepSpeed asserts and raises ValueError/TypeError/KeyError on bad input
        text = str(exc).strip() or type(exc).__name__
        if section is not None:
            inner = guess_key(text, cfg[section], fallback="") if isinstance(cfg.get(section), dict) else ""
            key = f"{segment(section)}.{inner}" if inner else segment(section)
        else:
            key = guess_key(text, cfg)
        value = _value_at(cfg, key)
        return [_refused(key, value, f"DeepSpeed refuses this config: {text}", "schema")]


def _refused(key: str, value: Any, message: str, rule: str) -> Finding:
    return Finding(
        Severity.ERROR,
        key,
        value,
        message,
        "change the value to one DeepSpeed accepts (see https://www.deepspeed.ai/docs/config-json/), "
        "or regenerate the file with `shardkit config`",
        rule,
    )


def _validation_findings(exc: Any, section: str | None, cfg: dict[str, Any]) -> list[Finding]:
    out = []
    model = _model_class(exc.title)
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ())]
        prefix = segment(section) if section is not None else guess_key(str(err.get("msg", "")), cfg)
        key = ".".join([prefix, *(segment(p) for p in loc)]) if loc else prefix
        kind = err.get("type", "")
        msg = str(err.get("msg", "invalid value"))
        if msg.startswith(("Assertion failed, ", "Value error, ")):
            msg = msg.split(", ", 1)[1]
        value = err.get("input") if loc else _value_at(cfg, key)
        if kind == "extra_forbidden":
            valid = _field_names(model, loc[:-1])
            close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.6) if valid else []
            hint = f"; did you mean {close[0]!r}?" if close else ""
            msg = f"unknown key: DeepSpeed ({exc.title}) rejects it{hint}"
            fix = f"remove it or rename it to {'.'.join([prefix, *loc[:-1], close[0]])}" if close else "remove it"
            if valid and not close:
                fix += f" (valid keys here: {', '.join(sorted(valid))})"
            out.append(Finding(Severity.ERROR, key, value, msg, fix, "schema-unknown-key"))
        else:
            out.append(
                Finding(
                    Severity.ERROR,
                    key,
                    value,
                    f"DeepSpeed ({exc.title}) rejects this value: {msg}",
                    "use a value of the type/choice stated; `shardkit config` writes known-good values",
                    "schema" if loc else "schema-section",
                )
            )
    return out


def _value_at(cfg: dict[str, Any], key: str) -> Any:
    return get(cfg, key)


def _model_class(title: str) -> Any:
    """The DeepSpeed pydantic class named in a ValidationError (already imported by the parse)."""
    from pydantic import BaseModel

    for name, module in list(sys.modules.items()):
        if not name.startswith("deepspeed") or module is None:
            continue
        cls = getattr(module, title, None)
        if isinstance(cls, type) and issubclass(cls, BaseModel):
            return cls
    return None


def _field_names(model: Any, loc: list[str]) -> list[str]:
    """Field names and aliases accepted at ``loc`` inside ``model`` (walking nested models)."""
    import typing

    from pydantic import BaseModel

    for part in loc:
        if model is None:
            return []
        info = model.model_fields.get(part) or next(
            (f for f in model.model_fields.values() if f.alias == part), None
        )
        if info is None:
            return []
        candidates = [info.annotation, *typing.get_args(info.annotation)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    if model is None:
        return []
    names = []
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if extra.get("deprecated"):
            continue
        names.append(info.alias or name)
    return names


def _unread_keys(cfg: dict[str, Any], read: set[Any]) -> list[Finding]:
    """Top-level keys DeepSpeed's config parser never looks at: silently ignored."""
    out = []
    known = sorted(k for k in read if isinstance(k, str))
    for key in cfg:
        if key in read:
            continue
        name = segment(key)
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.75)
        if close:
            out.append(
                Finding(
                    Severity.ERROR,
                    name,
                    cfg[key],
                    f"DeepSpeed never reads top-level key {key!r} and ignores it silently; it looks like a typo "
                    f"of {close[0]!r}, so that setting is not applied",
                    f"rename it to {close[0]!r}",
                    "unknown-top-level-key",
                )
            )
        else:
            out.append(
                Finding(
                    Severity.WARNING,
                    name,
                    cfg[key],
                    f"DeepSpeed's config parser never reads top-level key {key!r}: it is ignored (unless your "
                    "own code reads it)",
                    "remove it, or check its spelling against https://www.deepspeed.ai/docs/config-json/",
                    "unknown-top-level-key",
                )
            )
    return out


def _log_findings(records: list[logging.LogRecord], cfg: dict[str, Any]) -> list[Finding]:
    """DeepSpeed's own parse-time warnings (deprecated keys ...), made into findings once each."""
    out, seen = [], set()
    for rec in records:
        text = rec.getMessage().strip()
        if not text or text in seen or "accelerator" in text.lower():
            continue
        seen.add(text)
        key = guess_key(text, cfg)
        out.append(
            Finding(
                Severity.WARNING,
                key,
                _value_at(cfg, key),
                f"DeepSpeed warns while parsing: {text}",
                "follow DeepSpeed's advice in the message (deprecated keys keep working only until removed)",
                "deepspeed-warning",
            )
        )
    return out
