"""Every version gate in shardkit, in one place: installed versions, the known-bad DeepSpeed table
(shardkit/data/deepspeed_known_bad.json), version-dependent defaults, and the verified releases list.

Nothing here imports torch or deepspeed: versions come from importlib.metadata.
"""

from __future__ import annotations

import json
import platform
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata, resources
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from shardkit._version import __version__ as SHARDKIT_VERSION
from shardkit.config.paths import get, has
from shardkit.config.view import DeepSpeedView, deepspeed_view
from shardkit.core.errors import UsageError
from shardkit.core.findings import Finding, Severity
from shardkit.platform.verified import PACKAGES, match, verified_deepspeed_releases, verified_releases

# DeepSpeed releases the version table and the test suite cover (pyproject pins the same range).
SUPPORTED_DEEPSPEED = SpecifierSet(">=0.16.0,<0.20")

# offload_{optimizer,param}.pin_memory default flipped False -> True in 0.19.5 (DeepSpeed PR #8207).
PIN_MEMORY_DEFAULT_TRUE_SINCE = Version("0.19.5")


#: torch 2.7 added ``reshard_after_forward=None`` to ``fully_shard`` (the root stays unsharded after
#: forward, since backward needs it first); torch 2.6 refuses None ("reshard_after_forward should be a
#: bool or an int"), so an FSDP2 root there gets True, 2.6's own default (the release verifier's
#: torch 2.6 run failed its FSDP2 smoke on this, docs/versions.md).
FSDP2_ROOT_NONE_SINCE = Version("2.7")


def _torch_at_least(since: Version) -> bool:
    """The installed torch's release is ``since`` or later (True without torch: nothing to gate)."""
    installed = package_version("torch")
    return installed is None or Version(Version(installed).base_version) >= since


def fsdp2_root_reshard_none_supported() -> bool:
    """Whether the installed torch's ``fully_shard`` takes ``reshard_after_forward=None``."""
    return _torch_at_least(FSDP2_ROOT_NONE_SINCE)


#: torch 2.7 gave ``torch.cpu.Stream`` the no-ops ``record_event``/``wait_event`` (pytorch PR #145935)
#: that FSDP2's collectives call: without them 2.6 fails the first CPU forward ("'Stream' object has
#: no attribute 'record_event'"); shardkit.engines.fsdp gives 2.6 the same no-ops.
CPU_STREAM_EVENTS_SINCE = Version("2.7")


def cpu_stream_events_supported() -> bool:
    """Whether the installed torch's ``torch.cpu.Stream`` has ``record_event``/``wait_event``."""
    return _torch_at_least(CPU_STREAM_EVENTS_SINCE)


#: torch 2.6's FSDP2 re-gathers resharded parameters for backward with a copy that on CPU (not CUDA)
#: bumps the autograd version of what forward saved (pytorch #132014): backward fails. Later torch hides
#: the bump (pytorch PR #146709 refines that, 2025-02, before 2.7 branched; 2.7-2.12 not run, 2.13 is);
#: reshard_after_forward=false never re-gathers and resumes bit-exact on 2.6 CPU ranks (smoke, 2026-11-26).
FSDP2_CPU_RESHARD_SINCE = Version("2.7")


def fsdp2_cpu_reshard_supported() -> bool:
    """Whether the installed torch's FSDP2 can reshard after forward on CPU ranks."""
    return _torch_at_least(FSDP2_CPU_RESHARD_SINCE)


def package_version(name: str, *, imported_first: bool = False) -> str | None:
    """The one version reader: a distribution's version from package metadata (no heavy imports),
    None when it is not installed. ``imported_first``: the imported module's ``__version__`` when
    the module is already imported, so what is compared is what actually runs (a stale egg-info
    can disagree with the code on sys.path)."""
    if imported_first:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "__version__"):
            return str(module.__version__)
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def installed_versions() -> dict[str, str | None]:
    """torch/deepspeed/transformers versions from package metadata (None when not installed)."""
    return {name: package_version(name) for name in PACKAGES}


def library_versions() -> dict[str, str]:
    """What a checkpoint manifest records: shardkit, and torch / deepspeed when installed."""
    out = {"shardkit": SHARDKIT_VERSION}
    for name in ("torch", "deepspeed"):
        version = package_version(name)
        if version is not None:
            out[name] = version
    return out


def runtime_versions() -> dict[str, str]:
    """What a placement record carries: python, shardkit, torch (when this process imported it)
    and deepspeed, as this process runs them (imported modules first)."""
    out = {"python": platform.python_version(), "shardkit": SHARDKIT_VERSION}
    if "torch" in sys.modules:
        torch_version = package_version("torch", imported_first=True)
        if torch_version is not None:
            out["torch"] = torch_version
    ds = package_version("deepspeed", imported_first=True)
    if ds is not None:
        out["deepspeed"] = ds
    return out


def parse_version(text: str, what: str = "--deepspeed-version") -> Version:
    """A packaging Version (local suffixes like '+cu121' dropped), or UsageError naming the flag."""
    try:
        return Version(Version(str(text).strip()).public)
    except InvalidVersion as exc:
        raise UsageError(f"{what} {text!r} is not a version number (expected e.g. 0.14.1)") from exc


def pin_memory_default(deepspeed_version: str | Version | None) -> bool | None:
    """What DeepSpeed uses when an offload block omits pin_memory; None when the release is unknown."""
    if deepspeed_version is None:
        return None
    v = deepspeed_version if isinstance(deepspeed_version, Version) else parse_version(str(deepspeed_version))
    return v >= PIN_MEMORY_DEFAULT_TRUE_SINCE


@dataclass(frozen=True)
class KnownBad:
    """One row of the known-bad table."""

    id: str
    deepspeed: SpecifierSet
    kind: str
    """"bug" (a release is broken), "behaviour" (a release changed what a config means) or
    "environment" (a release fails on some machines: evaluated by shardkit/platform/environment.py)."""
    severity: Severity
    when: dict[str, Any]
    key: str
    """Config key path the finding names: the setting that triggers the problem."""
    symptom: str
    fixed_in: str | None
    sources: tuple[str, ...]
    config_fix: str | None = None

    def affects(self, version: Version) -> bool:
        return self.deepspeed.contains(version, prereleases=True)


@lru_cache(maxsize=1)
def known_bad_table() -> tuple[KnownBad, ...]:
    """The table, validated once (a bad row is a packaging bug, so it raises plainly)."""
    text = resources.files("shardkit").joinpath("data/deepspeed_known_bad.json").read_text("utf-8")
    rows = []
    for e in json.loads(text)["entries"]:
        rows.append(
            KnownBad(
                id=e["id"],
                deepspeed=SpecifierSet(e["deepspeed"]),
                kind=e["kind"],
                severity=Severity(e["severity"]),
                when=dict(e.get("when") or {}),
                key=e["key"],
                symptom=e["symptom"],
                fixed_in=e.get("fixed_in"),
                sources=tuple(e.get("sources") or ()),
                config_fix=e.get("config_fix"),
            )
        )
    return tuple(rows)


def trigger_holds(name: str, want: Any, v: DeepSpeedView | None, torch_version: Version | None) -> bool:
    """One trigger condition on the config's typed view; unknown facts (no config, no torch
    version) count as 'may apply'."""
    if name == "torch":
        return torch_version is None or SpecifierSet(want).contains(torch_version, prereleases=True)
    if v is None:
        return True
    if name == "stage":
        return v.stage in want
    if name == "offload_optimizer":
        return v.offload_optimizer.device in want
    if name == "offload_param":
        return v.offload_param.device in want
    if name == "offload_any":
        return v.offload_any == bool(want)
    if name == "gradient_clipping":
        return v.clipping_on == bool(want)
    if name == "bf16":
        return v.bf16 == bool(want)
    if name == "fp16":
        return v.fp16 == bool(want)
    if name == "client_optimizer":
        return (not v.has_optimizer_section) == bool(want)
    if name == "pin_memory_unset":
        unset = any(o.pin_memory is None for o in v.active_offloads)
        return unset == bool(want)
    raise ValueError(f"deepspeed_known_bad.json: unknown trigger condition {name!r}")


def matching_entries(
    cfg: dict[str, Any] | None, deepspeed_version: str | Version, torch_version: str | Version | None = None
) -> list[KnownBad]:
    """Table rows whose version range holds and whose triggers match ``cfg`` (all rows' triggers
    count as matching when ``cfg`` is None). Environment rows are about the machine and never
    match here: shardkit.platform.environment.rows.environment_findings evaluates them against probed facts."""
    dsv = deepspeed_version if isinstance(deepspeed_version, Version) else parse_version(str(deepspeed_version))
    tv = None
    if torch_version is not None:
        tv = torch_version if isinstance(torch_version, Version) else parse_version(str(torch_version), "torch version")
    view = deepspeed_view(cfg) if cfg is not None else None  # read once, not once per trigger
    return [
        row
        for row in known_bad_table()
        if row.kind != "environment"
        and row.affects(dsv)
        and all(trigger_holds(k, w, view, tv) for k, w in row.when.items())
    ]


def _clean_release(
    cfg: dict[str, Any] | None,
    current: Version,
    torch_version: str | Version | None,
    start: str | None,
    outside: KnownBad | None = None,
) -> str | None:
    """The first release >= ``start`` (among fixed-in, verified and installed releases; never a
    guessed version) that is outside ``outside``'s range and has no known error-level bug for this
    config and torch, so the suggested upgrade does not walk into the next row of the table."""
    candidates = {Version(start)} if start else set()
    candidates |= {Version(r.fixed_in) for r in known_bad_table() if r.fixed_in}
    candidates |= {parse_version(v, "verified release") for v in verified_deepspeed_releases()}
    installed = installed_versions().get("deepspeed")
    if installed:
        candidates.add(parse_version(installed, "installed deepspeed"))
    floor = Version(start) if start else current
    for cand in sorted(c for c in candidates if c >= floor and c > current):
        if outside is not None and outside.affects(cand):
            continue
        if not any(r.kind == "bug" and r.severity is Severity.ERROR for r in matching_entries(cfg, cand, torch_version)):
            return str(cand)
    return None


def _finding(
    row: KnownBad, cfg: dict[str, Any] | None, dsv: Version, torch_version: str | Version | None
) -> Finding:
    sources = cite(row.sources)
    if row.kind == "behaviour":
        message = f"deepspeed {dsv}: {row.symptom} [{sources}]"
        fix = (row.config_fix or "see the sources").rstrip(".") + "."
    else:
        when = _describe_when(row.when)
        if cfg is None and when:
            message = f"deepspeed {dsv} is known bad with {when}: {row.symptom} [{sources}]"
        else:
            message = f"deepspeed {dsv} is known bad for this config: {row.symptom} [{sources}]"
        target = _clean_release(cfg, dsv, torch_version, row.fixed_in) if row.fixed_in else None
        if target and target == row.fixed_in:
            fix = f'pip install "deepspeed=={target}" (first fixed release) or newer'
        elif target:
            fix = (
                f'pip install "deepspeed=={target}" or newer ({row.fixed_in} fixes this but is itself known bad '
                "for this config/torch)"
            )
        elif row.fixed_in:
            fix = f'pip install "deepspeed>={row.fixed_in}"'
        else:
            other = _clean_release(cfg, dsv, torch_version, None, outside=row)
            fix = "no fixed release is confirmed upstream" + (
                f'; pip install "deepspeed=={other}" is outside the reported range ({row.deepspeed}) and has no '
                "known error for this config"
                if other
                else ""
            )
        if row.config_fix:
            fix += f"; {row.config_fix}"
    key = _finding_key(row, cfg)
    value: Any = f"deepspeed=={dsv}"
    if cfg is not None:
        if has(cfg, key):
            value = get(cfg, key)
    return Finding(
        severity=row.severity,
        key=key,
        value=value,
        message=message,
        fix=fix,
        rule=f"known-bad:{row.id}",
    )


def _finding_key(row: KnownBad, cfg: dict[str, Any] | None) -> str:
    """The key this config actually has (or lacks): the table's key is the generic spelling."""
    if cfg is None:
        return row.key
    view = deepspeed_view(cfg)
    if row.when.get("pin_memory_unset"):
        # name the offload block that omits pin_memory (offload_param alone, when only it does)
        unset = [o for o in view.active_offloads if o.pin_memory is None]
        if unset:
            return f"{unset[0].key}.pin_memory"
    head, _, rest = row.key.partition(".")
    if head == "bf16" and view.bf16_key != "bf16":  # the "bfloat16" alias DeepSpeed also accepts
        return f"{view.bf16_key}.{rest}" if rest else view.bf16_key
    return row.key


def known_bad_findings(
    cfg: dict[str, Any] | None,
    deepspeed_version: str | Version,
    torch_version: str | Version | None = None,
    *,
    kinds: tuple[str, ...] = ("bug", "behaviour"),
) -> list[Finding]:
    """A finding per table row that applies to ``deepspeed_version`` (and ``cfg``/``torch_version``
    when given), each naming the config key that triggers it and the exact pip install that fixes it."""
    dsv = deepspeed_version if isinstance(deepspeed_version, Version) else parse_version(str(deepspeed_version))
    return [_finding(row, cfg, dsv, torch_version) for row in matching_entries(cfg, dsv, torch_version) if row.kind in kinds]


def _describe_when(when: dict[str, Any]) -> str:
    """Trigger conditions in words ('ZeRO stage 3, offload_optimizer cpu/nvme, gradient clipping on')."""
    words = []
    for name, want in when.items():
        if name == "stage":
            words.append("ZeRO stage " + "/".join(str(s) for s in want))
        elif name in ("offload_optimizer", "offload_param"):
            words.append(f"{name} " + "/".join(want))
        elif name == "offload_any":
            words.append("any offload" if want else "no offload")
        elif name == "gradient_clipping":
            words.append("gradient clipping " + ("on" if want else "off"))
        elif name in ("bf16", "fp16"):
            words.append(f"{name} " + ("on" if want else "off"))
        elif name == "client_optimizer":
            words.append("no 'optimizer' section" if want else "an 'optimizer' section")
        elif name == "pin_memory_unset":
            words.append("pin_memory unset")
        elif name == "torch":
            words.append(f"torch {want}")
    return ", ".join(words)


def cite(urls: tuple[str, ...]) -> str:
    """'DeepSpeed #5422, #5538, PR #5504: https://github.com/...' (first URL in full, for clicking)."""
    groups: dict[str, list[str]] = {}
    for url in urls:
        parts = url.rstrip("/").split("/")
        if "github.com" in url and len(parts) >= 3 and parts[-2] in ("issues", "pull"):
            repo = parts[-3]
            groups.setdefault(repo, []).append(("PR #" if parts[-2] == "pull" else "#") + parts[-1])
        else:
            groups.setdefault(url, [])
    text = "; ".join(f"{repo} {', '.join(refs)}".strip() for repo, refs in groups.items())
    return f"{text}: {urls[0]}" if urls else text


@dataclass
class SupportStatus:
    """Whether an installed combination is inside the tested range and on the verified list."""

    deepspeed: str | None
    supported: bool | None
    verified: bool | None
    notes: list[str] = field(default_factory=list)
    why: str = ""
    """When not verified: which package differs from the closest verified row, and by how much."""


def support_status(versions: dict[str, str | None] | None = None, rows: list[dict[str, Any]] | None = None) -> SupportStatus:
    """Is the (installed) DeepSpeed in the range shardkit supports, and is the combination verified?

    ``rows``: verified rows to compare against (``verified_releases()`` when None).
    """
    versions = versions or installed_versions()
    ds = versions.get("deepspeed")
    if ds is None:
        return SupportStatus(None, None, None, ["deepspeed is not installed"])
    v = parse_version(ds, "installed deepspeed")
    status = SupportStatus(ds, SUPPORTED_DEEPSPEED.contains(v, prereleases=True), None)
    if not status.supported:
        status.notes.append(
            f"deepspeed {ds} is outside the range shardkit is tested with ({SUPPORTED_DEEPSPEED}); "
            f'pip install "deepspeed{SUPPORTED_DEEPSPEED}"'
        )
    rows = verified_releases() if rows is None else rows
    if rows:
        found = match(versions, rows)
        status.verified, status.why = found.verified, found.why
    return status
