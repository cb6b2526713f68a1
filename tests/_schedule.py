"""How ``pytest -n`` hands tests to the xdist workers: a whole module at a time, costliest first.

xdist's default (``--dist load``) deals tests out one by one, so the tests of one module land on
both workers and each worker builds the module's fixtures: a module-scoped 2-rank DeepSpeed save
or resume (30-60 s on 2 cores) was paid for twice, in 11 of the 20 slowest setups of a full run.
Here a module is one unit of work (tests marked ``xdist_group(name)`` form one unit across
modules, as xdist's ``loadgroup`` does), so each module fixture runs once per run.

Whole modules balance worse at the end of a run than single tests, so the units go out longest
first (the classic longest-processing-time order): the last ones to start are the short ones, and
neither worker idles long while the other finishes a 5-minute module. ``MODULE_SECONDS`` holds
what each costly unit took in a measured full run (``pytest -n 2 --durations=0``, setup + call +
teardown summed per unit, 2 loaded cores). A stale or missing entry only changes the order, never
what runs; units not listed (well under 10 s) go last, in collection order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest

#: unit (module path, or xdist_group name) -> seconds in the full run of 2026-11-29 (-n 2, 28:41, units
#: of 20 s or more; `python -m tests._schedule DURATIONS.txt` prints a new table from a --durations=0 run).
MODULE_SECONDS: dict[str, float] = {
    "tests/test_readme_walkthrough.py": 465,
    "tests/test_zero3_resume.py": 261,
    "tests/test_autopreflight_resume.py": 195,
    "slurm": 186,
    "tests/test_smoke_presets.py": 173,
    "tests/test_smoke.py": 108,
    "tests/test_zero3_writer.py": 99,
    "tests/test_export.py": 90,
    "tests/test_hostile_env.py": 69,
    "tests/test_silent_hangs.py": 66,
    "tests/test_preflight.py": 64,
    "tests/test_launch_pdsh.py": 57,
    "tests/test_zero12_writer.py": 53,
    "tests/test_reshard_zero2.py": 53,
    "tests/test_convert_names_precision.py": 50,
    "tests/test_wheel.py": 49,
    "tests/test_split_request.py": 49,
    "tests/test_universal_source.py": 49,
    "tests/test_resume_zero12_fp16_offload.py": 47,
    "tests/test_reshard_parallel.py": 46,
    "tests/test_estimate_engines.py": 44,
    "tests/test_convert_fsdp_to_zero3.py": 44,
    "tests/test_hf_callback.py": 43,
    "tests/test_spawn.py": 40,
    "tests/test_resume_zero12_sources.py": 37,
    "tests/test_atomic_deepspeed.py": 37,
    "tests/test_fsdp1_sources.py": 35,
    "tests/test_fsdp_dcp.py": 31,
    "tests/test_convert_universal.py": 30,
    "tests/test_launch.py": 29,
    "tests/test_convert_zero3_to_fsdp.py": 26,
    "tests/test_gpu_truth.py": 26,
    "tests/test_resume_zero12.py": 26,
    "tests/test_trainer_checkpoint.py": 24,
    "tests/test_fsdp1_bins.py": 24,
    "tests/test_inspect.py": 23,
    "tests/test_estimate.py": 23,
    "tests/test_partial_offload.py": 22,
    "tests/test_peft_lora.py": 22,
    "tests/test_export_architectures.py": 22,
    "tests/test_real_optimizers.py": 21,
    "tests/test_reshard_carries_files.py": 20,
}


def unit_of(nodeid: str) -> str:
    """The unit of work a test id belongs to: its xdist group (the ``@name`` suffix the workers add
    under ``--dist loadgroup``) or else its module."""
    if nodeid.rfind("@") > nodeid.rfind("]"):  # as xdist's own loadgroup: a '@' inside [params] is no group
        return nodeid.rsplit("@", 1)[-1]
    return nodeid.split("::", 1)[0]


def _unit_of_item(item: pytest.Item) -> str:
    groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")})
    return "_".join(groups) if groups else item.nodeid.split("::", 1)[0]


def costliest_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: units by MODULE_SECONDS, longest first; a unit's tests stay
    together and in their own order. Every worker collects, and must order, identically."""
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(_unit_of_item(item), i)
    items.sort(key=lambda item: (-MODULE_SECONDS.get(_unit_of_item(item), 0.0), first[_unit_of_item(item)]))


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scheduler, with a module (or an xdist group) as the unit of work."""
    from xdist.scheduler.loadscope import LoadScopeScheduling

    config.option.loadscopereorder = False  # keep the workers' order (costliest_first), not by test count

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return ModuleScheduling(config, log)


def unit_seconds(durations_text: str) -> dict[str, float]:
    """Seconds per unit from pytest's ``--durations=0`` lines (``12.34s call tests/x.py::test_y``)."""
    import re

    out: dict[str, float] = {}
    for m in re.finditer(r"^([\d.]+)s (?:setup|call|teardown)\s+(\S+)", durations_text, re.M):
        unit = unit_of(m.group(2))
        out[unit] = out.get(unit, 0.0) + float(m.group(1))
    return out


if __name__ == "__main__":  # python -m tests._schedule DURATIONS.txt: a new MODULE_SECONDS table
    import sys
    from pathlib import Path

    seconds = unit_seconds(Path(sys.argv[1]).read_text())
    for unit, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        if s >= 10:
            print(f'    "{unit}": {s:.0f},')
