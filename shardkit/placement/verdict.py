"""Cross-rank checks: a pure function of every rank's RankReport. Rank 0 runs it and publishes the
verdict the other ranks raise (see preflight.py); one process runs it in tests."""

from __future__ import annotations

import math
from collections import defaultdict

from shardkit.core.findings import Finding, Severity
from shardkit.placement.records import RankReport
from shardkit.placement.report import PlacementReport

# How many parameter names a finding lists before "... and N more".
MAX_NAMES = 8


def judge(reports: list[RankReport], missing_ranks: list[int] | None = None) -> PlacementReport:
    reports = sorted(reports, key=lambda r: r.rank)
    findings: list[Finding] = []
    findings += _unmanaged(reports)
    findings += _accelerator_indices(reports)
    findings += _versions(reports)
    findings += _config_digest(reports)
    findings += _parameter_set(reports)
    findings += _zero3_coverage(reports)
    return PlacementReport(ranks=reports, findings=findings, missing_ranks=sorted(missing_ranks or []))


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_NAMES])
    return shown + (f" ... and {len(names) - MAX_NAMES} more" if len(names) > MAX_NAMES else "")


def _unmanaged(reports: list[RankReport]) -> list[Finding]:
    by_name: dict[str, list[int]] = defaultdict(list)
    engine = ""
    for rep in reports:
        engine = engine or rep.engine
        for name in rep.unmanaged:
            by_name[name].append(rep.rank)
    if not by_name:
        return []
    names = sorted(by_name)
    ranks = sorted({r for rs in by_name.values() for r in rs})
    if engine.startswith("fsdp"):
        msg = (f"{len(names)} parameter(s) are plain tensors, not DTensor shards: added after fully_shard, so "
               f"FSDP2 neither shards nor reduces their gradients (ranks {ranks}): {_names(names)}.")
        fix = "Replace/add submodules before fully_shard (apply_fsdp), or call fully_shard on the new module too."
    else:
        msg = (f"{len(names)} parameter(s) have no ds_id: created after deepspeed.initialize, so ZeRO-3 does not "
               f"partition, gather or update them (ranks {ranks}): {_names(names)}.")
        fix = ("Replace or add modules before deepspeed.initialize (inside deepspeed.zero.Init when you use it), "
               "then build the engine from the final model.")
    return [Finding(Severity.ERROR, "unmanaged_parameters", names[:MAX_NAMES], msg, fix, rule="placement.unmanaged")]


def _accelerator_indices(reports: list[RankReport]) -> list[Finding]:
    out: list[Finding] = []
    users: dict[tuple[str, str], list[int]] = defaultdict(list)
    for rep in reports:
        if rep.compute_device.split(":")[0] in ("cpu", "meta"):
            continue  # CPU ranks share the host by design
        users[(rep.host, rep.compute_device)].append(rep.rank)
    for (host, dev), ranks in sorted(users.items()):
        if len(ranks) > 1:
            out.append(Finding(
                Severity.ERROR, f"host {host}: {dev}", ranks,
                f"ranks {ranks} all compute on {dev} on {host}: they share one accelerator (memory and speed divided, "
                "NCCL may hang).",
                "Give each local rank its own device: torch.accelerator.set_device_index(LOCAL_RANK) (or "
                "torch.cuda.set_device), and check CUDA_VISIBLE_DEVICES is not set to a single device per node.",
                rule="placement.shared_accelerator"))
    return out


def _versions(reports: list[RankReport]) -> list[Finding]:
    out: list[Finding] = []
    for pkg in ("torch", "deepspeed", "python", "shardkit"):
        seen: dict[str, list[int]] = defaultdict(list)
        for rep in reports:
            seen[rep.versions.get(pkg, "not installed")].append(rep.rank)
        if len(seen) > 1:
            detail = "; ".join(f"{v} on ranks {rs}" for v, rs in sorted(seen.items()))
            out.append(Finding(
                Severity.ERROR, f"versions.{pkg}", dict(seen),
                f"ranks run different {pkg} versions ({detail}): collectives and checkpoint layouts can differ silently.",
                f"Install the same {pkg} version in every node's environment (pip install '{pkg}=={max(seen, key=lambda k: len(seen[k]))}').",
                rule="placement.version_skew"))
    return out


def _config_digest(reports: list[RankReport]) -> list[Finding]:
    seen: dict[str, list[int]] = defaultdict(list)
    for rep in reports:
        seen[rep.config_digest or "<none>"].append(rep.rank)
    if len(seen) <= 1:
        return []
    detail = "; ".join(f"{d[:12]} on ranks {rs}" for d, rs in sorted(seen.items()))
    return [Finding(
        Severity.ERROR, "config_digest", {d[:12]: rs for d, rs in seen.items()},
        f"ranks were built from different configs (sha256 {detail}).",
        "Pass the same config file to every rank (a shared path, not a per-node copy edited by hand).",
        rule="placement.config_skew")]


def _parameter_set(reports: list[RankReport]) -> list[Finding]:
    if len(reports) < 2:
        return []
    out: list[Finding] = []
    union = set().union(*(rep.param_numels for rep in reports))
    for rep in reports:
        missing = sorted(union - set(rep.param_numels))
        if missing:
            out.append(Finding(
                Severity.ERROR, f"rank {rep.rank}: parameters", missing[:MAX_NAMES],
                f"rank {rep.rank} lacks {len(missing)} parameter(s) other ranks have: {_names(missing)}.",
                "Build the same model on every rank (same code, same config, same conditional modules).",
                rule="placement.param_set"))
    for name in sorted(union):
        sizes = {rep.rank: rep.param_numels[name] for rep in reports if name in rep.param_numels}
        if len(set(sizes.values())) > 1:
            out.append(Finding(
                Severity.ERROR, name, sizes,
                f"{name} has different sizes across ranks (numel per rank {sizes}).",
                "Build the same model on every rank.", rule="placement.param_set"))
    return out


def _zero3_coverage(reports: list[RankReport]) -> list[Finding]:
    if not any(rep.zero3_partitions for rep in reports):
        return []
    world = len(reports)
    # Partitioned over the whole world unless every rank reports a smaller group (MiCS): then each
    # group of that size must cover the parameter, i.e. world/size copies in total.
    sizes = {rep.zero3_partition_ranks for rep in reports}
    group = sizes.pop() if len(sizes) == 1 and 0 < next(iter(sizes)) <= world else world
    out: list[Finding] = []
    bad: list[str] = []
    detail: dict[str, dict[int, int]] = {}
    names = sorted(set().union(*(rep.zero3_partitions for rep in reports)))
    for name in names:
        numel = max(rep.param_numels.get(name, 0) for rep in reports)
        parts = {rep.rank: rep.zero3_partitions.get(name, 0) for rep in reports}
        want = math.ceil(numel / group)
        # Each rank holds ceil(numel / group) elements (zero-padded): together they cover the
        # parameter; a smaller partition anywhere means elements no rank owns.
        if sum(parts.values()) < numel * (world // group) or any(v != want for v in parts.values()):
            bad.append(name)
            detail[name] = parts
    if bad:
        first = bad[0]
        out.append(Finding(
            Severity.ERROR, "zero3.partitions", {n: detail[n] for n in bad[:MAX_NAMES]},
            f"{len(bad)} parameter(s) are not covered by the ranks' ZeRO-3 partitions (each rank must hold "
            f"ceil(numel/{group}) elements): {_names(bad)}; e.g. {first} partition numel per rank {detail[first]}.",
            "Every rank must build the engine in the same process group with the same model; rebuild with "
            "deepspeed.initialize on all ranks (a partition resized by hand or loaded from another world size breaks coverage).",
            rule="placement.zero3_coverage"))
    return out
