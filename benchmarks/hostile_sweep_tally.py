"""Run the hostile sweep (tests/test_hostile_sweep_*.py) and print its tally: cases tried per kind
of mutation and command, and what each got (exit code and the message shape a user sees), the
numbers docs/reliability.md quotes.

    python benchmarks/hostile_sweep_tally.py            # the suite's own cases (derandomized)
    python benchmarks/hostile_sweep_tally.py --examples 200 --json tally.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FILES = ["tests/test_hostile_sweep_bytes.py", "tests/test_hostile_sweep_fields.py", "tests/test_hostile_sweep_readers.py",
         "tests/test_hostile_sweep_round.py"]


def run(examples: int | None) -> list[dict[str, object]]:
    with tempfile.TemporaryDirectory() as tmp:
        tally = Path(tmp) / "tally.jsonl"
        env = {**os.environ, "HOSTILE_SWEEP_TALLY": str(tally), "PYTHONPATH": str(REPO)}
        if examples:
            env["HOSTILE_SWEEP_EXAMPLES"] = str(examples)
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", *FILES],
                              cwd=REPO, env=env, capture_output=True, text=True)
        summary = [ln for ln in done.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        print("\n".join([*summary, *done.stdout.strip().splitlines()[-1:]]) or done.stderr[-2000:], file=sys.stderr)
        if done.returncode not in (0, 5):
            print(done.stdout[-6000:], file=sys.stderr)
        return [json.loads(line) for line in tally.read_text().splitlines()] if tally.exists() else []


def summarize(rows: list[dict[str, object]]) -> str:
    by_key: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for r in rows:
        mutation = re.sub(r" \([a-z0-9_]+\)$", "", str(r["mutation"]))
        by_key[(mutation, str(r["command"]))][str(r["outcome"])] += int(r["cases"])  # type: ignore[call-overload]
    lines = ["| mutation | command | cases | exit 0 | exit 1 | exit 2 / error | most frequent outcome |", "|---|---|---|---|---|---|---|"]
    for (mutation, command), outcomes in sorted(by_key.items()):
        total = sum(outcomes.values())
        zero = sum(n for o, n in outcomes.items() if o.startswith("exit 0") or o == "returned")
        one = sum(n for o, n in outcomes.items() if o.startswith("exit 1"))
        top, _ = outcomes.most_common(1)[0]
        lines.append(f"| {mutation} | {command} | {total} | {zero} | {one} | {total - zero - one} | "
                     f"{top.replace('|', '/')[:140]} |")
    lines.append(f"\n{sum(int(r['cases']) for r in rows):,} cases in all")  # type: ignore[call-overload]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, help="hypothesis examples per sweep test (default: the suite's)")
    parser.add_argument("--json", type=Path, help="also write the raw tally rows here")
    args = parser.parse_args()
    rows = run(args.examples)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(summarize(rows))


if __name__ == "__main__":
    main()
