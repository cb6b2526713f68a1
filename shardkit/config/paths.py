"""Key paths over nested config dicts: walking, finding "auto" values, and naming the key a
free-text upstream message is about."""

from __future__ import annotations

import json
import re
from typing import Any, Iterator

from shardkit.config.view import is_auto

# Guard against hostile nesting (the fuzz test builds deep configs); real configs are shallow.
MAX_DEPTH = 32


_PLAIN = re.compile(r"^[A-Za-z0-9_\-]+$")


def segment(key: Any) -> str:
    """One path segment as printed: plain names as-is, anything else (empty, dots, spaces,
    non-strings) JSON-quoted so the path stays unambiguous and never empty."""
    if isinstance(key, str) and _PLAIN.match(key):
        return key
    return json.dumps(key if isinstance(key, str) else str(key), ensure_ascii=True)


def join(prefix: str, key: Any) -> str:
    return f"{prefix}.{segment(key)}" if prefix else segment(key)


def walk(cfg: Any, prefix: str = "", depth: int = 0) -> Iterator[tuple[str, Any]]:
    """Every (dotted path, value) in a nested dict/list, parents before children."""
    if depth > MAX_DEPTH:
        return
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            path = join(prefix, k)
            yield path, v
            yield from walk(v, path, depth + 1)
    elif isinstance(cfg, list):
        for i, v in enumerate(cfg):
            path = f"{prefix}[{i}]"
            yield path, v
            yield from walk(v, path, depth + 1)


def auto_paths(cfg: dict[str, Any]) -> list[str]:
    """Key paths whose value is exactly "auto"."""
    return [path for path, value in walk(cfg) if is_auto(value)]


def strip_auto(cfg: Any, depth: int = 0) -> Any:
    """A copy without "auto" values (what DeepSpeed itself does, but recursively and visibly)."""
    if depth > MAX_DEPTH:
        return cfg
    if isinstance(cfg, dict):
        return {k: strip_auto(v, depth + 1) for k, v in cfg.items() if not is_auto(v)}
    if isinstance(cfg, list):
        return [strip_auto(v, depth + 1) for v in cfg]
    return cfg


def get(cfg: Any, path: str, default: Any = None) -> Any:
    """Value at a dotted path (no list indices), or ``default``."""
    node = cfg
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def has(cfg: Any, path: str) -> bool:
    sentinel = object()
    return get(cfg, path, sentinel) is not sentinel


def delete(cfg: dict[str, Any], path: str) -> bool:
    """Remove the key at ``path``; True when something was removed."""
    parts = path.split(".")
    node: Any = cfg
    for part in parts[:-1]:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    if isinstance(node, dict) and parts[-1] in node:
        del node[parts[-1]]
        return True
    return False


def guess_key(message: str, cfg: dict[str, Any], fallback: str = "<top level>") -> str:
    """The most specific config key path a free-text message mentions (upstream assertion
    messages name keys but not paths); ``fallback`` when none is mentioned."""
    best, best_len = None, 0
    for path, _ in walk(cfg):
        if "[" in path:
            continue
        leaf = path.rsplit(".", 1)[-1]
        if len(leaf) < 3:
            continue
        if re.search(rf"(?<![A-Za-z0-9_]){re.escape(leaf)}(?![A-Za-z0-9_])", message, flags=re.IGNORECASE):
            score = len(leaf) * 100 + path.count(".")
            if score > best_len:
                best, best_len = path, score
    return best or fallback
