"""Reading config files: one clear ConfigError for every way a file can be unusable or hostile.

Every command that reads a config (check, preflight, launch, smoke, versions) goes through here, so
the limits below protect all of them: only regular files are opened (a device such as /dev/zero or
a FIFO streams without end, and ``st_size`` is 0 for both), the bytes actually read are capped,
nesting is bounded before any recursive code sees the data, and YAML aliases cannot expand a small
file into an exponential tree ("billion laughs") or a cycle.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from shardkit.config.paths import join
from shardkit.core.errors import ConfigError
from shardkit.core.files import FileReadError, read_regular_file

# A config bigger than this is not a config; refusing it keeps a hostile file from eating memory.
MAX_CONFIG_BYTES = 16 * 1024 * 1024
# PyYAML's safe parser is pure Python (about 70 KB/s on a busy 2-core machine): a smaller cap keeps a
# large YAML file from taking minutes. Real DeepSpeed / Accelerate YAML configs are a few KB.
MAX_YAML_BYTES = 256 * 1024
# Real configs nest 3-4 levels (zero_optimization.offload_param.device); 64 leaves room for anything
# legitimate while keeping every recursive walker (ours, DeepSpeed's pydantic models) far from
# Python's recursion limit.
MAX_NESTING = 64
# Values in the document after YAML aliases are expanded (a 10-line billion-laughs file expands to
# 10**9). Real configs hold under 1,000 values.
MAX_VALUES = 200_000

@dataclass
class LoadedConfig:
    """A parsed config plus what parsing alone noticed (the checks turn it into findings)."""

    data: dict[str, Any]
    """The parsed mapping, as DeepSpeed / Accelerate would see it (the last duplicate key wins)."""
    duplicate_keys: list[tuple[str, Any, Any]] = field(default_factory=list)
    """(key path, key, the value kept) for every key written more than once in one mapping: JSON, YAML and
    DeepSpeed keep the last value silently, so an earlier ``"stage": 3`` is lost."""
    syntax: str = "json"
    """'json', 'hjson' (a UTF-8 BOM, comments, trailing commas, unquoted keys: what DeepSpeed's own loader,
    hjson, accepts and ``json.load`` does not) or 'yaml'."""
    not_json: str = ""
    """For 'hjson': the first thing ``json.load`` refuses, with where it is (``a UTF-8 byte order mark (BOM)
    at byte 0``, ``a // comment at line 2, column 3``): the HF Trainer and Accelerate read the file so."""


def load_config(path: str | Path) -> dict[str, Any]:
    """Parse a JSON or YAML config file into a dict, or raise ConfigError naming the file."""
    return read_config(path).data


def read_config(path: str | Path) -> LoadedConfig:
    """Like load_config, keeping what parsing noticed (duplicate keys)."""
    p = Path(path)
    raw = _read_config_bytes(p)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{p}: is not UTF-8 text (byte {exc.start} is 0x{raw[exc.start]:02x}). "
            "A DeepSpeed/FSDP config must be a JSON or YAML text file."
        ) from exc
    if not text.strip():
        raise ConfigError(f"{p}: is empty. Generate one with `shardkit config zero3 -o {p.name}`.")
    return parse_config(text, source=str(p))


def _read_config_bytes(p: Path) -> bytes:
    """read_regular_file with MAX_CONFIG_BYTES, each refusal followed by what to do about it."""
    try:
        return read_regular_file(p, MAX_CONFIG_BYTES)
    except FileReadError as exc:
        if exc.reason == "folder":
            raise ConfigError(f"{p}: is a directory, not a config file. Pass the JSON/YAML file inside it.") from None
        if exc.reason == "too_large":
            raise ConfigError(f"{p}: more than {MAX_CONFIG_BYTES} bytes is too large for a config file (limit "
                              f"{MAX_CONFIG_BYTES}). Is this a checkpoint or a data file?") from None
        fix = {
            "missing": f"Check the path (relative paths are from {Path.cwd()}).",
            "not_regular": "shardkit reads configs only from regular files: save the config to a file and pass that.",
        }.get(exc.reason, "Check its permissions.")
        raise ConfigError(f"{exc}. {fix}") from exc


def parse_config_text(text: str, source: str = "<config>") -> dict[str, Any]:
    """Parse config text; YAML only for .yaml/.yml sources or when the text is not JSON."""
    return parse_config(text, source).data


def parse_config(text: str, source: str = "<config>") -> LoadedConfig:
    """parse_config_text, keeping the duplicate keys parsing saw."""
    if not source.endswith((".yaml", ".yml")):
        try:
            return _mapping(_parse_json(text, source), source)
        except json.JSONDecodeError as exc:
            # DeepSpeed reads its config file with hjson (runtime/config.py: hjson.load): comments and
            # trailing commas are fine for it, so they are for the check (with a warning, since
            # transformers and accelerate read the same file with json.load)
            # a BOM is not whitespace to str.lstrip: without this a BOM'd JSON file went to YAML, which skips it
            start = text.lstrip(_BOM + " \t\r\n")
            looks_json = start.startswith(("{", "[", "//", "/*", "#")) or source.endswith(".json")
            hjson_loaded = _parse_hjson(text, source) if looks_json else None
            if hjson_loaded is not None:
                hjson_loaded.not_json = json_refusal(text, exc)
                return _mapping(hjson_loaded, source)
            if start.startswith(("{", "[")):
                raise ConfigError(
                    f"{source}: invalid JSON ({json_refusal(text, exc)}), and not valid hjson (DeepSpeed's own "
                    "loader) either. Fix the syntax there."
                ) from exc
    loaded = _mapping(_parse_yaml(text, source), source)
    loaded.syntax = "yaml"
    return loaded


_BOM = "\ufeff"


def json_refusal(text: str, exc: json.JSONDecodeError) -> str:
    """What ``json.load`` refuses in ``text`` first, said as a person would, with its line and column (or
    byte): a UTF-8 BOM (``json.loads`` refuses a str that starts with one; transformers opens the file as
    ``utf-8``, not ``utf-8-sig``, so the BOM reaches it), a comment, a trailing comma, an unquoted or
    single-quoted key, else json's own words."""
    if text.startswith(_BOM):
        bom = "a UTF-8 byte order mark (BOM, bytes EF BB BF) at byte 0"
        try:
            json.loads(text[1:])
        except json.JSONDecodeError as rest:
            # positions in the rest are the file's, but for the BOM's one character on line 1
            return f"{bom}, then {json_refusal(text[1:], rest)}"
        except ValueError:
            return bom
        return bom
    pos = min(exc.pos, len(text))
    here = text[pos:pos + 2]
    before = text[:pos].rstrip()
    if here.startswith(("//", "/*", "#")):
        what = "a comment"
    elif text[pos:pos + 1] in ("}", "]") and before.endswith(","):
        pos = len(before) - 1
        what = "a trailing comma"
    elif exc.msg.startswith("Expecting property name") and text[pos:pos + 1] == "'":
        what = "a single-quoted key"
    elif exc.msg.startswith("Expecting property name") and (text[pos:pos + 1].isalpha() or text[pos:pos + 1] == "_"):
        what = "an unquoted key"
    else:
        what = f"{exc.msg.lower()}"
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return f"{what} at line {line}, column {column}"


def _parse_hjson(text: str, source: str) -> LoadedConfig | None:
    """``text`` as DeepSpeed's loader reads it (hjson), or None when hjson is missing or refuses it."""
    try:
        import hjson
    except ImportError:  # DeepSpeed depends on it; without DeepSpeed, JSON's verdict stands
        return None
    pairs_hook, repeated = _duplicate_recorder()
    try:
        data = hjson.loads(text, object_pairs_hook=pairs_hook)
    except RecursionError:
        raise _too_deep(source) from None
    except (ValueError, TypeError):  # HjsonDecodeError is a ValueError
        return None
    if not isinstance(data, dict):
        return None
    _check_shape(data, source)
    return LoadedConfig(data, _duplicate_paths(data, {id(d): keys for d, keys in repeated}), syntax="hjson")


def _mapping(loaded: LoadedConfig, source: str) -> LoadedConfig:
    if not isinstance(loaded.data, dict):
        raise ConfigError(
            f"{source}: top level is {type(loaded.data).__name__}, expected a mapping of keys "
            '(e.g. {"zero_optimization": {...}}).'
        )
    return loaded


def _too_deep(source: str) -> ConfigError:
    return ConfigError(
        f"{source}: nested more than {MAX_NESTING} levels deep (shardkit's depth limit for a config file; "
        "real DeepSpeed/Accelerate configs nest 3-4 levels). Is this the right file?"
    )


def _too_many(source: str, what: str) -> ConfigError:
    return ConfigError(
        f"{source}: {what} more than {MAX_VALUES} values (shardkit's limit for a config file; real configs "
        "hold under 1,000). Is this the right file?"
    )


# --- JSON --------------------------------------------------------------------------------------


def _parse_json(text: str, source: str) -> LoadedConfig:
    pairs_hook, repeated = _duplicate_recorder()
    try:
        data = json.loads(text, object_pairs_hook=pairs_hook)
    except RecursionError:  # the C decoder recurses once per level
        raise _too_deep(source) from None
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # e.g. an integer literal past Python's 4300-digit conversion limit
        raise ConfigError(f"{source}: a value cannot be read: {exc}. Fix that value.") from exc
    _check_shape(data, source)
    return LoadedConfig(data, _duplicate_paths(data, {id(d): keys for d, keys in repeated}))


def _duplicate_recorder() -> tuple[Callable[[list[tuple[str, Any]]], dict[str, Any]], list[tuple[dict[str, Any], list[Any]]]]:
    """An ``object_pairs_hook`` (json and hjson take the same one) and the list it fills with every
    mapping that repeated a key (each dict is kept alive there, so ``id``s stay unique)."""
    repeated: list[tuple[dict[str, Any], list[Any]]] = []

    def pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        d = dict(pairs)
        if len(d) != len(pairs):
            repeated.append((d, _repeats(k for k, _ in pairs)))
        return d

    return pairs_hook, repeated


def _repeats(keys: Iterator[Any]) -> list[Any]:
    seen: set[Any] = set()
    again: list[Any] = []
    for k in keys:
        if k in seen and k not in again:
            again.append(k)
        seen.add(k)
    return again


def _children(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, list):
        return value
    return []


def _check_shape(data: Any, source: str) -> None:
    """Depth and size of parsed data, walked without recursion."""
    count = 0
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise _too_many(source, "holds")
        if isinstance(value, (dict, list)):
            if depth > MAX_NESTING:
                raise _too_deep(source)
            stack.extend((child, depth + 1) for child in _children(value))


def _duplicate_paths(data: Any, repeated: dict[int, list[Any]]) -> list[tuple[str, Any, Any]]:
    """Key paths of the repeated keys recorded while parsing (first path a shared mapping has)."""
    if not repeated:
        return []
    out: list[tuple[str, Any, Any]] = []
    done: set[int] = set()
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, prefix = stack.pop()
        if isinstance(value, dict):
            if id(value) in repeated and id(value) not in done:
                done.add(id(value))
                out.extend((join(prefix, k), k, value.get(k)) for k in repeated[id(value)])
            stack.extend((v, join(prefix, k)) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((v, f"{prefix}[{i}]") for i, v in reversed(list(enumerate(value))))
    return out


# --- YAML --------------------------------------------------------------------------------------


def _parse_yaml(text: str, source: str) -> LoadedConfig:
    import yaml

    if len(text.encode("utf-8")) > MAX_YAML_BYTES:
        raise ConfigError(
            f"{source}: more than {MAX_YAML_BYTES} bytes of YAML (shardkit's limit for a YAML config; real ones "
            "are a few KB). Is this the right file? A large config can be given as JSON."
        )
    loader = None
    try:
        loader = _bounded_loader_class()(text)  # its reader refuses control characters right here
        node = loader.get_single_node()
        if node is None:
            return LoadedConfig(None)  # type: ignore[arg-type]  # refused as "top level is NoneType"
        _check_yaml_graph(node, source)
        data = loader.construct_document(node)
        return LoadedConfig(data, _duplicate_paths(data, {id(d): keys for d, keys in loader.repeated}))
    except ConfigError:
        raise
    except _YamlTooDeep:
        raise _too_deep(source) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{source}: neither valid JSON nor valid YAML{where}: {problem}.") from exc
    except RecursionError as exc:  # not reachable with the depth bound; kept as the last line of defence
        raise _too_deep(source) from exc
    except ValueError as exc:  # a scalar PyYAML cannot convert (e.g. a 5000-digit integer)
        raise ConfigError(f"{source}: a value cannot be read: {exc}. Fix that value.") from exc
    finally:
        if loader is not None:
            loader.dispose()


class _YamlTooDeep(Exception):
    pass


_LOADER: Any = None


def _bounded_loader_class() -> Any:
    """yaml.SafeLoader that bounds nesting while composing and records duplicate mapping keys."""
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    import yaml

    class BoundedSafeLoader(yaml.SafeLoader):
        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self.depth = 0
            self.repeated: list[tuple[dict[Any, Any], list[Any]]] = []

        def compose_node(self, parent: Any, index: Any) -> Any:
            if not self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent):
                return super().compose_node(parent, index)
            self.depth += 1
            try:
                if self.depth > MAX_NESTING:
                    raise _YamlTooDeep()
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def construct_bounded_map(self, node: Any) -> Iterator[dict[Any, Any]]:
            data: dict[Any, Any] = {}
            yield data
            keys = [
                k.value
                for k, _ in node.value
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge"
            ]
            again = _repeats(iter(keys))
            if again:
                self.repeated.append((data, again))
            data.update(self.construct_mapping(node))

    BoundedSafeLoader.add_constructor("tag:yaml.org,2002:map", BoundedSafeLoader.construct_bounded_map)
    _LOADER = BoundedSafeLoader
    return _LOADER


def _check_yaml_graph(root: Any, source: str) -> None:
    """Refuse alias cycles and documents whose aliases expand past MAX_VALUES values or MAX_NESTING
    levels. Aliases make the composed nodes a graph; sizes are computed once per node (memoized,
    without recursion), so a billion-laughs file is measured in microseconds, never expanded."""
    import yaml

    def kids(node: Any) -> list[Any]:
        if isinstance(node, yaml.MappingNode):
            return [n for pair in node.value for n in pair]
        if isinstance(node, yaml.SequenceNode):
            return list(node.value)
        return []

    size: dict[int, int] = {}
    height: dict[int, int] = {}
    in_progress: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        nid = id(node)
        if children_done:
            children = kids(node)
            size[nid] = 1 + sum(size[id(k)] for k in children)
            height[nid] = 1 + max((height[id(k)] for k in children), default=0) if isinstance(
                node, (yaml.MappingNode, yaml.SequenceNode)
            ) else 0
            in_progress.discard(nid)
            if size[nid] > MAX_VALUES:
                raise _too_many(source, "its aliases expand to")
            if height[nid] > MAX_NESTING:
                raise _too_deep(source)
            continue
        if nid in size:
            continue
        if nid in in_progress:
            raise ConfigError(
                f"{source}: a YAML alias refers to a mapping or list that contains it (a cycle): the config would "
                "be infinitely deep. Replace the alias (*name) with the values it should hold."
            )
        in_progress.add(nid)
        stack.append((node, True))
        stack.extend((k, False) for k in kids(node))


def config_kind(cfg: dict[str, Any]) -> str:
    """'fsdp' for shardkit's FSDP2 config (top-level ``"fsdp"`` key), else 'deepspeed'."""
    return "fsdp" if "fsdp" in cfg else "deepspeed"


def is_fsdp_config(cfg: object) -> bool:
    """config_kind for a value that may not even be a mapping (a launch argument, a loaded file)."""
    return isinstance(cfg, dict) and config_kind(cfg) == "fsdp"


def config_digest(config: Any) -> str | None:
    """sha256 of the config's canonical JSON (sorted keys, no spaces); None without a config (None
    or an empty mapping, which configures nothing). Manifests record it and resume compares it;
    placement records hold ``config_digest(cfg) or ""``, so every rank's digest is the same string
    exactly when their configs are equal."""
    if config is None or (isinstance(config, dict) and not config):
        return None
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
