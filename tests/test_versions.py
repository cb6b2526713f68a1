"""The known-bad DeepSpeed table: version ranges and trigger conditions evaluated over configs."""

import json

import pytest
from packaging.version import Version

from shardkit.platform.verified import PACKAGES, show_recorded
from shardkit.platform.versions import (
    installed_versions,
    known_bad_findings,
    known_bad_table,
    pin_memory_default,
    support_status,
    verified_releases,
)

OFFLOAD_CLIP = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
}


def rules(findings):
    return {f.rule.split(":", 1)[1] for f in findings}


def test_table_rows_are_well_formed():
    rows = known_bad_table()
    assert len(rows) >= 9
    for row in rows:
        assert row.sources and all(s.startswith("https://github.com/") for s in row.sources), row.id
        assert row.kind in ("bug", "behaviour", "environment") and row.key and row.symptom
        if row.fixed_in:
            assert not row.affects(Version(row.fixed_in)), f"{row.id}: fixed_in {row.fixed_in} is inside its own range"


@pytest.mark.parametrize("version, hit", [("0.14.0", False), ("0.14.1", True), ("0.14.2", True), ("0.14.3", False), ("0.14.5", False)])
def test_zero3_offload_clipping_range(version, hit):
    assert ("ds-5422-offload-clip-device-mismatch" in rules(known_bad_findings(OFFLOAD_CLIP, version, "2.3"))) is hit


def test_zero3_offload_clipping_finding_cites_the_issue_and_the_pip_fix():
    f = next(f for f in known_bad_findings(OFFLOAD_CLIP, "0.14.1", "2.3") if "5422" in f.rule)
    assert f.severity.value == "error" and f.key == "gradient_clipping" and f.value == 1.0
    assert "#5422" in f.message and "unscale_and_clip_grads" in f.message
    assert f.fix.startswith('pip install "deepspeed==0.14.5"') and "or newer" in f.fix


def test_suggested_upgrade_skips_releases_that_are_bad_with_this_torch():
    # 0.14.5 fixes #5422 but cannot load checkpoints with torch >= 2.6: suggest 0.16.0 instead
    f = next(f for f in known_bad_findings(OFFLOAD_CLIP, "0.14.1", "2.13.0") if "5422" in f.rule)
    assert f.fix.startswith('pip install "deepspeed==0.16.0"') and "0.14.5 fixes this" in f.fix
    assert "lightning-20643-torch-weights-only" in rules(known_bad_findings(OFFLOAD_CLIP, "0.15.4", "2.6.0"))
    assert "lightning-20643-torch-weights-only" not in rules(known_bad_findings(OFFLOAD_CLIP, "0.15.4", "2.5.1"))


def test_trigger_conditions_must_all_hold():
    no_clip = {**OFFLOAD_CLIP, "gradient_clipping": 0}
    no_offload = {**OFFLOAD_CLIP, "zero_optimization": {"stage": 3}}
    stage2 = {**OFFLOAD_CLIP, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    for cfg in (no_clip, no_offload, stage2):
        assert "ds-5422-offload-clip-device-mismatch" not in rules(known_bad_findings(cfg, "0.14.1", "2.3"))
    # without a config every row for the release applies, described in words
    f = next(f for f in known_bad_findings(None, "0.14.1", "2.3") if "5422" in f.rule)
    assert "ZeRO stage 3, offload_optimizer cpu/nvme, gradient clipping on" in f.message


def test_zero2_wrong_gradients_range():
    z2 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    assert "ds-7718-zero2-wrong-grads" in rules(known_bad_findings(z2, "0.18.0"))
    assert "ds-7718-zero2-wrong-grads" not in rules(known_bad_findings(z2, "0.18.3"))
    assert "ds-7718-zero2-wrong-grads" not in rules(known_bad_findings(OFFLOAD_CLIP, "0.18.0"))


def test_pin_memory_default_gate():
    assert pin_memory_default("0.19.4") is False and pin_memory_default("0.19.5") is True
    assert pin_memory_default(None) is None


def test_installed_versions_come_from_metadata_without_importing_torch():
    import subprocess
    import sys

    code = (
        "import sys; from shardkit.platform.versions import installed_versions, support_status\n"
        "v = installed_versions(); support_status(v)\n"
        "assert v['deepspeed'] and v['torch'], v\n"
        "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    assert support_status({"deepspeed": "0.14.1", "torch": "2.3"}).supported is False
    assert support_status(installed_versions()).supported is True


RECORDED = {
    "releases": [
        {"deepspeed": "0.19.8", "torch": "2.13.0+cpu", "transformers": "5.23.0", "result": "pass"},
        {"deepspeed": "0.18.9", "torch": "2.13.0+cpu", "result": "fail", "broke": "zero3 resume"},
        {"deepspeed": "0.17.6", "torch": "2.13.0+cpu"},  # no result recorded: not a pass
    ]
}


def test_only_passing_rows_count_as_verified():
    rows = verified_releases(RECORDED)
    assert [r["deepspeed"] for r in rows] == ["0.19.8"]
    assert support_status({"deepspeed": "0.18.9", "torch": "2.13.0+cpu"}, rows).verified is False
    assert support_status({"deepspeed": "0.17.6", "torch": "2.13.0+cpu"}, rows).verified is False
    assert all(r.get("result") == "pass" for r in verified_releases())  # the shipped file


@pytest.mark.parametrize("torch_version", ["2.13.0+cu121", "2.13.0", "2.13.0+cpu", "2.13"])
def test_verified_compares_release_numbers_not_strings(torch_version):
    rows = verified_releases(RECORDED)
    status = support_status({"deepspeed": "0.19.8", "torch": torch_version, "transformers": "5.23.0"}, rows)
    assert status.verified is True
    assert support_status({"deepspeed": "0.19.8", "torch": "2.13.1+cu121", "transformers": "5.23.0"}, rows).verified is False


PIN_UNSET_PARAM_ONLY = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                          "offload_param": {"device": "cpu"}},
}


def test_pin_memory_default_row_names_the_block_that_omits_it():
    (f,) = [f for f in known_bad_findings(PIN_UNSET_PARAM_ONLY, "0.19.8") if f.rule == "known-bad:ds-8207-pin-memory-default"]
    assert f.key == "zero_optimization.offload_param.pin_memory"
    both = {**PIN_UNSET_PARAM_ONLY, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
    (f,) = [f for f in known_bad_findings(both, "0.19.8") if f.rule == "known-bad:ds-8207-pin-memory-default"]
    assert f.key == "zero_optimization.offload_optimizer.pin_memory"


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16"])
def test_bf16_row_names_the_spelling_the_config_uses(spelling):
    cfg = {"train_micro_batch_size_per_gpu": 1, spelling: {"enabled": True}, "zero_optimization": {"stage": 2}}
    (f,) = [f for f in known_bad_findings(cfg, "0.19.3") if f.rule == "known-bad:ds-8224-zero2-bf16-reused-module"]
    assert f.key == f"{spelling}.enabled" and f.value is True


def test_check_cli_against_another_release(run_cli, tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(OFFLOAD_CLIP))
    code, out, _ = run_cli("check", p, "--deepspeed-version", "0.14.1", "--torch-version", "2.3", "--json")
    data = json.loads(out)
    assert code == 1
    f = next(f for f in data["findings"] if "5422" in f["rule"])
    assert f["fix"].startswith('pip install "deepspeed==0.14.5"')
    assert run_cli("check", p, "--deepspeed-version", "0.14.0", "--torch-version", "2.3")[0] == 0


def test_versions_cli_reports_installed_and_matching_rows(run_cli, tmp_path, monkeypatch):
    # this machine's environment rows (tests/test_environment.py) must not decide the exit code here
    for name in ("TORCH_CUDA_ARCH_LIST", "DS_PIN_MEMORY_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    code, out, _ = run_cli("versions", "--json")
    data = json.loads(out)
    assert code == 0 and data["installed"]["deepspeed"] == installed_versions()["deepspeed"]
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(OFFLOAD_CLIP))
    code, out, _ = run_cli("versions", "--config", p, "--deepspeed-version", "0.14.2", "--json")
    found = {f["rule"] for f in json.loads(out)["report"]["findings"]}
    assert code == 1 and "known-bad:ds-5422-offload-clip-device-mismatch" in found
    assert "known-bad:ds-7718-zero2-wrong-grads" not in found  # trigger does not match a ZeRO-3 config
    code, out, _ = run_cli("versions", "--config", p, "--deepspeed-version", "0.14.2")
    assert code == 1 and "#5422" in out and 'pip install "deepspeed==' in out


def test_environment_rows_name_a_machine_trigger_and_never_match_a_config_alone():
    from shardkit.platform.environment.rows import ENVIRONMENT_CONDITIONS
    from shardkit.platform.versions import matching_entries

    env_rows = [r for r in known_bad_table() if r.kind == "environment"]
    assert {r.id for r in env_rows} == {
        "ds-7977-arch-list-suffix", "ds-6810-cuda-build-without-driver", "ds-7207-cpu-fp16",
        "ds-976-nvme-swap-memlock", "ds-8211-native-pinning-memlock",
    }
    for row in env_rows:
        assert any(c in row.when for c in ENVIRONMENT_CONDITIONS), row.id
        assert row.config_fix or row.id == "ds-7977-arch-list-suffix", row.id  # its fix is computed from the value
    fp16 = {**OFFLOAD_CLIP, "fp16": {"enabled": True}}
    for version in ("0.16.0", "0.19.8"):
        assert not [r for r in matching_entries(fp16, version) if r.kind == "environment"]
        assert not [r for r in matching_entries(None, version) if r.kind == "environment"]


# --- the verified-releases record, the page that shows it, and the script that writes it -------------

def _shipped_rows() -> dict:
    from importlib import resources

    return json.loads(resources.files("shardkit").joinpath("data/verified_releases.json").read_text("utf-8"))


def test_shipped_rows_say_what_ran_and_that_it_passed():
    import datetime as dt

    data = _shipped_rows()
    assert data["releases"], "no verified release recorded"
    for row in data["releases"]:
        pair = (row["deepspeed"], row["torch"])
        dt.date.fromisoformat(row["date"])  # a real date: a row says when it was run
        assert row["result"] == "pass" and row["python"] and row["covers"], pair
        assert {s["engine"] for s in row["smoke"]} == {"zero3", "fsdp2"}, pair
        assert all(s["ok"] and s["exact"] and s["exit_code"] == 0 for s in row["smoke"]), pair
        assert all(c["ok"] and c["tensors"] > 0 for c in row.get("round_trips", [])), pair
    torches = {Version(r["torch"].split("+")[0]) for r in data["releases"]}
    assert min(torches) >= Version("2.6"), "a row below the torch pyproject.toml allows"


def test_versions_page_table_is_the_record():
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "versions.md").read_text()
    section = page.split("## Verified versions", 1)[1]
    table = {tuple(cell.strip() for cell in line.strip("|").split("|"))
             for line in section.splitlines() if re.match(r"^\| \d+\.\d+\.\d+ \|", line)}
    shown = {(cells[0], cells[1], cells[2], re.match(r"\d{4}-\d\d-\d\d", cells[-1]).group(0)) for cells in table}
    recorded = {(r["deepspeed"], r["torch"], show_recorded(r["transformers"]), r["date"])
                for r in _shipped_rows()["releases"]}
    assert shown == recorded, f"docs/versions.md shows {sorted(shown ^ recorded)} differently from verified_releases.json"


def _verifier():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "verify_deepspeed_release.py"
    spec = importlib.util.spec_from_file_location("verify_deepspeed_release", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_verifier_keeps_one_row_per_deepspeed_torch_pair(tmp_path):
    verifier = _verifier()
    record = tmp_path / "verified.json"
    row = {"deepspeed": "0.19.8", "torch": "2.13.0+cpu", "date": "2026-11-21", "result": "pass"}
    verifier.record(row, record)
    verifier.record({**row, "torch": "2.14.1", "result": "pass"}, record)
    verifier.record({**row, "deepspeed": "0.18.9", "torch": "2.6.0", "result": "pass"}, record)
    verifier.record({**row, "torch": "2.14.1", "result": "fail", "broke": "zero3: resumed losses differ"}, record)
    data = json.loads(record.read_text())
    # a failed rerun of a pair moves it out of "releases": never read as verified afterwards
    assert [(r["deepspeed"], r["torch"]) for r in data["releases"]] == [("0.19.8", "2.13.0+cpu"), ("0.18.9", "2.6.0")]
    assert [(r["deepspeed"], r["torch"]) for r in data["failed"]] == [("0.19.8", "2.14.1")]
    assert [r["deepspeed"] for r in verified_releases(data)] == ["0.19.8", "0.18.9"]
    assert "torch" in data["about"]


def test_every_shipped_row_names_every_package_versions_compares():
    for row in _shipped_rows()["releases"] + _shipped_rows()["failed"]:
        missing = [name for name in PACKAGES if not row.get(name)]
        assert not missing, f"row {row['deepspeed']}/{row['torch']} names no {missing}: it would vouch for nothing there"


def test_versions_on_the_installed_packages_is_verified(run_cli):
    # what ./install.sh installs on a CPU machine (torch 2.13.0+cpu, DeepSpeed 0.19.8, transformers
    # 5.24.0) is a row of the record: the suite runs on it, so `versions` must say so
    code, out, err = run_cli("versions", "--json")
    data = json.loads(out)
    assert data["support"]["verified"] is True, (data["installed"], data["support"])
    assert data["support"]["verified_why"] == ""


def test_a_differing_package_is_named_with_how_far_it_is(run_cli, monkeypatch):
    from shardkit.platform.environment import report

    faked = {"torch": "2.13.0+cpu", "deepspeed": "0.19.8", "transformers": "5.26.1"}
    monkeypatch.setattr(report, "installed_versions", lambda: dict(faked))
    code, out, err = run_cli("versions")
    line = " ".join(out.split("\nverified", 1)[1].split())  # the console wraps long lines
    assert line.startswith("False (transformers 5.26.1 is 2 minor releases newer than 5.24.0 "
                           "(the row ran 5.23.0 to 5.24.0); closest verified row: torch 2.13.0+cpu, deepspeed "
                           "0.19.8, transformers 5.23.0-5.24.0"), out
    code, out, err = run_cli("versions", "--json")
    assert "transformers 5.26.1 is 2 minor releases newer" in json.loads(out)["support"]["verified_why"]


@pytest.mark.parametrize("versions, why", [
    ({"torch": "2.12.0", "transformers": "5.24.0"}, "torch 2.12.0 is 1 minor release older than 2.13.0"),
    ({"torch": "2.13.0", "transformers": "5.22.3"}, "transformers 5.22.3 is 1 minor release older than 5.23.0"),
    ({"torch": "2.13.0", "transformers": "6.0.0"}, "transformers 6.0.0 is 1 major release newer than 5.24.0"),
    ({"torch": "2.13.0", "transformers": None}, "transformers is not installed (the row ran 5.23.0-5.24.0)"),
    ({"torch": "2.13.0", "transformers": "5.23.7"}, ""),
])
def test_a_row_vouches_for_its_transformers_range_and_names_what_differs(versions, why):
    rows = [{"deepspeed": "0.19.8", "torch": "2.13.0+cpu", "transformers": ["5.23.0", "5.24.0"], "result": "pass"},
            {"deepspeed": "0.18.9", "torch": "2.13.0+cpu", "result": "pass"}]  # names no transformers
    status = support_status({"deepspeed": "0.19.8", **versions}, rows)
    assert status.verified is (not why) and status.why.startswith(why), status.why
    status = support_status({"deepspeed": "0.18.9", "torch": "2.13.0", "transformers": "5.23.0"}, rows)
    assert not status.verified and "the row records no transformers version" in status.why
