"""Which heavy packages (torch, deepspeed, transformers, accelerate) each CLI command imports, and
the public API of ``import shardkit``.

Each case runs ``shardkit.cli.main(argv)`` in a fresh interpreter and reads ``sys.modules`` after
it: a command's import set is part of its behaviour (``shardkit --help`` must stay instant on a
login node), so a change to it must show up here as a changed row, with its reason. The lazy
boundaries that keep those sets small are listed in scripts/import_graph.py (LAZY_BOUNDARIES).
"""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import shardkit
import shardkit.commands

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "deepspeed", "transformers", "accelerate")
NONE: frozenset[str] = frozenset()
TORCH_DS = frozenset({"torch", "deepspeed"})

# case -> (argv, heavy packages imported, exit code (None: any; `versions` exits 1 when a known-bad
# row applies to the installed release), why). "{tmp}" is a path in a fresh empty folder and
# "{script}" an existing training script there (never run); paths are relative to the repo root.
# Every command in shardkit/commands/ needs its "<cmd> --help" row and at least one other row.
CASES: dict[str, tuple[list[str], frozenset[str], int | None, str]] = {
    "--help": (["--help"], NONE, 0, "the parser lists the commands without importing what they run"),
    "(no command)": ([], NONE, 2, "prints the help, like --help"),
    "check --help": (["check", "--help"], NONE, 0, "help never runs the command"),
    "check zero3.json": (["check", "ds_configs/zero3.json"], TORCH_DS, 0,
                         "a DeepSpeed config is validated against DeepSpeed's own config schema (pydantic models)"),
    "check fsdp2.json": (["check", "ds_configs/fsdp2_full_shard.json"], NONE, 0,
                         "the FSDP2 rules are shardkit's own; no DeepSpeed schema to load"),
    "check (missing)": (["check", "/nonexistent/ds_config.json"], NONE, 1, "the path is refused before any rule runs"),
    "config --help": (["config", "--help"], NONE, 0, "help never runs the command"),
    "config zero3": (["config", "zero3"], TORCH_DS, 0,
                     "the generated DeepSpeed config is checked (DeepSpeed's schema) before it is printed"),
    "config fsdp": (["config", "fsdp"], NONE, 0, "an FSDP2 config is checked by shardkit's own rules"),
    "consolidate --help": (["consolidate", "--help"], NONE, 0, "help never runs the command"),
    "consolidate (missing)": (["consolidate", "/nonexistent/ckpt", "-o", "{tmp}/model.safetensors"], NONE, 1,
                              "the source path is refused before the ZeRO-3 reader (torch) is imported"),
    "convert --help": (["convert", "--help"], NONE, 0, "help never runs the command"),
    "export --help": (["export", "--help"], NONE, 0, "help never runs the command"),
    "export (missing)": (["export", "/nonexistent/ckpt", "-o", "{tmp}/out"], NONE, 1,
                         "the source path is refused before the meta model (torch, transformers) is imported"),
    "convert (missing)": (["convert", "/nonexistent/ckpt", "--to", "fsdp2", "-o", "{tmp}/out"], NONE, 1,
                          "the source path is refused before the converter (torch) is imported"),
    "config zero3 --fit": (["config", "zero3", "--fit", "80GiB", "--params", "7B", "--world-size", "8"], TORCH_DS, 0,
                           "the memory estimate is pure arithmetic; the written config is checked as always"),
    "estimate --help": (["estimate", "--help"], NONE, 0, "help never runs the command"),
    "estimate --params": (["estimate", "ds_configs/zero3_offload_cpu.json", "--params", "6.8e9", "--world-size", "4"],
                          NONE, 0, "the estimate is arithmetic over the config's typed view: no torch, no DeepSpeed"),
    "estimate --model (missing)": (["estimate", "--engine", "fsdp", "--model", "/nonexistent/config.json"], NONE, 1,
                                   "a missing config.json is refused before transformers builds the meta model"),
    "inspect --help": (["inspect", "--help"], NONE, 0, "help never runs the command"),
    "inspect (missing)": (["inspect", "/nonexistent/ckpt"], NONE, 1,
                          "a checkpoint is described from its pickled structures and metadata, read without torch"),
    "launch --help": (["launch", "--help"], NONE, 0, "help never runs the command"),
    "launch --dry-run zero3": (["launch", "--dry-run", "{script}", "--deepspeed_config", "ds_configs/zero3.json"],
                               TORCH_DS, 0, "the launch checks the DeepSpeed config (DeepSpeed's schema) first"),
    "launch (missing script)": (["launch", "--dry-run", "/nonexistent/train.py", "--deepspeed_config",
                                 "ds_configs/zero3.json"], NONE, 1,
                                "a missing script stops the launch before any check"),
    "launch accelerate": (["launch", "--launcher", "accelerate", "--dry-run", "--config_file",
                           "/nonexistent/accelerate.yaml", "{script}"], frozenset({"torch", "accelerate"}), 1,
                          "accelerate's own `accelerate launch` parser reads the command line (it imports torch)"),
    "preflight --help": (["preflight", "--help"], NONE, 0, "help never runs the command"),
    "preflight --static zero3": (["preflight", "ds_configs/zero3.json", "--static"], TORCH_DS, 0,
                                 "the static checks use DeepSpeed's schema; the rank side imports torch"),
    "preflight (missing)": (["preflight", "/nonexistent/ds_config.json"], frozenset({"torch"}), 1,
                            "the host side imports the rank code (torch) before it reads the config"),
    "preflight --observed (missing)": (["preflight", "--observed", "/nonexistent/snapshot.json"], NONE, 2,
                                       "judging a recorded snapshot offline needs no torch"),
    "reshard --help": (["reshard", "--help"], NONE, 0, "help never runs the command"),
    "reshard (missing)": (["reshard", "/nonexistent/ckpt", "--world-size", "2", "-o", "{tmp}/out"], NONE, 1,
                          "reshard never imports torch (torch-free reader and writer; a real reshard: test_reshard.py)"),
    "smoke --help": (["smoke", "--help"], NONE, 0, "help never runs the command"),
    "smoke (missing config)": (["smoke", "--engine", "zero3", "--config", "/nonexistent/ds_config.json"],
                               frozenset({"torch"}), 1,
                               "the host side imports the rank code (torch) before it reads the config"),
    "verify --help": (["verify", "--help"], NONE, 0, "help never runs the command"),
    "verify (missing)": (["verify", "/nonexistent/ckpt"], NONE, 1,
                         "reading a manifest and hashing files needs no torch"),
    "versions --help": (["versions", "--help"], NONE, 0, "help never runs the command"),
    "versions": (["versions"], NONE, None, "versions come from package metadata, never from importing the packages"),
    "versions --json": (["versions", "--json"], NONE, None, "the same report as JSON"),
}

PROBE = (
    "import json, sys\n"
    "from shardkit.cli import main\n"
    "try:\n"
    "    rc = main(json.loads(sys.argv[1]))\n"
    "except SystemExit as exc:\n"
    "    rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)\n"
    "sys.stdout.flush()\n"
    f"print('\\nHEAVY=' + json.dumps({{'rc': rc, 'heavy': [m for m in {HEAVY!r} if m in sys.modules]}}))\n"
)


def _commands() -> list[str]:
    """Every CLI command: one module per command in shardkit/commands/ (cli.py discovers them)."""
    return sorted(m.name for m in pkgutil.iter_modules(shardkit.commands.__path__) if not m.name.startswith("_"))


def _python(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _last_json(out: str, prefix: str) -> dict | None:
    lines = [line for line in out.splitlines() if line.startswith(prefix)]
    return json.loads(lines[-1][len(prefix):]) if lines else None


def test_every_command_has_its_rows():
    commands = _commands()
    assert "check" in commands and "versions" in commands, commands
    missing = []
    for cmd in commands:
        if f"{cmd} --help" not in CASES:
            missing.append(f"{cmd} --help")
        if not any(argv[:1] == [cmd] and "--help" not in argv for argv, *_ in CASES.values()):
            missing.append(f"a representative `{cmd} ...` invocation")
    assert not missing, f"tests/test_imports.py CASES lacks rows for: {', '.join(missing)}"
    stale = {argv[0] for argv, *_ in CASES.values() if argv and not argv[0].startswith("-")} - set(commands)
    assert not stale, f"CASES has rows for commands that no longer exist: {sorted(stale)}"


@pytest.mark.slow
def test_heavy_imports_per_command(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never run: --dry-run')\n")

    def run(name: str) -> tuple[str, dict | None, str]:
        out = tmp_path / "".join(c if c.isalnum() else "_" for c in name)
        argv = [a.format(tmp=out, script=script) for a in CASES[name][0]]
        r = _python(["-c", PROBE, json.dumps(argv)], cwd=REPO)
        return name, _last_json(r.stdout, "HEAVY="), (r.stdout + r.stderr)[-1500:]

    with ThreadPoolExecutor(max_workers=max(2, 2 * (os.cpu_count() or 1))) as pool:
        results = list(pool.map(run, CASES))

    wrong = []
    for name, got, output in results:
        argv, heavy, rc, why = CASES[name]
        if got is None:
            wrong.append(f"{name}: no result\n{output}")
        elif set(got["heavy"]) != heavy or (rc is not None and got["rc"] != rc):
            wrong.append(
                f"{name} ({why}): expected heavy {sorted(heavy)} exit {rc}, got heavy {got['heavy']} exit {got['rc']}\n"
                f"{output}"
            )
    if wrong:
        pytest.fail("\n\n".join(wrong), pytrace=False)


# The public API of `import shardkit`: every name a user may import from the package. Frozen here
# so that adding, removing or renaming one is a deliberate change to this list too.
PUBLIC_API = [
    "CheckpointError", "ConfigError", "DistributedError", "FSDPConfig", "Move", "PlacementReport",
    "PreflightError", "RunShape", "ShardkitError", "SmokeOptions", "StateSlot", "UsageError", "__version__",
    "apply_fsdp", "build_launch", "check_config", "check_file", "check_resumable",
    "check_resumable_distributed", "collect_records", "config_digest", "consolidate_checkpoint",
    "estimate_memory", "export_safetensors", "fsdp_config_from_dict", "guard_plain_loads",
    "installed_versions", "judge_snapshot", "known_bad_findings", "load_checkpoint_resharded",
    "load_config", "load_dcp_state", "load_fsdp_checkpoint", "model_shape", "open_zero3_layout",
    "plan_optimizer_moves", "preflight", "record_snapshot", "register_extra_state",
    "replace_optimizer_state", "reshard_checkpoint", "restore_cpu_adam_kernel_state", "resume_training",
    "run_smoke", "safe_torch_load", "save_deepspeed_checkpoint", "save_fsdp_checkpoint", "save_training",
    "settings_from_config", "verify_checkpoint",
]


def test_public_api_is_explicit_and_unchanged():
    assert len(shardkit.__all__) == len(set(shardkit.__all__)), "a name is listed twice in shardkit.__all__"
    assert sorted(shardkit.__all__) == PUBLIC_API


def test_import_shardkit_is_light_and_every_public_name_imports():
    code = (
        "import json, sys\n"
        "import shardkit\n"
        f"light = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "broken = {}\n"
        "for name in shardkit.__all__:\n"
        "    try:\n"
        "        if getattr(shardkit, name) is None:\n"
        "            broken[name] = 'is None'\n"
        "    except Exception as exc:\n"
        "        broken[name] = f'{type(exc).__name__}: {exc}'\n"
        "print('API=' + json.dumps({'heavy_after_import': light, 'broken': broken, 'n': len(shardkit.__all__)}))\n"
    )
    r = _python(["-c", code], cwd=REPO)
    got = _last_json(r.stdout, "API=")
    assert got is not None, r.stdout + r.stderr
    assert got["heavy_after_import"] == [], f"`import shardkit` imported {got['heavy_after_import']}"
    assert got["broken"] == {}, f"public names that do not import: {got['broken']}"
    assert got["n"] == len(PUBLIC_API)
