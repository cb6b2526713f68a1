#!/usr/bin/env bash
# Run the test suite under load, to catch the races an idle machine hides.
#
#   scripts/loaded_suite.sh                  # the full suite (pytest -n 2), twice in a row
#   scripts/loaded_suite.sh tests/test_x.py  # extra arguments go to pytest: a subset, -k, -x, ...
#   LOADED_RUNS=3 scripts/loaded_suite.sh    # another number of runs
#
# Two busy processes keep two cores occupied for the whole time, as a shared CI runner does
# while the suite runs with CI's own command (`python -m pytest -n 2`). Each run prints its
# duration and result; the script stops at the first failing run and exits with its status
# (0 only when every run passed). A timing assumption in a test (a poll that expects a write to
# still be going, a port checked free and bound later) fails here where it passes on an idle
# machine. The full suite takes about 30 minutes per run on 2 cores, so the default is an hour
# or more: run it before a release, or after changing anything that spawns ranks or processes.
#
# The busy processes end with the script however it ends: a trap kills them on exit, Ctrl-C
# or SIGTERM, and each one also watches the script's process and stops when it is gone (a
# SIGKILL of the script, which no trap sees).
set -u

runs="${LOADED_RUNS:-2}"
cd "$(dirname "$0")/.." || exit 2

load_pids=()
test_pid=""
stop_all() {
    # pytest runs in the background (so a signal reaches this trap at once, not after the run):
    # it started with SIGINT ignored, as every background job of a script does, hence SIGTERM
    if [ -n "$test_pid" ]; then
        kill -TERM "$test_pid" 2>/dev/null
        wait "$test_pid" 2>/dev/null
    fi
    for pid in "${load_pids[@]}"; do
        kill "$pid" 2>/dev/null
    done
    for pid in "${load_pids[@]}"; do
        wait "$pid" 2>/dev/null
    done
    load_pids=()
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

script_pid=$$
for _ in 1 2; do
    # a busy loop of shell builtins (no fork per turn): one core's worth of load until this script is gone
    ( while kill -0 "$script_pid" 2>/dev/null; do :; done ) &
    load_pids+=("$!")
done
echo "loaded_suite: 2 busy processes (${load_pids[*]}) load the machine; $runs run(s) of: python -m pytest -n 2 $*"

for ((i = 1; i <= runs; i++)); do
    start=$(date +%s)
    # A background job of a script starts with SIGINT ignored, and Python keeps an ignored SIGINT
    # (no KeyboardInterrupt at all): the suite's Ctrl-C tests failed here and nowhere else. The shim
    # gives pytest, its xdist workers and the CLIs they start SIGINT's usual handling back.
    python -c 'import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); import pytest; sys.exit(pytest.main(sys.argv[1:]))' \
        -n 2 -p no:cacheprovider "$@" &
    test_pid=$!
    wait "$test_pid"
    status=$?
    test_pid=""
    took=$(( $(date +%s) - start ))
    if [ "$status" -eq 0 ]; then
        echo "loaded_suite: run $i/$runs passed in ${took} s"
    else
        echo "loaded_suite: run $i/$runs FAILED (pytest exit $status) after ${took} s; stopping here"
        exit "$status"
    fi
done
echo "loaded_suite: all $runs run(s) passed under load"
