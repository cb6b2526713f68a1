"""``shardkit inspect --json`` carries every field docs/inspect.md lists, with the meaning it gives: read the
docs' field table and compare it with the JSON of a real save (a ZeRO-2 save with ZeRO-3 files copied in, so
the refusal fields and a guarded refusal are there too)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests import _ranks_layouts as L

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DOCS = Path(__file__).resolve().parents[1] / "docs" / "inspect.md"


@pytest.fixture(scope="session")
def layouts(tmp_path_factory) -> dict[str, Path]:
    return L.build_layouts(tmp_path_factory.getbasetemp() / "layouts")


def _documented() -> tuple[set[str], dict[str, set[str]]]:
    """(top-level fields, field -> keys of its entries) of the '`--json` fields' table of docs/inspect.md."""
    text = DOCS.read_text()
    table = text.split("## `--json` fields", 1)[1].split("\n## ", 1)[0]
    fields: set[str] = set()
    entries: dict[str, set[str]] = {}
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        first, meaning = line.split("|")[1], line.split("|", 2)[2]
        names = re.findall(r"`(\w+)`", first)
        fields |= set(names)
        keys = re.match(r"\s*`\{([\w, ]+)\}`", meaning)
        if keys:
            entries[names[0]] = {k.strip() for k in keys.group(1).split(",")}
    return fields, entries


def test_every_documented_field_is_in_the_json(layouts, run_cli):
    fields, entries = _documented()
    assert {"guarded", "applies"} <= entries["commands"] and "marker" in entries["refusals"], entries
    code, stdout, err = run_cli("inspect", layouts["mixed_stages"], "--json")
    assert code == 0, err
    got = json.loads(stdout)
    assert sorted(fields - set(got)) == []
    for field, keys in entries.items():
        assert got[field], f"{field} is empty: no entry to check"
        for entry in got[field]:
            assert sorted(keys - set(entry)) == [], f"{field}: {entry}"


def test_guarded_is_true_for_the_refusals_the_layout_check_raises(layouts, run_cli):
    """docs/inspect.md: `guarded` is a refusal by the layout check every operation runs first. A marker's
    refusal is one (every command but verify); "already ZeRO-1/2" is convert's own check, and a command that
    applies is guarded by nothing."""
    cells = {}
    for label in ("mixed_stages", "zero2_bf16"):
        code, stdout, err = run_cli("inspect", layouts[label], "--json")
        assert code == 0, err
        cells[label] = {c["command"]: c for c in json.loads(stdout)["commands"]}
    assert [c for c, v in cells["mixed_stages"].items() if v["guarded"]] == [
        c for c in cells["mixed_stages"] if c != "verify"]
    zero2 = cells["zero2_bf16"]
    assert zero2["convert --to zero2"]["applies"] is False and zero2["convert --to zero2"]["guarded"] is False
    assert not any(v["guarded"] for v in zero2.values() if v["applies"])
