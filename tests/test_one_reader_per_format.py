"""One reader per checkpoint format: a DeepSpeed ZeRO rank file is parsed in ``shardkit/checkpoint/readers/``
and nowhere else, so a fix to how those files are read has one home (two ZeRO-3 readers once lived side by
side, and a fix landed in one of them only).

The rule, checked on the AST of every module of the shardkit package outside ``checkpoint/readers/``:

1. No loader is handed a ZeRO rank file. A loader is ``torch.load``, ``safe_torch_load``, ``read_structure``,
   ``pickle.load``/``loads``, builtin ``open``, the checked openers ``open_regular``, ``regular_fd`` and
   ``open_checked``, or any function called ``load`` (the old ZeRO-3 reader bound its loader to that name). A rank file is an argument that names one: a string holding ``_model_states.pt``,
   ``_optim_states.pt`` or ``zero_pp_rank_``; the file-name constants ``MODEL_FILE``, ``OPTIM_FILE``,
   ``OPTIM_FILE_NAME`` or ``RANK_FILE``; a checkpoint's ``model_files``/``optim_files``; or a name the
   same function bound to one of those (``path = ckpt.optim_files[r]``, ``for f in ckpt.optim_files``).
2. No module reads the keys DeepSpeed's rank files keep their layout and partitions under:
   ``fp32_flat_groups``, ``single_partition_of_fp32_groups``, ``param_shapes``, ``frozen_param_fragments``,
   ``optimizer_state_dict`` (also as ``OPTIMIZER_KEY``) and ``base_optimizer_state``. A read is
   ``x["key"]`` or ``x[OPTIMIZER_KEY]`` in a load (not as the target of an assignment: writers build
   these dicts), ``x.get("key")``, or ``"key" in x``.

What may do either anyway is listed in ALLOWED, per module and function, each with the reason. The list
names no reader of tensors: the in-process resumes, reshard, consolidate, convert and export all read
partitions through the readers' byte ranges (``read_slice``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "shardkit"
READERS = "checkpoint/readers/"

LOADERS = {"torch.load", "safe_torch_load", "read_structure", "pickle.load", "pickle.loads", "open",
           "open_regular", "regular_fd", "open_checked", "load"}
SHARDKIT_LOADERS = {"safe_torch_load", "read_structure", "open_regular", "regular_fd", "open_checked"}
RANK_FILE_TEXT = re.compile(r"_model_states\.pt|_optim_states\.pt|zero_pp_rank_")
RANK_FILE_NAMES = {"MODEL_FILE", "OPTIM_FILE", "OPTIM_FILE_NAME", "RANK_FILE"}
RANK_FILE_ATTRS = {"model_files", "optim_files"}
RANK_KEYS = {"fp32_flat_groups", "single_partition_of_fp32_groups", "param_shapes", "frozen_param_fragments",
             "optimizer_state_dict", "base_optimizer_state"}
RANK_KEY_NAMES = {"OPTIMIZER_KEY"}

#: (module under shardkit/, enclosing function): why it may parse a rank file, and which. None reads a
#: partition's tensors: what they read is structure (counts, names, run state) or a dict they write.
ALLOWED: dict[tuple[str, str], str] = {
    # inspect and verify describe any DeepSpeed folder, readable or not, from the pickled structure alone
    ("checkpoint/layout/deepspeed_files.py", "describe_deepspeed"):
        "`shardkit inspect`: stage, world size and counts from rank 0's pickled structure, no tensor read",
    ("checkpoint/layout/deepspeed_files.py", "_refusals"):
        "`shardkit inspect`: names a layout no reader takes (no fp32 flats) from the pickled structure",
    ("checkpoint/ops/verify_files.py", "deepspeed_facts"):
        "`shardkit verify`: the run-wide values every rank file must agree on (world size, stage, partition count)",
    # run state handed to DeepSpeed's own loaders (LR scheduler, loss scaler, param groups), not partitions
    ("checkpoint/ops/resume_state.py", "fit_to_current_optimizer"):
        "the rank dict a resume built, in DeepSpeed's shape, fitted to the live optimizer: no file",
    ("checkpoint/ops/resume_zero3.py", "load_checkpoint_resharded"):
        "the rank dict resume_zero3_state built, handed to DeepSpeed's load_state_dict: no file",
    # writers write rank files: a same-run writer writes the source's own dicts back around new partitions
    ("checkpoint/writers/zero12.py", "_same_run_optim_states"): "rank 0's parsed optim dict, written back",
    ("checkpoint/writers/zero12.py", "optim_states"): "the optim dict it is building, read back: no file",
    ("checkpoint/writers/zero3_same_run.py", "_build_optim"): "rank 0's parsed optim dict, written back",
    ("checkpoint/writers/zero3_same_run.py", "_model"):
        "each rank's own model-states dict (its client state) parsed to be written back at the same world size",
    ("checkpoint/zero3/repartition.py", "optim_dict"):
        "a new rank's optim-states dict built around rank 0's (the ZeRO-3 same-run writer and the resume)",
}


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _name(node.value)
        return f"{base}.{node.attr}" if base else node.attr
    return ""


def _names_rank_file(node: ast.AST, bound: set[str]) -> bool:
    """Whether the expression ``node`` names a ZeRO rank file (rule 1)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and RANK_FILE_TEXT.search(sub.value):
            return True
        if isinstance(sub, ast.Name) and (sub.id in RANK_FILE_NAMES or sub.id in bound):
            return True
        if isinstance(sub, ast.Attribute) and sub.attr in RANK_FILE_ATTRS | RANK_FILE_NAMES:
            return True
    return False


def _bound_to_rank_files(fn: ast.AST) -> set[str]:
    """Names ``fn`` binds to a rank file's path: assigned from one, or looped over a list of them."""
    bound: set[str] = set()
    for _ in range(2):  # a second pass follows one name bound from another (f = path; path = ckpt.optim_files[0])
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and _names_rank_file(node.value, bound):
                bound.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, (ast.For, ast.comprehension)) and _names_rank_file(node.iter, bound):
                bound.update(t.id for t in ast.walk(node.target) if isinstance(t, ast.Name))
    return bound


def _key_read(node: ast.AST) -> str | None:
    """The rank-file key ``node`` reads (rule 2), or None."""
    def key(k: ast.AST | None) -> str | None:
        if isinstance(k, ast.Constant) and k.value in RANK_KEYS:
            return str(k.value)
        if isinstance(k, ast.Name) and k.id in RANK_KEY_NAMES:
            return k.id
        return None

    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        return key(node.slice)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        return key(node.args[0])
    if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
        return key(node.left)
    return None


def rank_file_parses(tree: ast.Module) -> list[tuple[str, int, str]]:
    """(enclosing function, line, what) of every rank-file load and rank-file key read in ``tree``."""
    found: list[tuple[str, int, str]] = []

    def visit(node: ast.AST, fn: str, bound: set[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            fn, bound = node.name, bound | _bound_to_rank_files(node)
        called = _name(node.func) if isinstance(node, ast.Call) else ""
        if called in LOADERS or called.split(".")[-1] in SHARDKIT_LOADERS:  # also module.safe_torch_load(...)
            if any(_names_rank_file(arg, bound) for arg in node.args[:1]):
                found.append((fn, node.lineno, f"loads a rank file with {called}"))
        read = _key_read(node)
        if read is not None:
            found.append((fn, node.lineno, f"key {read}"))
        for child in ast.iter_child_nodes(node):
            visit(child, fn, bound)

    visit(tree, "<module>", set())
    return found


def _violations(root: Path) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(READERS):
            continue
        for fn, line, what in rank_file_parses(ast.parse(path.read_text(encoding="utf-8"))):
            if (rel, fn) not in ALLOWED:
                out.append(f"{rel}:{line} in {fn}: {what}")
    return out


def test_only_the_readers_parse_zero_rank_files():
    found = _violations(PACKAGE)
    assert not found, ("a ZeRO rank file parsed outside shardkit/checkpoint/readers/ (read it through the format's "
                       "reader, or add an ALLOWED entry saying why it may):\n" + "\n".join(found))


def test_every_allowed_entry_is_still_needed():
    seen = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        seen.update((rel, fn) for fn, _, _ in rank_file_parses(ast.parse(path.read_text(encoding="utf-8"))))
    stale = sorted(set(ALLOWED) - seen)
    assert not stale, f"ALLOWED entries that match nothing any more (remove them): {stale}"


def test_the_rule_finds_a_second_reader(tmp_path):
    """What the rule is for: a module beside the readers that loads rank files and reads their partitions."""
    (tmp_path / "checkpoint" / "readers").mkdir(parents=True)
    (tmp_path / "checkpoint" / "readers" / "zero3.py").write_text(
        "def read(ckpt):\n    return safe_torch_load(ckpt.optim_files[0])['optimizer_state_dict']\n")
    (tmp_path / "checkpoint" / "zero3").mkdir()
    (tmp_path / "checkpoint" / "zero3" / "reader.py").write_text(
        "def describe(tag_dir):\n"
        "    model0 = tag_dir / MODEL_FILE.format(rank=0)\n"
        "    state = load(model0)\n"
        "    sd = safe_torch_load(model0, mmap=True)\n"
        "    return sd['param_shapes'], state.get('fp32_flat_groups')\n"
        "def write(sd):\n"
        "    sd['param_shapes'] = []\n"  # building a dict to write is no read
        "    for f in ckpt.optim_files:\n"
        "        torch.load(f)\n"
        "    return {'fp32_flat_groups': []}\n")
    assert _violations(tmp_path) == [
        "checkpoint/zero3/reader.py:3 in describe: loads a rank file with load",  # a loader under a local name
        "checkpoint/zero3/reader.py:4 in describe: loads a rank file with safe_torch_load",
        "checkpoint/zero3/reader.py:5 in describe: key param_shapes",
        "checkpoint/zero3/reader.py:5 in describe: key fp32_flat_groups",
        "checkpoint/zero3/reader.py:9 in write: loads a rank file with torch.load",
    ]
