"""Cross-rank checks: a pure function of every rank's RankSummary (plus, where digests differ, the
details of one rank per group). Rank 0 runs it and publishes the verdict the other ranks raise (see
preflight.py); ``judge`` runs it on full reports in one process (tests, recorded snapshots)."""

from __future__ import annotations

import math
from collections import defaultdict

from shardkit.core.findings import Finding, Severity
from shardkit.placement.records import RankReport
from shardkit.placement.report import PlacementReport
from shardkit.placement.summary import RankDetail, RankSummary, detail_of, summarize

# How many parameter names a finding lists before "... and N more".
MAX_NAMES = 8
# Groups of ranks with differing parameter digests whose maps rank 0 reads to name the difference.
MAX_DETAIL_GROUPS = 16


def judge(reports: list[RankReport], missing_ranks: list[int] | None = None) -> PlacementReport:
    """The verdict when every rank's full report is at hand (one process, a recorded snapshot, the
    gather fallback): the same checks as the distributed preflight, with every detail available."""
    reports = sorted(reports, key=lambda r: r.rank)
    summaries = [summarize(rep) for rep in reports]
    details = {rep.rank: detail_of(rep) for rep in reports}
    return judge_summaries(summaries, {r: details[r] for r in ranks_needing_detail(summaries)}, missing_ranks, held=reports)


def ranks_needing_detail(summaries: list[RankSummary]) -> list[int]:
    """The ranks whose parameter maps rank 0 must read to name what differs: none when every rank
    has the same digests, else the lowest rank of each group of equal digests (a few ranks, not all)."""
    groups = _digest_groups(summaries)
    if len(groups) <= 1:
        return []
    # Largest groups first (the majority is the reference), at most MAX_DETAIL_GROUPS of them: were
    # every rank different, reading every map would be the ranks x tensors cost this exchange avoids.
    # The groups beyond are named by _unread_groups.
    biggest = sorted(groups.values(), key=lambda ranks: (-len(ranks), ranks[0]))[:MAX_DETAIL_GROUPS]
    return sorted(ranks[0] for ranks in biggest)


def judge_summaries(
    summaries: list[RankSummary],
    details: dict[int, RankDetail],
    missing_ranks: list[int] | None = None,
    held: list[RankReport] | None = None,
) -> PlacementReport:
    """The cross-rank verdict from every rank's summary plus the details of the ranks
    ``ranks_needing_detail`` named. Cost grows with the world size, never with world x tensors."""
    summaries = sorted(summaries, key=lambda s: s.rank)
    findings: list[Finding] = []
    findings += _rank_problems(summaries)
    findings += _unmanaged(summaries)
    findings += _accelerator_indices(summaries)
    findings += _versions(summaries)
    findings += _config_digest(summaries)
    groups = _digest_groups(summaries)
    findings += _parameter_set(groups, details)
    findings += _unread_groups(groups, details)
    findings += _zero3_coverage(summaries, groups, details)
    return PlacementReport(ranks=sorted(held or [], key=lambda r: r.rank), summaries=summaries, findings=findings,
                           missing_ranks=sorted(missing_ranks or []))


def _digest_groups(summaries: list[RankSummary]) -> dict[tuple[str, str], list[int]]:
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for s in summaries:
        groups[(s.param_digest, s.zero3_digest)].append(s.rank)
    return dict(groups)


def _who(ranks: list[int]) -> str:
    """'rank 3', or 'ranks 0-7, 9-1023' for a group (runs of consecutive ranks joined)."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_short_list(ranks)}"


def _short_list(ranks: list[int]) -> str:
    """[0, 1] for a few ranks; 0-7, 9-1023 where runs make it shorter; at most 16 runs shown."""
    if len(ranks) <= 4:
        return str(ranks)
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs[:16])
    return text + (f", ... ({len(runs) - 16} more runs)" if len(runs) > 16 else "")


def _names(names: list[str], total: int | None = None) -> str:
    total = max(total or 0, len(names))
    shown = ", ".join(names[:MAX_NAMES])
    return shown + (f" ... and {total - min(len(names), MAX_NAMES)} more" if total > MAX_NAMES or total > len(names) else "")


def _rank_problems(summaries: list[RankSummary]) -> list[Finding]:
    """What ranks found wrong besides placement (``RankReport.problems``), ranks with the same
    problem named together: every rank then fails with the same table, not alone with its own."""
    ranks_by_problem: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for s in summaries:
        for problem in s.problems:
            ranks_by_problem[tuple(problem)].append(s.rank)
    out = []
    for (key, message, fix), ranks in ranks_by_problem.items():
        out.append(Finding(Severity.ERROR, key, _who(ranks), f"{_who(ranks)}: {message}",
                           (fix[:1].upper() + fix[1:] + ".") if fix else "", rule=f"placement.{key}"))
    return out


def _unmanaged(summaries: list[RankSummary]) -> list[Finding]:
    named = sorted({n for s in summaries for n in s.unmanaged})
    if not named:
        return []
    engine = next((s.engine for s in summaries if s.engine), "")
    ranks = [s.rank for s in summaries if s.unmanaged_count]
    count = max(max(s.unmanaged_count for s in summaries), len(named))
    names = _names(named, count)
    if engine.startswith("fsdp"):
        msg = (f"{count} parameter(s) are plain tensors, not DTensor shards: added after fully_shard, so "
               f"FSDP2 neither shards nor reduces their gradients (ranks {_short_list(ranks)}): {names}.")
        fix = "Replace/add submodules before fully_shard (apply_fsdp), or call fully_shard on the new module too."
    else:
        msg = (f"{count} parameter(s) have no ds_id: created after deepspeed.initialize, so ZeRO-3 does not "
               f"partition, gather or update them (ranks {_short_list(ranks)}): {names}.")
        fix = ("Replace or add modules before deepspeed.initialize (inside deepspeed.zero.Init when you use it), "
               "then build the engine from the final model.")
    return [Finding(Severity.ERROR, "unmanaged_parameters", named[:MAX_NAMES], msg, fix, rule="placement.unmanaged")]


def _accelerator_indices(reports: list[RankSummary]) -> list[Finding]:
    out: list[Finding] = []
    users: dict[tuple[str, str], list[int]] = defaultdict(list)
    for rep in reports:
        if rep.compute_device.split(":")[0] in ("cpu", "meta"):
            continue  # CPU ranks share the host by design
        users[(rep.host, rep.compute_device)].append(rep.rank)
    node_of = {rep.rank: rep.node_rank for rep in reports}
    for (host, dev), ranks in sorted(users.items()):
        nodes = sorted({node_of[r] for r in ranks if node_of[r] >= 0})
        if len(ranks) > 1 and len(nodes) > 1:
            # Different launcher agents (nodes) saying one host name: either two machines share a
            # hostname (containers started with one --hostname), or two agents run on one machine.
            by_node = "; ".join(f"node {n}: ranks {[r for r in ranks if node_of[r] == n]}" for n in nodes)
            out.append(Finding(
                Severity.ERROR, f"host {host}: {dev}", ranks,
                f"ranks {ranks} claim the same (host, device) = ({host}, {dev}) but were started by {len(nodes)} "
                f"different nodes ({by_node}): either those nodes report one hostname, so ranks cannot be told apart "
                "by host (and per-host checks and NCCL's topology detection go wrong), or the launchers of two nodes "
                "run on one machine and their ranks share its accelerators.",
                "Give every node a unique hostname (`hostname` on each must differ; containers: a distinct --hostname), "
                "and start one launcher per machine (srun --ntasks-per-node=1).",
                rule="placement.shared_accelerator"))
        elif len(ranks) > 1:
            out.append(Finding(
                Severity.ERROR, f"host {host}: {dev}", ranks,
                f"ranks {ranks} all compute on {dev} on {host}: they share one accelerator (memory and speed divided, "
                "NCCL may hang).",
                "Give each local rank its own device: torch.accelerator.set_device_index(LOCAL_RANK) (or "
                "torch.cuda.set_device), and check CUDA_VISIBLE_DEVICES is not set to a single device per node.",
                rule="placement.shared_accelerator"))
    return out


def _versions(reports: list[RankSummary]) -> list[Finding]:
    out: list[Finding] = []
    # across hosts, say which host runs which version: that names the node whose environment differs
    hosts = {rep.host for rep in reports if rep.host}
    host_of = {rep.rank: rep.host for rep in reports} if len(hosts) > 1 else {}
    for pkg in ("torch", "deepspeed", "python", "shardkit"):
        seen: dict[str, list[int]] = defaultdict(list)
        for rep in reports:
            seen[rep.versions.get(pkg, "not installed")].append(rep.rank)
        if len(seen) > 1:
            detail = "; ".join(f"{v} on ranks {rs}{_hosts(rs, host_of)}" for v, rs in sorted(seen.items()))
            out.append(Finding(
                Severity.ERROR, f"versions.{pkg}", dict(seen),
                f"ranks run different {pkg} versions ({detail}): collectives and checkpoint layouts can differ silently.",
                f"Install the same {pkg} version in every node's environment (pip install '{pkg}=={max(seen, key=lambda k: len(seen[k]))}').",
                rule="placement.version_skew"))
    return out


def _hosts(ranks: list[int], host_of: dict[int, str]) -> str:
    """' (host node1)' / ' (hosts node1, node2)' when the ranks report hosts, '' when none do."""
    hosts = sorted({host_of[r] for r in ranks if host_of.get(r)})
    if not hosts:
        return ""
    shown = ", ".join(hosts[:4]) + (f" ... and {len(hosts) - 4} more" if len(hosts) > 4 else "")
    return f" (host{'s' if len(hosts) > 1 else ''} {shown})"


def _config_digest(reports: list[RankSummary]) -> list[Finding]:
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


def _parameter_set(groups: dict[tuple[str, str], list[int]], details: dict[int, RankDetail]) -> list[Finding]:
    """Ranks that built a different parameter set, named from one representative per digest group."""
    reps = {ranks[0]: ranks for ranks in groups.values() if ranks[0] in details}
    if len(reps) < 2:
        return []
    out: list[Finding] = []
    union = set().union(*(details[r].param_numels for r in reps))
    for rep, ranks in sorted(reps.items()):
        missing = sorted(union - set(details[rep].param_numels))
        if missing:
            who = _who(ranks)
            out.append(Finding(
                Severity.ERROR, f"{who}: parameters", missing[:MAX_NAMES],
                f"{who} {'lacks' if len(ranks) == 1 else 'lack'} {len(missing)} parameter(s) other ranks have: {_names(missing)}.",
                "Build the same model on every rank (same code, same config, same conditional modules).",
                rule="placement.param_set"))
    for name in sorted(union):
        sizes = {_key(reps[rep]): details[rep].param_numels[name] for rep in sorted(reps) if name in details[rep].param_numels}
        if len(set(sizes.values())) > 1:
            out.append(Finding(
                Severity.ERROR, name, sizes,
                f"{name} has different sizes across ranks (numel per rank {sizes}).",
                "Build the same model on every rank.", rule="placement.param_set"))
    return out


def _unread_groups(groups: dict[tuple[str, str], list[int]], details: dict[int, RankDetail]) -> list[Finding]:
    """Groups past MAX_DETAIL_GROUPS: named by their ranks and digest, their maps never read."""
    unread = sorted((ranks for ranks in groups.values() if ranks[0] not in details), key=lambda r: r[0])
    if len(groups) < 2 or not unread:
        return []
    ranks = sorted(r for group in unread for r in group)
    return [Finding(
        Severity.ERROR, "parameter_set_digest", {_key(g): _digest_label(groups, g) for g in unread[:MAX_NAMES]},
        f"{len(groups)} different parameter sets across the ranks; {_who(ranks)} built sets not compared name by "
        f"name (rank 0 reads the maps of the {MAX_DETAIL_GROUPS} largest groups only)",
        "Build the same model on every rank (same code, same config, same conditional modules); run "
        "shardkit.collect_records on one of the ranks named to list its parameters.",
        rule="placement.param_set")]


def _digest_label(groups: dict[tuple[str, str], list[int]], ranks: list[int]) -> str:
    return next(f"params {p[:12]}" + (f", zero3 {z[:12]}" if z else "") for (p, z), g in groups.items() if g == ranks)


def _key(ranks: list[int]) -> int | str:
    """A rank's own number, or a group's label, as the key of a per-rank detail dict."""
    return ranks[0] if len(ranks) == 1 else _who(ranks)


def _zero3_coverage(summaries: list[RankSummary], groups: dict[tuple[str, str], list[int]],
                    details: dict[int, RankDetail]) -> list[Finding]:
    if not any(s.zero3_digest for s in summaries):
        return []
    world = len(summaries)
    # Partitioned over the whole world unless every rank reports a smaller group (MiCS).
    sizes = {s.zero3_partition_ranks for s in summaries}
    group = sizes.pop() if len(sizes) == 1 and 0 < next(iter(sizes)) <= world else world
    detail: dict[str, dict[int | str, int]] = {}
    # Each rank checked its own partitions against ceil(numel / group) ...
    for s in summaries:
        for name, (held, _want) in s.zero3_short.items():
            detail.setdefault(name, {})[s.rank] = held
    # ... and where ranks' partition maps differ, the representatives' maps say which names.
    reps = {ranks[0]: ranks for ranks in groups.values() if ranks[0] in details}
    if len(reps) > 1:
        names = set().union(*(details[r].zero3_partitions for r in reps))
        for name in sorted(names):
            numel = max(details[r].param_numels.get(name, 0) for r in reps)
            parts = {_key(reps[r]): details[r].zero3_partitions.get(name, 0) for r in sorted(reps)}
            if any(v != math.ceil(numel / group) for v in parts.values()):
                detail.setdefault(name, {}).update(parts)
    if not detail:
        return []
    bad = sorted(detail)
    first = bad[0]
    counted = max([len(bad)] + [s.zero3_short_count for s in summaries])
    shown = {n: dict(sorted(detail[n].items(), key=lambda kv: str(kv[0]))) for n in bad[:MAX_NAMES]}
    return [Finding(
        Severity.ERROR, "zero3.partitions", shown,
        f"{counted} parameter(s) are not covered by the ranks' ZeRO-3 partitions (each rank must hold "
        f"ceil(numel/{group}) elements): {_names(bad, counted)}; e.g. {first} partition numel per rank {shown[first]}.",
        "Every rank must build the engine in the same process group with the same model; rebuild with "
        "deepspeed.initialize on all ranks (a partition resized by hand or loaded from another world size breaks coverage).",
        rule="placement.zero3_coverage")]
