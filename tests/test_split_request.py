"""A split run's processes agree on what they were asked to do before anything is written
(shardkit/storage/request.py, shared_meet.py): the request's comparison in one process (the
digest, the fields named only on a mismatch), two processes meeting on threads, and the CLI under
torchrun and its stand-in (RANK/WORLD_SIZE set per process) with another --world-size, -o, --tag,
--dtype or --no-verify on one process: every process fails naming the field and both values, and
nothing is published."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from shardkit.core.errors import CheckpointError, UsageError
from shardkit.storage.atomic import staging_dir
from shardkit.storage.request import RELEASE, RunRequest, differences, mismatch_message
from shardkit.storage.shared_meet import meet
from shardkit.storage.shared_save import Launch
from tests import test_reshard_parallel as reshard_tests
from tests._ports import free_port, job_port
from tests.test_reshard_parallel import TIMEOUT_S, _cli, _env, _nothing_published

sources = reshard_tests.sources


def _request(**change: object) -> RunRequest:
    fields: dict = {"command": "reshard", "source": "/ckpt/global_step2", "output": "/out", "tag": "global_step2",
                    "options": {"--world-size": 3, "--sub-group-size": None, "--no-verify": False}}
    options = {k: change.pop(k) for k in list(change) if k.startswith("--")}
    fields.update(change)
    fields["options"] = {**fields["options"], **options}
    return RunRequest(**fields)


# --- the request, in one process --------------------------------------------------------------------

def test_equal_requests_have_one_digest_and_no_difference():
    a, b = _request(), _request()
    assert a.digest() == b.digest() and differences(a, b) == []
    assert RunRequest.from_json(a.to_json()) == a


def test_the_output_path_is_not_in_the_digest_but_every_other_field_is():
    base = _request()
    # one folder mounted under two paths on two nodes: met in one staging folder, one output
    assert _request(output="/mnt/out").digest() == base.digest()
    for change in ({"tag": "other"}, {"source": "/ckpt/global_step3"}, {"--world-size": 2}, {"--no-verify": True},
                   {"command": "convert --to zero3"}, {"release": "0.0.1"}):
        assert _request(**change).digest() != base.digest(), change


def test_differences_name_each_field_with_both_values_release_first():
    mine, rank0 = _request(**{"--world-size": 3, "release": "9.9"}), _request(**{"--world-size": 2})
    diffs = differences(mine, rank0)
    assert [(d.field, d.mine, d.rank0) for d in diffs] == [(RELEASE, "9.9", rank0.release), ("--world-size", 3, 2)]
    assert differences(_request(output="/a"), _request(output="/b"), with_output=False) == []
    assert [d.field for d in differences(_request(output="/a"), _request(output="/b"))] == ["-o"]


def test_the_mismatch_message_names_field_values_and_fix():
    diffs = differences(_request(**{"--world-size": 3, "--no-verify": True}), _request(**{"--world-size": 2}))
    text = mismatch_message(1, 2, "node-b", "node-a", diffs)
    assert text.startswith("rank 1 of 2 (host node-b) was asked for another run than rank 0 (host 'node-a'): "
                           "--world-size: 3 on rank 1, 2 on rank 0; --no-verify: given on rank 1, not given on rank 0.")
    assert "Nothing was written. Fix: give every process the same arguments" in text
    tag = mismatch_message(1, 2, "b", "a", differences(_request(tag="x"), _request(tag="y")))
    assert "--tag: 'x' on rank 1, 'y' on rank 0" in tag and "the same --tag (or none)" in tag
    release = mismatch_message(1, 2, "b", "a", differences(_request(release="0.0.0+skew"), _request(release="1.0")))
    assert release.startswith("rank 1 of 2 (host b) runs shardkit 0.0.0+skew, rank 0 (host 'a') runs shardkit 1.0: "
                              "every process of one run must run the same release")


def test_the_launch_records_which_variables_made_it_rank_r_of_n():
    from shardkit.storage.shared_save import launch_from_env

    pod = launch_from_env({"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "23456",
                           "HOME": "/root"})
    assert pod.variables == (("RANK", "0"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "23456"))
    step = launch_from_env({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"})
    assert [k for k, _ in step.variables] == ["SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_JOB_ID", "SLURM_STEP_ID"]
    assert launch_from_env({}).variables == ()


# --- two processes meeting, on threads ---------------------------------------------------------------

def _meet_both(root: Path, requests: list[RunRequest], tags: list[str] | None = None) -> list[BaseException | None]:
    """Ranks 0 and 1 of one job meet (a thread each); each one's error, or None once it got the word."""
    out: list[BaseException | None] = [None, None]
    job = f"job-{uuid.uuid4().hex}"  # the pointer in the node's temporary folder is keyed by job

    def rank(r: int) -> None:
        try:
            with meet(root, (tags or ["step"] * 2)[r], Launch(r, 2, job, "torchrun", "host"), requests[r]):
                pass
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "meet hung"
    return out


def test_processes_that_agree_both_get_the_word(tmp_path):
    assert _meet_both(tmp_path / "out", [_request(), _request()]) == [None, None]


def test_one_difference_fails_both_processes_with_one_message(tmp_path):
    errors = _meet_both(tmp_path / "out", [_request(**{"--world-size": 2}), _request(**{"--world-size": 3})])
    assert all(isinstance(e, UsageError) for e in errors), errors
    assert str(errors[0]) == str(errors[1])
    assert "--world-size: 3 on rank 1, 2 on rank 0" in str(errors[0])


def test_another_tag_is_found_and_named_instead_of_timing_out(tmp_path):
    errors = _meet_both(tmp_path / "out", [_request(tag="a"), _request(tag="b")], tags=["a", "b"])
    assert all(isinstance(e, UsageError) for e in errors), errors
    assert "--tag: 'b' on rank 1, 'a' on rank 0" in str(errors[0]) and str(errors[0]) == str(errors[1])


def test_another_release_is_named_as_a_release(tmp_path):
    errors = _meet_both(tmp_path / "out", [_request(), _request(release="0.0.0+skew")])
    assert all(isinstance(e, CheckpointError) and not isinstance(e, UsageError) for e in errors), errors
    assert "rank 1 of 2 (host host) runs shardkit 0.0.0+skew" in str(errors[0])
    assert staging_dir(tmp_path / "out", "step").exists()  # rank 0's caller removes its claim (write_tag_shared)


# --- the CLI: real processes ---------------------------------------------------------------------------

def _run_ranks(argvs: list[list[object]], port: str) -> list[tuple[int, str]]:
    """Ranks 0..N-1 as torchrun would start them (the srun stand-in), each with its own argv."""
    procs = [subprocess.Popen(_cli(*argv), env=_env(RANK=str(r), WORLD_SIZE=str(len(argvs)), MASTER_ADDR="127.0.0.1",
                                                     MASTER_PORT=port), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r, argv in enumerate(argvs)]
    try:
        return [(p.returncode, err) for p in procs for _, err in [p.communicate(timeout=TIMEOUT_S)]]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _all_fail_naming(results: list[tuple[int, str]], field: str, mine: str, rank0: str) -> None:
    want = f"{field}: {mine} on rank 1, {rank0} on rank 0"
    for rank, (code, err) in enumerate(results):
        assert code == 2, f"rank {rank}: {err}"
        assert want in err and "Nothing was written" in err and "Traceback" not in err, f"rank {rank}: {err}"


@pytest.mark.slow
def test_torchrun_processes_given_different_world_sizes_all_fail_and_publish_nothing(sources, tmp_path):
    """The corrupt publish: under torchrun, a wrapper gives rank 0 --world-size 2 and rank 1
    --world-size 3. Both used to exit 0 with a sealed checkpoint that fails verify."""
    out = tmp_path / "out"
    script = (f'exec "$0" -m shardkit reshard {sources["fp32"]} --world-size $((RANK + 2)) -o {out} --workers 1')
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
           "sh", "-c", script, sys.executable]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode != 0, done.stdout + done.stderr
    # the first rank to see the difference names it and exits 2; torchrun then stops the other with
    # SIGTERM, which may land before that one printed its own line (seen under a whole-suite run):
    # the named difference once, and every process gone without publishing, is what holds
    assert len(re.findall(r"--world-size: 3 on rank 1, 2 on rank 0", done.stderr)) >= 1, done.stderr
    assert "exitcode  : 0" not in done.stderr, done.stderr
    assert not out.exists(), list(out.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize(("flag", "values", "shown"), [
    ("-o", ("a", "b"), None),
    ("--tag", ("one", "two"), ("'two'", "'one'")),
    ("--no-verify", (None, "--no-verify"), ("given", "not given")),
])
def test_reshard_processes_given_another_output_tag_or_option_all_fail(sources, tmp_path, flag, values, shown):
    argvs: list[list[object]] = []
    for value in values:
        argv: list[object] = ["reshard", sources["fp32"], "--world-size", "3", "--workers", "1"]
        if flag == "-o":
            argv += ["-o", tmp_path / value]
        else:
            argv += ["-o", tmp_path / "out"] + ([flag, value] if flag == "--tag" else [value] if value else [])
        argvs.append(argv)
    results = _run_ranks(argvs, job_port())
    if shown is None:
        shown = (repr(str((tmp_path / "b").resolve())), repr(str((tmp_path / "a").resolve())))
    _all_fail_naming(results, flag, *shown)
    for name in ("a", "b", "out"):
        assert not (tmp_path / name).exists(), name


@pytest.mark.slow
def test_consolidate_processes_given_another_dtype_all_fail_then_a_matching_run_works(sources, tmp_path):
    out = tmp_path / "out" / "model.safetensors"
    base: list[object] = ["consolidate", sources["fp32"], "-o", out, "--workers", "1"]
    results = _run_ranks([[*base, "--dtype", "bf16"], [*base, "--dtype", "fp16"]], job_port())
    _all_fail_naming(results, "--dtype", "'fp16'", "'bf16'")
    _nothing_published(out.parent)
    results = _run_ranks([[*base, "--dtype", "bf16"], [*base, "--dtype", "bf16"]], job_port())
    assert [code for code, _ in results] == [0, 0], results
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.safetensors"]


@pytest.mark.slow
def test_convert_processes_given_another_option_all_fail(sources, tmp_path):
    out = tmp_path / "out"
    base: list[object] = ["convert", sources["fp32"], "--to", "fsdp2", "-o", out, "--workers", "1"]
    results = _run_ranks([[*base, "--adam-w-mode", "on"], [*base, "--adam-w-mode", "off"]], job_port())
    _all_fail_naming(results, "--adam-w-mode", "'off'", "'on'")
    assert not out.exists()


# --- launcher variables without a launcher: never a silent wait -------------------------------------------

_JOIN_S = 20


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_a_shell_holding_a_pods_variables_says_at_once_why_it_waits_and_stops_with_the_fix(sources, tmp_path, rank):
    """The silent wait: a pod (a Kubernetes PyTorchJob) exported RANK, WORLD_SIZE, MASTER_ADDR
    and MASTER_PORT; a one-off reshard in that shell becomes rank r of 4 and waits for processes that
    never come. Within seconds it names the variables and what it waits for, repeats while it waits,
    and stops with the fix once SHARDKIT_JOIN_TIMEOUT_S is over, having written nothing."""
    import time

    out = tmp_path / "out"
    # a port of its own: with one fixed port the two cases, run side by side by two test workers,
    # met (rank 1 reached rank 0's store: a machine may route any address to itself, as CI's does)
    port = free_port()
    env = _env(RANK=str(rank), WORLD_SIZE="4", MASTER_ADDR="10.9.8.7", MASTER_PORT=str(port),
               SHARDKIT_JOIN_TIMEOUT_S=str(_JOIN_S), SHARDKIT_SILENCE_S="2")
    src = sources["fp32"]  # built on first use: before the clock starts
    started = time.monotonic()
    proc = subprocess.Popen(_cli("reshard", src, "--world-size", "3", "-o", out), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append((time.monotonic() - started, line.rstrip("\n")))
        proc.wait(timeout=TIMEOUT_S)
    finally:
        proc.kill()
        proc.wait()
    ended = time.monotonic() - started
    waiting = [(t, text) for t, text in lines if "waiting for" in text]
    assert waiting, lines
    first_at, first = waiting[0]
    # said within seconds of starting to wait, long before the stop (a loaded machine may take its
    # time to start Python: the clock that counts is the wait's)
    # (20 s of join timeout: under a whole-suite run on 2 cores an 8 s one left too little to measure)
    left = re.search(r"giving up in (\d+) s", first)
    assert left and 5 <= int(left.group(1)) <= _JOIN_S and lines[-1][0] - first_at >= 4, lines
    assert f"rank {rank} of 4 (made so by RANK={rank} WORLD_SIZE=4 MASTER_ADDR=10.9.8.7 MASTER_PORT={port})" in first
    assert ("rank 0 of this run to claim the staging folder" if rank else "the other 3 process(es)") in first
    assert "`unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT` and run it again as one process" in first
    assert any("still waiting" in text for _, text in waiting[1:]), lines  # repeated while it waits
    assert proc.returncode == 1, lines
    error = lines[-1][1]
    assert error.startswith("shardkit reshard: error: ") and f"within {_JOIN_S} s" in error, lines
    assert "`unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT`" in error and "Nothing was written" in error, error
    assert ended < _JOIN_S + 30, ended
    assert not out.exists()
