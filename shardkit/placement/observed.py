"""Judge a recorded snapshot (``shardkit preflight --observed``): every tensor of a run recorded on
some machine (``placement/snapshot.py``, or the H100 recordings in ``tests/data/gpu_truth/``) against
the devices the run's config implies, with the same rules the live preflight uses.

Every entry gets an expectation or is listed as not checked with the reason; nothing is skipped
silently. Expectations come from ``placement/expected.py`` (config -> ExpectedDevices),
``placement/zero_attrs.py`` (DeepSpeed optimizer attributes) and ``device_rules.step_device``.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from shardkit.config.loading import load_config
from shardkit.config.view import deepspeed_view
from shardkit.core.errors import UsageError
from shardkit.core.files import FileReadError, read_regular_file
from shardkit.placement import records as R
from shardkit.placement.expected import ExpectedDevices, deepspeed_expected, fsdp_expected, torch_expected
from shardkit.placement.records import PlacementRecord, RankReport
from shardkit.placement.report import PlacementReport
from shardkit.placement.verdict import judge
from shardkit.placement.zero_attrs import attr_key, expected_for, rule_for
from shardkit.platform.device_rules import TORCH_HYPERPARAMETERS

PHASES = ("after_init", "after_step")
"""Phases a recording holds, in the order they are judged."""

_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}
_INDEX = re.compile(r"\[([^\]]*)\]")
# Keep a snapshot file small enough to read whole; the 1B-parameter recordings are < 1 MB.
_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class NotChecked:
    """A recorded tensor shardkit has no rule for: listed, never dropped."""

    phase: str
    name: str
    device: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"phase": self.phase, "name": self.name, "device": self.device, "reason": self.reason}


@dataclass
class ObservedReport:
    """The verdict on one snapshot: one PlacementReport per phase plus what was not checked."""

    name: str
    engine: str
    compute: str
    config_source: str
    """Where the expectations' config came from (``--config FILE`` or the snapshot's spec)."""
    phases: dict[str, PlacementReport] = field(default_factory=dict)
    not_checked: list[NotChecked] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.phases.values())

    @property
    def checked(self) -> int:
        return sum(len(rep.records) for p in self.phases.values() for rep in p.ranks)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def summary(self) -> str:
        verdict = "healthy" if self.ok else "PROBLEMS"
        nc = f"; {len(self.not_checked)} not checked (listed below)" if self.not_checked else ""
        return (f"{self.name}: {verdict} - {self.checked} tensor devices in {len(self.phases)} phase(s) "
                f"({', '.join(self.phases)}) judged as {self.engine} on {self.compute}, config from "
                f"{self.config_source}{nc}")

    def render(self) -> str:
        lines = [self.summary()]
        for phase, rep in self.phases.items():
            if not rep.ok:
                lines += ["", f"{phase}:", rep.render()]
        if self.not_checked:
            lines += ["", "not checked (no rule; add one in shardkit/placement/zero_attrs.py if it matters):"]
            lines += [f"  {n.phase}  {n.name}  {n.device}  {n.reason}" for n in self.not_checked]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "ok": self.ok, "engine": self.engine, "compute": self.compute,
            "config_source": self.config_source, "checked": self.checked,
            "phases": {k: v.to_dict() for k, v in self.phases.items()},
            "not_checked": [n.to_dict() for n in self.not_checked],
        }


def load_snapshot(path: str | Path) -> dict[str, Any]:
    """Read a snapshot file; any problem is a UsageError naming the file and what is wrong."""
    p = Path(path)
    try:
        raw = read_regular_file(p, _MAX_BYTES)
    except FileReadError as exc:
        hint = (" (a snapshot written by `shardkit preflight --record` or one of tests/data/gpu_truth/*.json)"
                if exc.reason == "missing" else "")
        raise UsageError(f"--observed {exc}{hint}") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"--observed {p}: not valid JSON ({str(exc)[:120]}); expected a snapshot object") from None
    problem = _shape_problem(data)
    if problem:
        raise UsageError(f"--observed {p}: {problem}")
    return data


def _shape_problem(data: Any) -> str:
    if not isinstance(data, dict):
        return f"top level is {type(data).__name__}, expected an object with 'spec' and phases {PHASES}"
    if not isinstance(data.get("spec"), dict) or data["spec"].get("engine") not in ("deepspeed", "fsdp2", "torch"):
        return "'spec.engine' must be 'deepspeed', 'fsdp2' or 'torch'"
    phases = [k for k in data if isinstance(data[k], list)]
    if not phases:
        return f"no phase lists (expected {' / '.join(PHASES)})"
    for ph in phases:
        for i, e in enumerate(data[ph]):
            if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not isinstance(e.get("device"), str):
                return f"{ph}[{i}]: each entry needs string 'name' and 'device'"
    return ""


def snapshot_compute(snapshot: Mapping[str, Any]) -> str:
    """The recorded rank's compute device: ``compute_device`` when recorded (``--record`` writes it);
    the first H100 recordings predate it and say only ``gpu``: CUDA device ``local_rank`` (0)."""
    dev = snapshot.get("compute_device")
    if isinstance(dev, str) and dev:
        return dev
    if snapshot.get("gpu"):
        return f"cuda:{int(snapshot.get('local_rank', 0) or 0)}"
    return "cpu"


def judge_snapshot(snapshot: Mapping[str, Any], config: Mapping[str, Any] | None = None, config_source: str = "") -> ObservedReport:
    """Judge every phase of ``snapshot``; ``config`` (DeepSpeed JSON or shardkit FSDP2 config)
    replaces the spec's when given."""
    spec = snapshot.get("spec") or {}
    kind = spec.get("engine", "torch")
    compute = snapshot_compute(snapshot)
    rules = _Rules.build(kind, spec, config, compute, snapshot.get("optimizer") or {})
    out = ObservedReport(
        name=str(snapshot.get("name", "snapshot")), engine=rules.engine, compute=compute,
        config_source=config_source or "the snapshot's spec",
    )
    phases = [p for p in PHASES if isinstance(snapshot.get(p), list)]
    phases += [k for k, v in snapshot.items() if isinstance(v, list) and k not in phases]
    for phase in phases:
        report, skipped = rules.judge_phase(phase, snapshot[phase], snapshot)
        out.phases[phase] = report
        out.not_checked += skipped
    return out


@dataclass
class _Rules:
    engine: str
    kind: str
    stage: int
    expected: ExpectedDevices
    torch_step: bool
    """The inner optimizer is torch's (step on CPU unless fused/capturable), not DeepSpeed's."""
    fused: bool

    @classmethod
    def build(cls, kind: str, spec: Mapping[str, Any], config: Mapping[str, Any] | None, compute: str,
              opt: Mapping[str, Any]) -> "_Rules":
        fused = bool(opt.get("fused") or opt.get("capturable") or spec.get("fused"))
        if kind == "deepspeed":
            cfg = dict(config if config is not None else spec.get("config") or {})
            stage = int(deepspeed_view(cfg).stage or 0)
            # DeepSpeed builds its own optimizers (FusedAdam, DeepSpeedCPUAdam) from the config's
            # "optimizer" block; a recorded class says otherwise when a torch optimizer was passed in.
            torch_step = str(opt.get("class", "")).startswith("torch.optim")
            return cls(f"deepspeed-zero{stage}", kind, stage, deepspeed_expected(cfg, compute), torch_step, fused)
        if kind == "fsdp2":
            if config is not None:
                block = config.get("fsdp") if isinstance(config.get("fsdp"), Mapping) else config
                on = bool(block.get("cpu_offload", False))
                why = f"fsdp.cpu_offload={str(on).lower()}"
            else:
                # The spec's "offload": true/false is CPUOffloadPolicy(pin_memory=...); absent means none.
                on = spec.get("offload") is not None
                why = "fully_shard(offload_policy=CPUOffloadPolicy)" if on else "fully_shard without CPU offload"
            return cls("fsdp2", kind, 0, fsdp_expected(on, compute, why), True, fused)
        return cls("torch", kind, 0, torch_expected(compute), True, fused)

    def judge_phase(self, phase: str, entries: list[dict[str, Any]], snapshot: Mapping[str, Any]) -> tuple[PlacementReport, list[NotChecked]]:
        rank = int(snapshot.get("rank", 0) or 0)
        counts = Counter(_attr(e["name"]) for e in entries if e["name"].startswith("opt."))
        fp32_count = counts.get("fp32_partitioned_groups_flat", 0) or 1
        records: list[PlacementRecord] = []
        skipped: list[NotChecked] = []
        unmanaged: list[str] = []
        for e in entries:
            for rec_name, kind, dev, exp, why in self._expect(e, fp32_count, counts, unmanaged):
                if exp is None:
                    skipped.append(NotChecked(phase, rec_name, dev, why))
                    continue
                nbytes = int(e.get("ds_numel" if rec_name.endswith(".ds_tensor") else "numel", 0) or 0) * _ITEMSIZE.get(str(e.get("dtype")), 4)
                records.append(PlacementRecord(rank, rec_name, kind, dev, exp, nbytes, 0, why))
        versions = {k: str(snapshot[k]) for k in ("torch", "deepspeed") if snapshot.get(k)}
        report = RankReport(rank=rank, world_size=int(snapshot.get("world_size", 1) or 1), host=str(snapshot.get("host", "")),
                            compute_device=self.expected.compute, engine=self.engine, versions=versions, config_digest="",
                            records=records, unmanaged=unmanaged)
        return judge([report]), skipped

    def _expect(self, e: Mapping[str, Any], fp32_count: int, counts: Counter, unmanaged: list[str]) -> list[tuple[str, str, str, str | None, str]]:
        """(record name, kind, actual, expected or None, why) for each device an entry records."""
        name, dev = e["name"], e["device"]
        x = self.expected
        if name.startswith("param "):
            pname = name[len("param "):]
            if self.kind == "deepspeed" and self.stage == 3:
                if "ds_tensor" not in e:
                    unmanaged.append(pname)
                    return [(pname, R.ZERO_UNMANAGED, dev, x.compute, "no ds_tensor: created after deepspeed.initialize, ZeRO-3 does not manage it")]
                return [(pname, R.PARAM, dev, x.compute, "ZeRO-3 gathers parameters on the compute device"),
                        (f"{pname}.ds_tensor", R.ZERO_PARAM_SHARD, str(e["ds_tensor"]), x.param_shard, x.param_shard_why)]
            if self.kind == "fsdp2":
                if "local" not in e:
                    unmanaged.append(pname)
                    return [(pname, R.PARAM, dev, x.compute, "not sharded by fully_shard: must be on the compute device")]
                return [(pname, R.FSDP_SHARD, dev, x.param_shard, x.param_shard_why),
                        (f"{pname}.local", R.FSDP_SHARD, str(e["local"]), x.param_shard, x.param_shard_why)]
            return [(pname, R.PARAM, dev, x.compute, "compute device")]
        if name.startswith("grad "):
            where = x.param_shard if self.kind == "fsdp2" else x.compute
            why = x.param_shard_why if self.kind == "fsdp2" else "gradients are produced on the compute device"
            return [(name[len("grad "):] + ".grad", R.GRAD, dev, where, why)]
        if name.startswith("opt."):
            attr = _attr(name)
            rule = rule_for(attr) if self.kind == "deepspeed" else None
            if rule is None:
                return [(name, R.ZERO_STATE_BUFFER, dev, None, f"optimizer attribute {attr!r}: shardkit has no rule for it")]
            idx = _first_index(name)
            return [(name, R.ZERO_STATE_BUFFER, dev, *expected_for(rule, x, idx, counts.get(attr, 1)))]
        m = re.match(r"^state\[(\d+)\]\.(\w+)", name)
        if m:
            k, key = int(m.group(1)), m.group(2)
            if self.kind == "deepspeed":
                # ZeRO-3: state[k] is numbered by the inner optimizer, which under partial offload
                # steps only the cpu sub-groups (ExpectedDevices.inner_state), not sub-group k.
                home, home_why = x.inner_state(k, fp32_count) if self.stage == 3 else (x.optimizer, x.optimizer_why)
            else:
                home, home_why = x.optimizer, x.optimizer_why
            if key == "step":
                return [(name, R.OPTIMIZER_STEP, dev, *self._step(home))]
            return [(name, R.OPTIMIZER_STATE, dev, home, home_why)]
        m = re.match(r"^param_groups\[(\d+)\]\.(\w+)", name)
        if m:
            if m.group(2) in TORCH_HYPERPARAMETERS:
                return [(name, R.PARAM_GROUP, dev, *self._step(x.optimizer))]
            return [(name, R.PARAM_GROUP, dev, x.optimizer, "param_group tensor used with the group's parameters")]
        return [(name, R.PARAM, dev, None, "unrecognised entry name (expected 'param', 'grad', 'opt.', 'state[', 'param_groups[')")]

    def _step(self, home: str) -> tuple[str, str]:
        if not self.torch_step:
            return home, "DeepSpeed optimizer: step beside its partition"
        if self.fused:
            return home, "fused/capturable: step on the parameter's device"
        return "cpu", "foreach/for-loop optimizers keep step on cpu (a device scalar costs a sync per step)"


def _attr(name: str) -> str:
    return attr_key(name[len("opt."):].split("[", 1)[0])


def _first_index(name: str) -> int:
    m = _INDEX.search(name)
    try:
        return int(m.group(1)) if m else 0
    except ValueError:
        return 0


def judge_snapshot_file(path: str | Path, config_path: str | None = None) -> ObservedReport:
    """``shardkit preflight --observed PATH [--config CFG]``: load, judge, return the report."""
    snap = load_snapshot(path)
    config = None
    source = ""
    if config_path:
        config = load_config(config_path)
        source = config_path
    return judge_snapshot(snap, config, source)
