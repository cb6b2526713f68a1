"""The resumed-run cache of tests/_ranks_zero3.py without any spawn: the bf16 variant is built in its
own run, only when available, and a failed build is raised again rather than repeated."""

from __future__ import annotations

import pytest

from tests import _ranks_zero3 as R


class _Sources(R.Sources):
    def _build(self, label):
        if label == "bf16_offload":
            raise ValueError("Type bf16 is not supported on your device.")
        return self.base / label, [1.0]


class _Resumed(R.Resumed):
    def __init__(self, base, sources):
        super().__init__(base, sources)
        self.calls: list[object] = []

    def _build_fp32(self, world):
        self.calls.append(world)
        if world == 1:
            raise RuntimeError("rank 0 failed at 1 rank")
        return {"ranks": [{"reference": {"losses": [1.0]}}] * world, "src": self.sources["fp32"]}

    def _build_bf16(self):
        self.calls.append("bf16")
        return super()._build_bf16()  # asks Sources for the bf16 checkpoint first: fails there


def test_a_failed_bf16_variant_never_errors_the_fp32_resumes_and_failures_are_not_rebuilt(tmp_path):
    runs = _Resumed(tmp_path, _Sources(tmp_path, reason=lambda label: None))
    with pytest.raises(ValueError, match="bf16 is not supported"):
        runs["bf16_offload_off"]
    assert len(runs[3]["ranks"]) == 3 and runs[3]["src"] == tmp_path / "fp32"  # fp32 at 3 ranks unaffected
    with pytest.raises(RuntimeError, match="rank 0 failed at 1 rank"):
        runs[1]
    for key in ("bf16_offload_off", 1):  # raised again from the cache, with the first error as cause
        with pytest.raises(RuntimeError, match=f"building the resumed run {key!r} failed earlier") as info:
            runs[key]
        assert info.value.__cause__ is not None
    runs[3]
    assert runs.calls == ["bf16", 3, 1]  # each spawn tried once
    assert runs["sources"] is runs.sources


def test_a_bf16_variant_this_machine_cannot_run_is_skipped_each_time_not_cached_as_a_failure(tmp_path):
    reason = "bf16 cannot run on this machine's cpu"
    runs = _Resumed(tmp_path, _Sources(tmp_path, reason=lambda label: reason if label == "bf16_offload" else None))
    for _ in range(2):
        with pytest.raises(pytest.skip.Exception, match=reason):
            runs["bf16_offload_off"]
    assert runs[3]["ranks"] and runs.calls == ["bf16", "bf16", 3]
    with pytest.raises(KeyError):
        runs[2]
