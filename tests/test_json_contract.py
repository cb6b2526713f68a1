"""Under --json every ending of every command prints exactly one JSON object on stdout, at least
{"command", "ok": false, "exit_code", "error"} for a failure, and the process exits with its
``exit_code``: argparse's usage errors (raised through shardkit.commands._parser.CommandParser),
a bad SHARDKIT_* variable, an input that does not exist, and a SIGTERM before, during or after the
command body. Before, stdout was empty for all of these but the missing inputs, and a SIGTERM after
export had written its result ended in "Exception ignored in atexit callback" with exit 0.

The SIGTERMs are raised by stand-ins at fixed points of the run (signal.raise_signal in the main
thread, as a scheduler's cancel arrives), so each case is deterministic."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shardkit.cli import main

ROOT = Path(__file__).resolve().parents[1]
MISSING = "/nonexistent/shardkit-json-contract"

# each command with an input that does not exist (argparse accepts the line; the command refuses it)
MISSING_INPUT = {
    "check": ["check", f"{MISSING}.json"],
    "config": ["config", "zero3", "--fit", "80GiB,512GiB", "--model", MISSING, "--world-size", "8"],
    "consolidate": ["consolidate", MISSING, "-o", "OUT/model.safetensors"],
    "convert": ["convert", MISSING, "--to", "fsdp2", "-o", "OUT/dcp"],
    "estimate": ["estimate", "--model", MISSING, "--world-size", "8"],
    "export": ["export", MISSING, "-o", "OUT/hf"],
    "inspect": ["inspect", MISSING],
    "launch": ["launch", "--dry-run", "--json", f"{MISSING}.py"],
    "preflight": ["preflight", f"{MISSING}.json", "--static"],
    "reshard": ["reshard", MISSING, "--world-size", "2", "-o", "OUT/ws2"],
    "smoke": ["smoke", "--config", f"{MISSING}.json"],
    "verify": ["verify", MISSING],
    "versions": ["versions", "--config", f"{MISSING}.json"],
}

# what a stand-in does at each point: "during" raises SIGTERM as the command body starts, "after" once it
# has returned (its result in hand, not yet written), "shutdown" in an atexit callback after main returned
DRIVER = r"""
import atexit, signal, sys
import shardkit.cli as cli

point, argv = sys.argv[1], sys.argv[2:]

def term(*_):
    signal.raise_signal(signal.SIGTERM)

if point in ("during", "after"):
    real_results = cli.json_results

    def json_results(args):
        body = args.func
        if point == "during":
            args.func = lambda a: (term(), body(a))[1]
        else:
            args.func = lambda a: (lambda code: (term(), code)[1])(body(a))
        return real_results(args)

    cli.json_results = json_results
elif point == "shutdown":
    atexit.register(term)
sys.exit(cli.main(argv))
"""


def _shardkit(argv: list[str], tmp_path: Path, *, point: str = "none", env: dict[str, str] | None = None,
              timeout: float = 120) -> subprocess.CompletedProcess[str]:
    words = [w.replace("OUT", str(tmp_path)) for w in argv]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SHARDKIT_")}
    environ.update(env or {})
    return subprocess.run([sys.executable, "-c", DRIVER, point, *words], cwd=tmp_path, env=environ, text=True,
                          capture_output=True, timeout=timeout)


def _one_object(stdout: str) -> dict:
    """stdout is one JSON object and nothing else (json.loads refuses a second one after it)."""
    data = json.loads(stdout)
    assert isinstance(data, dict)
    return data


def _with_json(argv: list[str]) -> list[str]:
    return argv if "--json" in argv else [*argv, "--json"]


KINDS = ("usage error", "env error", "missing input", "SIGTERM")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", sorted(MISSING_INPUT))
@pytest.mark.slow
def test_every_command_ends_in_one_json_object(command, kind, tmp_path):
    argv = _with_json(MISSING_INPUT[command])
    env, point, expected = None, "none", {"usage error": 2, "env error": 2, "SIGTERM": 143}.get(kind, 1)
    if kind == "usage error":
        argv = [*argv[:1], "--no-such-flag", *argv[1:]] if command != "launch" else ["launch", "--launcher", "mpirun",
                                                                                     "--json", "train.py"]
    elif kind == "env error":  # judged before the command body, for every command
        env = {"SHARDKIT_HASH": "md5"} if len(command) % 2 else {"SHARDKIT_SILENCE_S": "abc"}
    elif kind == "SIGTERM":
        point = "during"
    r = _shardkit(argv, tmp_path, point=point, env=env)
    assert r.returncode == expected, (r.returncode, r.stdout, r.stderr)
    data = _one_object(r.stdout)
    assert data["command"] == command and data["ok"] is False and data["exit_code"] == expected, data
    assert data["error"] and "Traceback" not in r.stderr, (data, r.stderr)
    if kind == "env error":
        assert next(iter(env)) in data["error"]
    if kind == "SIGTERM":
        assert data["error"].startswith("terminated (SIGTERM)") and f"shardkit {command}: terminated (SIGTERM)" in r.stderr


@pytest.mark.parametrize("argv, says", [
    (["reshard", "CKPT", "--world-size", "3", "--json"], "the following arguments are required: -o/--output"),
    (["reshard", "CKPT", "--world-size", "abc", "-o", "OUT", "--json"], "invalid int value: 'abc'"),
    (["smoke", "--engine", "zero2", "--json"], "argument --engine: invalid choice: 'zero2'"),
    (["config", "--json"], "the following arguments are required: KIND"),
    (["no-such-command", "--json"], "invalid choice: 'no-such-command'"),
])
def test_argparse_errors_in_process_are_one_json_object_and_exit_2(capsys, tmp_path, argv, says):
    before = signal.getsignal(signal.SIGTERM)
    code = main([a.replace("OUT", str(tmp_path / "out")) for a in argv])  # returned: argparse no longer exits
    out, err = capsys.readouterr()
    data = _one_object(out)
    assert code == 2 and data["ok"] is False and data["exit_code"] == 2 and says in data["error"], data
    assert data["command"] == argv[0] and data["usage"].startswith("usage: shardkit")
    assert "usage: shardkit" in err and f"error: {data['error'].split(': ', 1)[1]}" in err  # argparse's own lines
    assert signal.getsignal(signal.SIGTERM) is before  # the run's SIGTERM handler is not left behind


def test_an_argparse_error_goes_to_the_json_file_too(capsys, tmp_path):
    target = tmp_path / "result.json"
    code = main(["verify", "CKPT", "--world-size", "two", "--json-file", str(target)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "invalid int value: 'two'" in err
    data = json.loads(target.read_text())
    assert data["command"] == "verify" and data["exit_code"] == 2 and "invalid int value: 'two'" in data["error"]


def test_sigterm_during_the_parse_of_a_json_run_is_one_object(tmp_path):
    # the handler is set before argparse runs when the words ask for JSON: a SIGTERM there is 143 too
    driver = ("import signal, sys, shardkit.cli as cli\n"
              "real = cli.build_parser\n"
              "def build():\n    signal.raise_signal(signal.SIGTERM)\n    return real()\n"
              "cli.build_parser = build\nsys.exit(cli.main(sys.argv[1:]))\n")
    r = subprocess.run([sys.executable, "-c", driver, "inspect", MISSING, "--json"], text=True, capture_output=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 143, r.stderr
    data = _one_object(r.stdout)
    assert data["command"] == "inspect" and data["exit_code"] == 143 and data["error"].startswith("terminated")


@pytest.fixture(scope="module")
def config_json(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "ds_config.json"
    r = subprocess.run([sys.executable, "-m", "shardkit", "config", "zero3", "-o", str(path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return path


@pytest.mark.slow
def test_sigterm_after_the_command_returned_says_terminated_in_its_one_object(tmp_path, config_json):
    r = _shardkit(["check", str(config_json), "--json"], tmp_path, point="after")
    assert r.returncode == 143, r.stderr
    data = _one_object(r.stdout)
    # the command's own result, with the signal folded in: one object, its exit_code the process's
    assert data["ok"] is False and data["exit_code"] == 143 and data["error"].startswith("terminated (SIGTERM)")
    assert "findings" in data and data["command"] == "check"


@pytest.mark.slow
def test_sigterm_in_the_interpreter_s_shutdown_is_no_exception_in_atexit(tmp_path, config_json):
    r = _shardkit(["check", str(config_json), "--json"], tmp_path, point="shutdown")
    # main put SIGTERM's handler back: the signal ends the process as it ends any program
    assert r.returncode == -signal.SIGTERM, (r.returncode, r.stderr)
    assert "Exception ignored" not in r.stderr and "Terminated" not in r.stderr, r.stderr
    data = _one_object(r.stdout)
    assert data["ok"] is True and data["exit_code"] == 0


@pytest.mark.slow
def test_sigterm_just_after_export_wrote_its_result(tmp_path, tmp_path_factory):
    from shardkit.engines.model_factory import tiny_llama
    from tests import _ranks_zero3 as R

    source = R.build_sources(tmp_path_factory.getbasetemp() / "zero3")["fp32"]
    config = tmp_path / "config"
    tiny_llama("tiny", seed=0).config.save_pretrained(config)
    out = tmp_path / "hf"
    r = _shardkit(["export", str(source), "-o", str(out), "--model-config", str(config), "--json"], tmp_path,
                  point="after", timeout=300)
    assert r.returncode == 143 and "Exception ignored" not in r.stderr, r.stderr
    data = _one_object(r.stdout)
    assert data["exit_code"] == 143 and data["wrote"]["path"] == str(out)
    # the signal came after the folder was put in place: the object says the output is complete
    assert f"it came after {out} was put in place: that output is complete" in data["error"]
    assert (out / "config.json").is_file()
    r = _shardkit(["export", str(source), "-o", str(tmp_path / "hf2"), "--model-config", str(config), "--json"],
                  tmp_path, point="shutdown", timeout=300)
    assert r.returncode == -signal.SIGTERM and "Exception ignored" not in r.stderr, r.stderr
    assert _one_object(r.stdout)["ok"] is True


def test_launch_addr_with_a_port_out_of_range_is_refused_naming_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    r = _shardkit(["launch", "--dry-run", "--json", "--launcher", "torchrun", "--nproc_per_node", "1", str(script)],
                  tmp_path, env={"SHARDKIT_LAUNCH_ADDR": "127.0.0.1:99999"})
    assert r.returncode == 2 and "Traceback" not in r.stderr and "OverflowError" not in r.stderr, r.stderr
    data = _one_object(r.stdout)
    assert "SHARDKIT_LAUNCH_ADDR='127.0.0.1:99999' has the port '99999', not a number in 0-65535" in data["error"]


@pytest.mark.parametrize("value, why", [
    ("127.0.0.1:99999", "has the port '99999', not a number in 0-65535"),
    ("node0:http", "has the port 'http', not a number in 0-65535"),
    (":29600", "names no host"),
    ("node 0:29600", "has a host 'node 0' with characters no host name or IP address holds"),
    ("[::1:29600", "has an unclosed or misplaced ']'"),
])
def test_launch_addr_values_refused(value, why):
    from shardkit.core.env_settings import check_all
    from shardkit.core.errors import UsageError

    with pytest.raises(UsageError, match=f"SHARDKIT_LAUNCH_ADDR={value!r} {why}".replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")):
        check_all({"SHARDKIT_LAUNCH_ADDR": value})


@pytest.mark.parametrize("value, address", [
    ("10.1.2.3:29600", ("10.1.2.3", 29600)), ("node0", ("node0", 0)), ("[::1]:29600", ("::1", 29600)),
    ("fe80::1", ("fe80::1", 0)), ("node0:0", ("node0", 0)), ("node0:65535", ("node0", 65535)),
])
def test_launch_addr_values_accepted(value, address):
    from shardkit.core.env_settings import read_address

    assert read_address("SHARDKIT_LAUNCH_ADDR", {"SHARDKIT_LAUNCH_ADDR": value}) == address


@pytest.mark.slow
def test_launch_dry_run_refused_by_config_errors_is_one_object_with_the_findings(tmp_path):
    (tmp_path / "bad.json").write_text('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 7}}')
    (tmp_path / "train.py").write_text("raise SystemExit('never run: --dry-run')\n")
    r = _shardkit(["launch", "--dry-run", "--json", "--launcher", "torchrun", "--nproc_per_node", "1", "train.py",
                   "--deepspeed_config", "bad.json"], tmp_path)
    assert r.returncode == 1 and "not started: 1 error(s) in bad.json" in r.stderr, r.stderr
    data = _one_object(r.stdout)
    assert data["ok"] is False and data["exit_code"] == 1 and data["error"] == "not started: 1 error(s) in bad.json"
    assert data["dry_run"] is True and data["check"]["errors"] == 1
    assert [f for f in data["check"]["findings"] if f["severity"] == "error" and "stage" in f["key"]]
