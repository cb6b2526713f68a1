"""Every file shardkit reads is opened through shardkit.core.files (``regular_fd``, ``open_regular``,
``read_regular_file``, ``read_regular_text``, ``copy_regular``), which refuses a FIFO, device, socket or
folder by name instead of blocking on it or streaming it without end. This walks the package source and
fails on any other open of a file for reading: builtin ``open``/``io.open`` without a write mode,
``Path.open``/``read_text``/``read_bytes``, ``os.open`` without a write flag, ``shutil.copy*`` of a
source, and the loaders that take a path (``torch.load``, ``zipfile.ZipFile``, ``safetensors``'
``safe_open``/``load_file``, ``numpy.load``) unless handed a file the helper opened.

The few exceptions are listed in ALLOWED below, each with why it is not a user's file."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "shardkit"
HELPER_MODULE = "core/files.py"
#: Calls that return a file, descriptor or path the helper opened and checked (storage.checkpoint_file's
#: ``open_checked`` is ``open_regular`` with the rank-file messages: missing, empty, no permission).
HELPERS = {"regular_fd", "open_regular", "fd_path", "open_checked"}

#: (module, enclosing function, what is opened): why each is not a read of a user's file.
ALLOWED: dict[tuple[str, str, str], str] = {
    # shardkit's own package data, through importlib.resources (inside the installed package)
    ("platform/versions.py", "known_bad_table", "read_text"): "shardkit/data/deepspeed_known_bad.json",
    ("platform/verified.py", "verified_releases", "read_text"): "shardkit/data/verified_releases.json",
    # an installed package's own version.py, found through importlib (torch's build tag, without importing torch)
    ("platform/environment/accelerator.py", "_torch_cuda_build_without_import", "read_text"): "torch/version.py",
    ("platform/environment/ext_lock.py", "_torch_build_tag", "read_text"): "torch/version.py",
    # /proc: the kernel's files, regular and small
    ("platform/environment/ext_lock.py", "_proc_name", "read_text"): "/proc/PID/comm",
    ("platform/environment/ext_lock.py", "_filesystem_of", "read_text"): "/proc/mounts",
    ("platform/environment/memlock.py", "has_cap_ipc_lock", "open"): "/proc/self/status",
    # written a moment ago by this run's own ranks or processes, in a folder shardkit made
    ("run/spawn/results.py", "_collect", "read_bytes"): "a rank's result pickle in the run's temporary folder",
    ("run/spawn/silence.py", "poll", "read_text"): "a rank's heartbeat file in the run's temporary folder",
    ("run/preflight.py", "verdict", "read_text"): "the placement JSON the ranks just wrote",
    ("run/preflight.py", "_read_json", "read_text"): "the placement JSON the ranks just wrote",
    ("run/preflight.py", "_last_log_line", "read_text"): "a rank's log, written by the launch",
    ("commands/preflight.py", "_placement_json", "read_text"): "the ranks' JSON in a TemporaryDirectory",
    ("storage/shared_save.py", "read_json", "read_text"): "an owner file in shardkit's own staging folder",
    ("storage/shared_save.py", "_peer_counts", "read_text"): "a progress file in shardkit's own staging folder",
    # in memory or already open: no path is opened
    ("checkpoint/dcp/safe_load.py", "load_bytes", "torch.load"): "a BytesIO torch's DCP reader hands over",
    ("checkpoint/dcp/slices.py", "_item_zip", "zipfile.ZipFile"): "a window of a file its caller opened with open_regular",
    # shardkit's own output: written or copied inside a folder it just made
    ("storage/atomic.py", "atomic_open", "open"): "a temporary opened for writing (mode checked to hold 'w')",
    ("storage/atomic.py", "link", "shutil.copy2"): "a hard-link copy of a checkpoint shardkit wrote",
    ("storage/atomic.py", "_link_copy", "shutil.copytree"): "a hard-link copy of a checkpoint shardkit wrote",
    ("checkpoint/writers/universal.py", "_write", "shutil.copy2"): "a file of the staged output, copied beside itself",
    # opened only to fsync what shardkit itself just wrote or renamed, never read
    ("storage/atomic.py", "fsync_dir", "os.open"): "a folder shardkit wrote into, opened to fsync the entry",
    ("storage/atomic.py", "fsync_file", "os.open"): "a file shardkit wrote, opened to fsync its data",
}


def _call_name(node: ast.Call) -> str:
    f = node.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        base = f.value
        prefix = base.id if isinstance(base, ast.Name) else ""
        return f"{prefix}.{f.attr}" if prefix else f".{f.attr}"
    return ""


def _mode(node: ast.Call, position: int) -> str | None:
    """The constant mode string of an open call ('r' when none is given, None when not a constant)."""
    arg = node.args[position] if len(node.args) > position else next(
        (k.value for k in node.keywords if k.arg == "mode"), None)
    if arg is None:
        return "r"
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def _writes(mode: str | None) -> bool:
    return mode is not None and any(c in mode for c in "wxa") and "+" not in mode


def _os_open_writes(node: ast.Call) -> bool:
    flags = node.args[1] if len(node.args) > 1 else None
    names = {n.attr for n in ast.walk(flags) if isinstance(n, ast.Attribute)} if flags is not None else set()
    return bool(names & {"O_WRONLY", "O_CREAT"})


def _helper_bound(fn: ast.AST) -> set[str]:
    """Names bound in ``fn`` to what a helper returned (``with open_regular(p) as fh``, ``fd = regular_fd(p)``)."""
    bound: set[str] = set()

    def from_helper(value: ast.AST | None) -> bool:
        return isinstance(value, ast.Call) and _call_name(value).lstrip(".").split(".")[-1] in HELPERS

    for node in ast.walk(fn):
        if isinstance(node, ast.withitem) and from_helper(node.context_expr) and isinstance(node.optional_vars, ast.Name):
            bound.add(node.optional_vars.id)
        elif isinstance(node, ast.Assign) and from_helper(node.value):
            bound.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return bound


def _opened_by_helper(arg: ast.AST, bound: set[str]) -> bool:
    if isinstance(arg, ast.IfExp):
        return _opened_by_helper(arg.body, bound) and _opened_by_helper(arg.orelse, bound)
    if isinstance(arg, ast.Name):
        return arg.id in bound
    return isinstance(arg, ast.Call) and _call_name(arg).lstrip(".").split(".")[-1] in HELPERS


def _read_opens(tree: ast.Module) -> list[tuple[str, int, str]]:
    """(enclosing function, line, what) of every open of a file for reading outside the helper."""
    found: list[tuple[str, int, str]] = []

    def visit(node: ast.AST, fn: str, bound: set[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            fn, bound = node.name, bound | _helper_bound(node)
        if isinstance(node, ast.Call):
            name = _call_name(node)
            attr = name.split(".")[-1]
            first = node.args[0] if node.args else None
            what = None
            if name in ("open", "io.open", "codecs.open"):
                what = None if _writes(_mode(node, 1)) else name
            elif name == "os.open":
                what = None if _os_open_writes(node) else name
            elif attr == "open" and "." in name and not _writes(_mode(node, 0)):
                what = "Path.open"
            elif attr in ("read_text", "read_bytes") and "." in name:
                what = attr
            elif attr in ("copy", "copy2", "copyfile", "copytree") and name.startswith("shutil."):
                copy_function = next((k.value for k in node.keywords if k.arg == "copy_function"), None)
                uses_helper = isinstance(copy_function, ast.Name) and copy_function.id == "copy_regular"
                what = None if uses_helper else name
            elif name in ("torch.load", "zipfile.ZipFile", "ZipFile", "np.load", "numpy.load") or attr in (
                    "safe_open", "load_file"):
                what = None if first is not None and _opened_by_helper(first, bound) else name
            if what is not None:
                found.append((fn, node.lineno, what))
        for child in ast.iter_child_nodes(node):
            visit(child, fn, bound)

    visit(tree, "<module>", set())
    return found


def test_every_read_of_a_file_goes_through_the_one_helper():
    stray, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == HELPER_MODULE:
            continue
        for fn, line, what in _read_opens(ast.parse(path.read_text(), str(path))):
            key = (rel, fn, what)
            if key in ALLOWED:
                used.add(key)
            else:
                stray.append(f"shardkit/{rel}:{line} in {fn}(): {what}")
    assert not stray, ("files opened for reading outside shardkit.core.files (a FIFO there blocks for ever, a "
                       "device streams without end): open them with open_regular / regular_fd / read_regular_text, "
                       "or add them to ALLOWED with why they are no user's file:\n  " + "\n  ".join(stray))
    assert used == set(ALLOWED), f"ALLOWED entries that match nothing any more: {sorted(set(ALLOWED) - used)}"


def test_the_walk_sees_each_kind_of_open():
    """The walk itself: each spelling of a read is found, writes and the helper's own files are not."""
    source = '''
def reads(p, fh):
    open(p); open(p, "rb"); io.open(p, "r"); p.open(); p.read_text(); p.read_bytes(); os.open(p, os.O_RDONLY)
    torch.load(p); zipfile.ZipFile(p); safe_open(p, "pt"); shutil.copy2(p, q)
def writes(p):
    open(p, "wb"); open(p, "x"); p.open("w"); os.open(p, os.O_WRONLY | os.O_CREAT); shutil.copy2(p, q, copy_function=copy_regular)
def helped(p):
    with open_regular(p) as fh:
        zipfile.ZipFile(fh); torch.load(fd_path(fh, p), mmap=True); torch.load(fh)
    fd = regular_fd(p)
'''
    got = [(fn, what) for fn, _, what in _read_opens(ast.parse(source))]
    assert got == [("reads", w) for w in ("open", "open", "io.open", "Path.open", "read_text", "read_bytes", "os.open",
                                         "torch.load", "zipfile.ZipFile", "safe_open", "shutil.copy2")], got
