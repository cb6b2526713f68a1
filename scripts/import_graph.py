"""Print shardkit's internal import graph problems: cycles and imports that run back up a layer.

Every `import`/`from ... import` inside shardkit/ counts, also those inside functions (they hide
the graph but are edges all the same). An import is "upward" when it names a module of a higher
layer (LAYERS below), or when a module imports its own package's ``__init__`` (the package's
re-export surface, which sits above its modules).

    python scripts/import_graph.py          # exit 1 when a cycle or an upward edge exists
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "shardkit"


# Bottom to top; a module may import its own layer and those below. The longest matching prefix
# decides a module's layer. docs/architecture.md draws the same picture.
LAYERS: list[tuple[str, ...]] = [
    # the basic types: errors, findings, report rendering, capped file reading
    ("shardkit._version", "shardkit.core"),
    # config files -> typed views; generated configs
    ("shardkit.config",),
    # what the machine and its software are: versions, environment probes, device rules, dist
    ("shardkit.platform",),
    # checkpoint plumbing (atomic files, manifest, verify, streaming) and engine glue
    ("shardkit.checkpoint.io", "shardkit.engines"),
    # config rules; placement records and verdicts; what each engine writes and how to read it
    ("shardkit.checks", "shardkit.placement", "shardkit.checkpoint.zero3", "shardkit.checkpoint.dcp",
     "shardkit.checkpoint.hf_trainer", "shardkit.checkpoint"),
    # checkpoint operations users run: save/resume, reshard, convert, consolidate
    ("shardkit.checkpoint.ops",),
    # the rank side of runs: spawning local ranks, the code they run, the automatic preflight
    ("shardkit.run.spawn", "shardkit.run.smoke_rank", "shardkit.run.preflight_rank", "shardkit.run.autopreflight"),
    # shardkit inside other people's training loops (the Hugging Face Trainer)
    ("shardkit.integrations",),
    # the host side of runs: smoke, preflight, launchers; the sitecustomize that installs every hook
    ("shardkit.run", "shardkit.run.autopreflight.sitedir"),
    # one module per CLI command
    ("shardkit.commands",),
    ("shardkit.cli", "shardkit.__main__", "shardkit"),
]

def layer(mod: str) -> int:
    best, best_len = len(LAYERS), -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            inside = mod == prefix or (prefix != "shardkit" and mod.startswith(prefix + "."))
            if inside and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = resolve(mod, is_pkg, node)
                # `from pkg import sub` is an edge to pkg.sub; `from mod import name` one to mod
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            for t in targets:
                # the longest known module name that prefixes the target
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str, str]]:
    bad = []
    for mod, targets in graph.items():
        for t in targets:
            if mod.startswith(t + "."):
                bad.append((mod, t, "imports its own package"))
            elif layer(t) > layer(mod):
                bad.append((mod, t, f"imports a higher layer ({layer(mod)} -> {layer(t)})"))
    return sorted(bad)


def main() -> int:
    modules = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    graph = edges(modules)
    n_edges = sum(len(v) for v in graph.values())
    found = cycles(graph)
    up = upward(graph)
    print(f"{len(modules)} modules, {n_edges} internal import edges (function-level included)")
    for comp in found:
        print("cycle:", " <-> ".join(comp))
    unlayered = sorted(m for m in modules if layer(m) == len(LAYERS))
    for mod in unlayered:
        print(f"unlayered: {mod} (add it to LAYERS)")
    for mod, t, why in up:
        print(f"upward: {mod} -> {t}: {why}")
    if not found and not up:
        print("no cycles, no upward imports")
    return 1 if found or up or unlayered else 0


if __name__ == "__main__":
    raise SystemExit(main())
