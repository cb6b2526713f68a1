"""Print shardkit's internal import graph problems: cycles, imports that run back up a layer,
packages that import each other, and imports of shardkit's own modules hidden inside functions.

Every `import`/`from ... import` inside shardkit/ counts, also those inside functions (they hide
the graph but are edges all the same). An import is "upward" when it names a module of a higher
layer (LAYERS below), or when a module imports its own package's ``__init__`` (the package's
re-export surface, which sits above its modules). Two packages (PACKAGE_DEPTH below) "import each
other" when a module of each imports a module of the other, directly.

An "inner import" is an import of a shardkit module written inside a function. Those belong at the
top of the file, except at the named lazy boundaries (LAZY_BOUNDARIES below, each with its reason)
and on a line that says why itself: a ``# lazy: keeps torch out of <command>`` comment on the
import, or on the comment line just above it (which covers the imports written right under it).

    python scripts/import_graph.py                 # exit 1 on a cycle, an upward import, an
                                                   # unlayered module or two packages importing each other
    python scripts/import_graph.py --strict-inner  # exit 1 also on an inner import
"""

from __future__ import annotations

import argparse
import ast
import re
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
    # what the machine and its software are: versions, environment probes, device rules, dist; and what a
    # run will need of it (the memory estimate)
    ("shardkit.platform", "shardkit.estimate"),
    # byte-level storage every floor above uses: atomic files, manifests, digests, streaming, torch's zip
    # and pickle read without torch, split-run meeting (shardkit/storage: no checkpoint format in it)
    ("shardkit.storage",),
    # the format-neutral checkpoint model (a tensor as byte-range pieces of source files); engine glue
    ("shardkit.checkpoint.model", "shardkit.engines"),
    # config rules; placement records and verdicts; what each engine writes and how to read it
    ("shardkit.checks", "shardkit.placement", "shardkit.checkpoint.zero3", "shardkit.checkpoint.zero12",
     "shardkit.checkpoint.dcp", "shardkit.checkpoint.hf_trainer", "shardkit.checkpoint.layout", "shardkit.checkpoint"),
    # one reader per checkpoint format (each produces the checkpoint model), one writer per format
    ("shardkit.checkpoint.readers", "shardkit.checkpoint.writers"),
    # checkpoint operations users run: save/resume, reshard, convert, consolidate
    ("shardkit.checkpoint.ops",),
    # the rank side of runs: spawning local ranks, the code they run, the automatic preflight
    ("shardkit.run.spawn", "shardkit.run.smoke_rank", "shardkit.run.preflight_rank", "shardkit.autopreflight"),
    # shardkit inside other people's training loops (the Hugging Face Trainer)
    ("shardkit.integrations",),
    # the host side of runs: smoke, preflight, launchers
    ("shardkit.run",),
    # one module per CLI command
    ("shardkit.commands",),
    # entry points: the CLI, and the sitecustomize a launched rank runs at start-up
    ("shardkit.cli", "shardkit.__main__", "shardkit.startup", "shardkit"),
]

# Where an import of a shardkit module may wait inside a function: each keeps a heavy dependency
# (torch, deepspeed, transformers, accelerate) out of a command or a process start that must stay
# light. "pkg.*" is the package and every module below it; a plain name is that module alone.
LAZY_BOUNDARIES: dict[str, str] = {
    "shardkit.commands.*": (
        "the CLI boundary: a command imports its implementation when it runs, so `shardkit --help` stays light"
    ),
    "shardkit": "the package __init__: the public API is loaded lazily, on first use of a name",
    "shardkit.integrations.trainer_hook": "imported at every rank's start-up (the Trainer import hook)",
    "shardkit.autopreflight.*": "imported at every rank's start-up (sitecustomize and the preflight hooks)",
    "shardkit.startup.*": (
        "the sitecustomize every launched rank runs before its script: it must never break or slow interpreter "
        "start-up, so it imports only when the automatic preflight is enabled, inside a try"
    ),
}

# A `# lazy: <why>` comment on the import (or on the comment line just above it) lets one inner
# import stand outside the boundaries: it names the heavy package it keeps out of which command.
LAZY_COMMENT = re.compile(r"#\s*lazy:\s*\S")

# A package is a module's first PACKAGE_DEPTH dotted components (shardkit.run, shardkit.integrations);
# checkpoint/ is a house of its own, so its packages are one level deeper (shardkit.checkpoint.zero3).
PACKAGE_DEPTH = 2
DEEPER_PACKAGES = {"shardkit.checkpoint": 3}


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


def import_targets(mod: str, is_pkg: bool, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """The shardkit modules one import statement names (other packages' modules are left out)."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        base = resolve(mod, is_pkg, node)
        # `from pkg import sub` is an edge to pkg.sub; `from mod import name` one to mod
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    found: list[str] = []
    for t in targets:
        # the longest known module name that prefixes the target
        while t and t not in modules:
            t = t.rpartition(".")[0]
        if t and t != mod and t not in found:
            found.append(t)
    return found


def edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[mod].update(import_targets(mod, is_pkg, node, modules))
    return graph


def package(mod: str) -> str:
    parts = mod.split(".")
    depth = DEEPER_PACKAGES.get(".".join(parts[:PACKAGE_DEPTH]), PACKAGE_DEPTH)
    return ".".join(parts[:depth])


def mutual_packages(graph: dict[str, set[str]]) -> list[tuple[str, str, list[str], list[str]]]:
    """Pairs of packages that import each other directly, with the module edges each way."""
    between: dict[tuple[str, str], list[str]] = {}
    for mod, targets in graph.items():
        for t in targets:
            a, b = package(mod), package(t)
            if a != b:
                between.setdefault((a, b), []).append(f"{mod} -> {t}")
    return [
        (a, b, sorted(between[a, b]), sorted(between[b, a]))
        for (a, b) in sorted(between)
        if a < b and (b, a) in between
    ]


def lazy_boundary(mod: str) -> bool:
    for pattern in LAZY_BOUNDARIES:
        if pattern.endswith(".*"):
            pkg = pattern[:-2]
            if mod == pkg or mod.startswith(pkg + "."):
                return True
        elif mod == pattern:
            return True
    return False


def lazy_comment_inline(lines: list[str], node: ast.stmt) -> bool:
    """A `# lazy:` comment on a line of the import itself."""
    return any(LAZY_COMMENT.search(line) for line in lines[node.lineno - 1 : node.end_lineno or node.lineno])


def lazy_comment_above(lines: list[str], node: ast.stmt) -> bool:
    """A `# lazy:` comment line just above the import (it covers the imports right under it too)."""
    above = lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
    return bool(LAZY_COMMENT.match(above))


def inner_imports(modules: dict[str, Path]) -> list[tuple[str, int, list[str]]]:
    """Imports of shardkit modules written inside a function, outside the lazy boundaries and
    without a `# lazy:` comment: (module, line, targets)."""
    found: list[tuple[str, int, list[str]]] = []
    for mod, path in modules.items():
        if lazy_boundary(mod):
            continue
        is_pkg = path.name == "__init__.py"
        text = path.read_text()
        lines = text.splitlines()

        def visit(node: ast.AST, in_function: bool) -> None:
            covered_until = -1  # last line of a run of imports under a `# lazy:` comment
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    if child.lineno == covered_until + 1 or lazy_comment_above(lines, child):
                        covered_until = child.end_lineno or child.lineno
                        continue
                    covered_until = -1
                    if lazy_comment_inline(lines, child):
                        continue
                    targets = import_targets(mod, is_pkg, child, modules) if in_function else []
                    if targets:
                        found.append((mod, child.lineno, targets))
                    continue
                covered_until = -1
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

        visit(ast.parse(text, str(path)), False)
    return sorted(found)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--strict-inner",
        action="store_true",
        help="exit 1 also when an inner import stands outside the lazy boundaries",
    )
    args = parser.parse_args(argv)
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

    mutual = mutual_packages(graph)
    for a, b, a_to_b, b_to_a in mutual:
        print(f"packages import each other: {a} <-> {b}")
        for edge in a_to_b + b_to_a:
            print(f"    {edge}")
    if not mutual:
        print("no two packages import each other")

    inner = inner_imports(modules)
    for mod, line, targets in inner:
        print(f"inner import: {mod}:{line} -> {', '.join(targets)}")
    print(
        f"{len(inner)} inner imports of shardkit modules outside the lazy boundaries "
        f"({', '.join(LAZY_BOUNDARIES)}) without a `# lazy:` comment"
        + ("" if args.strict_inner or not inner else "; not an error without --strict-inner")
    )
    failed = found or up or unlayered or mutual or (args.strict_inner and inner)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
