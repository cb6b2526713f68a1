"""The installed package behaves like the checkout: a wheel built from this tree, installed into a
fresh virtual environment (no downloads: --no-deps; torch, deepspeed and the other dependencies are
the running interpreter's, seen through a .pth file), runs `shardkit smoke` from another directory
on the presets it ships."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _running_site_dirs() -> list[str]:
    """The site-packages folders the running interpreter imports from, in its own order.

    Not ``system_site_packages``: that gives the new venv the *base* interpreter's site-packages,
    so under pytest run from a virtualenv (how most users install: `pip install -e .` into a venv)
    the dependencies installed into that venv (rich, pydantic, often torch) are missing and the
    installed wheel fails with `No module named 'rich'`. The running interpreter's folders are right
    in both cases: a venv (its own site-packages, plus the base's when it was made with
    --system-site-packages) and the system Python. The checkout itself is not among them (an editable
    install adds it through its own .pth, which a plain path line does not process), so the wheel's
    copy is the one imported."""
    candidates = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    on_path = [p for p in sys.path if p in candidates and Path(p).is_dir()]
    return list(dict.fromkeys(on_path))


def _make_venv(env_dir: Path) -> Path:
    """A venv whose own site-packages comes first, then the running interpreter's (a .pth file)."""
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                         capture_output=True, text=True).stdout.strip()
    Path(own, "_running_interpreter_site.pth").write_text("".join(f"{d}\n" for d in _running_site_dirs()))
    return python


_CAN_BUILD_WHEEL = (
    "import importlib.util, setuptools\n"
    "v = tuple(int(x) for x in setuptools.__version__.split('.')[:2])\n"
    # setuptools >= 70.1 has bdist_wheel itself; older ones need the wheel package (pyproject asks
    # only for setuptools>=64, and --no-build-isolation builds with what is installed)
    "raise SystemExit(0 if v >= (70, 1) or importlib.util.find_spec('wheel') else 1)\n"
)


def _wheel_builder() -> str | None:
    """An interpreter that can build the wheel offline (``pip wheel --no-build-isolation``).

    The running one first; a venv made by ``python -m venv`` carries its own setuptools (65.5 from
    ensurepip on Python 3.11), which without the ``wheel`` package cannot build one ("invalid
    command 'bdist_wheel'") even where the base interpreter's newer setuptools can. The wheel is pure
    Python, so the base interpreter of the same Python builds the same file."""
    for python in dict.fromkeys([sys.executable, getattr(sys, "_base_executable", sys.executable)]):
        if subprocess.run([python, "-c", _CAN_BUILD_WHEEL], capture_output=True).returncode == 0:
            return python
    return None


def _clean_env() -> dict[str, str]:
    """The environment without the checkout on PYTHONPATH (conftest puts it there for spawned ranks)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PIP_NO_INDEX"] = "1"  # never download: everything needed is on this machine
    return env


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_installed_wheel_ships_the_presets_and_smokes_from_another_directory(tmp_path):
    env = _clean_env()
    dist = tmp_path / "dist"
    builder = _wheel_builder()
    if builder is None:
        pytest.skip("no interpreter here builds a wheel offline: setuptools < 70.1 without the wheel package; "
                    "pip install -U 'setuptools>=70.1' (or pip install wheel)")
    subprocess.run(
        [builder, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(REPO)],
        check=True, env=env, cwd=tmp_path, timeout=300,
    )
    (wheel,) = dist.glob("shardkit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n.rsplit("/", 1)[-1] for n in names if n.startswith("shardkit/ds_configs/")}
    assert {"zero3.json", "fsdp2_full_shard.json"} <= shipped, sorted(names)

    env_dir = tmp_path / "venv"
    python = _make_venv(env_dir)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, env=env, cwd=tmp_path, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(python), "-c", "import shardkit; print(shardkit.__file__)"], check=True,
                           capture_output=True, text=True, env=env, cwd=elsewhere).stdout.strip()
    assert Path(where).is_relative_to(env_dir), f"imported {where}, not the installed wheel"
    # every dependency the running interpreter imports is there too (run from a venv, the base
    # interpreter's site-packages alone lacked rich and torch)
    deps = subprocess.run([str(python), "-c", "import rich, pydantic, torch, deepspeed; print(torch.__file__)"],
                          capture_output=True, text=True, env=env, cwd=elsewhere)
    assert deps.returncode == 0, deps.stderr[-2000:]

    r = subprocess.run([str(env_dir / "bin" / "shardkit"), "smoke", "--engine", "zero3", "--steps", "2", "--device", "cpu",
                        "--quiet", "--json", "report.json"],
                       capture_output=True, text=True, env=env, cwd=elsewhere, timeout=800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((elsewhere / "report.json").read_text())
    # the shipped preset, not a generated config: the installed package finds its own data
    assert [e["config_source"] for e in report["results"]] == ["preset zero3.json"], report


def test_the_test_venv_sees_what_the_running_interpreter_imports(tmp_path):
    """Fast half of the above: the venv built for the wheel imports the running interpreter's
    dependencies from the same folders it does (inside a virtualenv: that venv's, not the base's)."""
    python = _make_venv(tmp_path / "venv")
    code = "import json, rich, pydantic; print(json.dumps([rich.__file__, pydantic.__file__]))"
    r = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=_clean_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    import pydantic
    import rich

    assert json.loads(r.stdout) == [rich.__file__, pydantic.__file__]
    # the checkout (an editable install's .pth is not processed through a plain path line) stays out:
    # the slow test must import the wheel's copy
    where = subprocess.run([str(python), "-c", "import shardkit; print(shardkit.__file__)"], capture_output=True,
                           text=True, env=_clean_env(), cwd=tmp_path).stdout.strip()
    assert not where or not Path(where).is_relative_to(REPO), f"the checkout leaked into the test venv: {where}"
