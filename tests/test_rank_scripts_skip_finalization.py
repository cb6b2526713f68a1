"""Every training script the suite and the examples run as ranks ends, once done and flushed, with
``os._exit(0)``: interpreter finalization is where finished torch 2.13 CPU ranks aborted.

The abort (exit -6, "terminate called without an active exception") failed the two-node launch tests
in 1 run of 3 under load, after training and the preflight had passed. Its backtrace: a gloo worker
thread (``ProcessGroupGloo::runLoop``) freeing the last collective's tensors
(``TensorImpl::decref_pyobject``) took the GIL after the main thread had begun finalization, so Python
ended the thread with ``pthread_exit`` through C++ frames that cannot unwind. ``destroy_process_group``
does not close that window: DeepSpeed keeps references to its groups, so their worker threads outlive
it. docs/slurm.md tells the story for users; this test keeps every rank script of the repository on the
ending that has no window, since a script that falls off its end flakes only under load.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: what makes a script a training rank's (it joins a process group through an engine)
RANK_MARKERS = ("deepspeed.initialize", "Accelerator(", "Trainer(", "init_process_group")

#: rank scripts that never reach their end by design, and why
NEVER_FINISH = {
    "tests/test_hostile_env.py:RANK_SCRIPT": "trains until the test kills it",
    "tests/test_hostile_models.py:FROZEN_SCRIPT": "deepspeed.initialize refuses the frozen model; the test expects the stop",
    "tests/_accelerate_state.py:_SAVE": "one process, Accelerator(cpu=True): no process group, no gloo thread",
    "tests/test_launch.py:GOOD_AND_BAD": "plain torch, nothing keeps the group: destroy_process_group joins gloo's threads",
}

#: scripts that are files of their own
SCRIPT_FILES = ("launch/train_tiny.py", "tests/_ranks_trainer.py")


def _script_constants() -> dict[str, str]:
    """Module-level string constants of tests/*.py that hold a rank script: 'path:NAME' -> its text."""
    found = {}
    for path in sorted((REPO / "tests").glob("*.py")):
        if path.resolve() == Path(__file__).resolve():
            continue  # this module's own marker strings
        for node in ast.parse(path.read_text()).body:
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
                continue
            texts = [c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
            script = next((t for t in texts if any(m in t for m in RANK_MARKERS)), None)
            if script is not None:
                found[f"{path.relative_to(REPO)}:{node.targets[0].id}"] = textwrap.dedent(script)
    return found


def _rank_scripts() -> dict[str, str]:
    scripts = {name: (REPO / name).read_text() for name in SCRIPT_FILES}
    scripts.update(_script_constants())
    return scripts


def _last_statement(tree: ast.Module) -> ast.stmt:
    """The script's last statement, inside a trailing ``if __name__ == "__main__":`` where it has one."""
    last = tree.body[-1]
    while isinstance(last, ast.If) and "__main__" in ast.unparse(last.test):
        last = last.body[-1]
    return last


def test_the_rank_scripts_are_found():
    # the scan is what keeps a new script on the rule: it must see the ones known today
    names = set(_rank_scripts())
    assert {"tests/_launch_jobs.py:DS_TRAIN", "tests/test_autopreflight_resume.py:SCRIPT",
            "tests/test_launch_accelerate.py:ACCELERATE_SCRIPT", *SCRIPT_FILES, *NEVER_FINISH} <= names


@pytest.mark.parametrize("name", sorted(set(_rank_scripts()) - set(NEVER_FINISH)))
def test_a_finished_rank_leaves_without_interpreter_finalization(name):
    text = _rank_scripts()[name]
    last = _last_statement(ast.parse(text))
    assert ast.unparse(last) == "os._exit(0)", (
        f"{name} ends with `{ast.unparse(last)}`: a finished rank must flush and end with os._exit(0), or gloo's "
        "worker threads can abort it in interpreter finalization (this module's docstring; docs/slurm.md)")
    before = text[: text.rindex("os._exit(0)")]
    assert "sys.stdout.flush()" in before, f"{name}: flush stdout before os._exit(0), which skips Python's own flush"
