"""`shardkit smoke`: train, save, resume in fresh processes, and prove the loss curve is unchanged.

For each engine (DeepSpeed ZeRO-3, FSDP2) three runs of the tiny Llama on N ranks:

- run A trains K steps without interruption and records every rank's loss per step;
- run B trains the first K//2 steps, saves a checkpoint and exits;
- run C starts in *fresh* processes, resumes that checkpoint, runs the placement preflight, and
  trains the remaining steps.

The smoke passes when B's losses equal A's first half and C's equal A's second half: bit-exact on
CPU at the same world size (data is a pure function of (step, rank), every seed fixed), within a
small tolerance on GPUs (non-deterministic reductions). Everything that can go wrong on resume -
a checkpoint that does not load, state left on the wrong device, an optimizer or scheduler state
that was not restored - shows up as a failed load, a failed preflight or a different loss.

This module is the host side; the ranks run ``shardkit.run.smoke_rank``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

from shardkit.config.loading import config_kind, load_config
from shardkit.config.paths import get, strip_auto
from shardkit.config.view import deepspeed_view
from shardkit.core.errors import ShardkitError, UsageError
from shardkit.run.smoke_rank import RunSpec, rank_run

if TYPE_CHECKING:
    from shardkit.run.spawn import RankResult

Engine = Literal["zero3", "fsdp2"]
ENGINES: tuple[Engine, ...] = ("zero3", "fsdp2")

# Presets shipped in the package (shardkit/ds_configs/ links to the checkout's ds_configs/ and is
# package data, so an installed wheel has them too); the first one present wins, generated configs
# otherwise.
PRESET_CANDIDATES: dict[str, tuple[str, ...]] = {
    "zero3": ("zero3.json",),
    "fsdp2": ("fsdp2_full_shard.json",),
}

# Losses on GPUs go through non-deterministic kernels (atomics in reductions): resumed curves agree
# to float noise, not bits. On CPU (gloo) every run is bit-exact and nothing less is accepted.
GPU_RTOL = 1e-4


@dataclass
class SmokeOptions:
    """What `shardkit smoke` runs."""

    engines: tuple[Engine, ...] = ENGINES
    """Engines to exercise, in order."""
    nproc: int | None = None
    """Ranks per run (same world size for A, B and C, so CPU runs must match bit for bit); None =
    one per visible GPU, else 2 CPU ranks."""
    device: str = "auto"
    """auto: one nccl rank per visible GPU, CPU ranks without GPUs; cpu: gloo ranks that never touch
    a GPU; gpu: GPUs or a refusal. More ranks than visible GPUs is refused unless cpu (spawn.plan_ranks)."""
    steps: int = 4
    """Optimizer steps of the uninterrupted run; the checkpoint is taken after steps // 2."""
    config: str | None = None
    """A DeepSpeed or shardkit FSDP2 config to use instead of the preset/generated one."""
    model: str = "tiny"
    """Llama size from shardkit.engines.model_factory.LLAMA_SIZES; tiny keeps a CPU smoke well under a minute."""
    batch: int = 2
    """Sequences per rank per step."""
    seq_len: int = 32
    """Tokens per sequence."""
    seed: int = 0
    """Model init seed (identical on every rank and every run)."""
    timeout: float = 300.0
    """Hard limit per run (A, B or C) in seconds; ranks still alive then are killed."""
    workdir: str | None = None
    """Where checkpoints go (a temporary directory, removed afterwards, when None)."""
    keep_checkpoint: str | None = None
    """Keep run B's checkpoint (verified, resumable) here when the smoke passes: ``DIR`` for one
    engine, ``DIR/<engine>`` for several; ``shardkit verify``/``reshard``/``consolidate`` read it."""
    after_save: Callable[[Path], None] | None = field(default=None, repr=False)
    """Called with the checkpoint root between run B and run C (tests use it to corrupt a file)."""


@dataclass
class EngineResult:
    """The verdict for one engine."""

    engine: str
    ok: bool = False
    """All three runs finished, the preflight passed and the loss curves agree."""
    exact: bool = False
    """Resumed losses equal the uninterrupted ones bit for bit."""
    max_abs_diff: float | None = None
    """Largest |loss_resumed - loss_uninterrupted| over steps and ranks."""
    losses_uninterrupted: list[list[float]] = field(default_factory=list)
    """Run A: losses[rank][step]."""
    losses_resumed: list[list[float]] = field(default_factory=list)
    """Runs B then C concatenated: losses[rank][step]."""
    preflight: str = "not run"
    """Placement preflight after resume: passed, or not run (a failed preflight fails run C)."""
    checkpoint: str = ""
    """How the checkpoint was written and read (always through shardkit.checkpoint)."""
    config_source: str = ""
    """Where the config came from (a file, a preset, or generated)."""
    device: str = ""
    """The device rank 0 trained on."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time per run."""
    failure: str | None = None
    """One line saying what failed, or None."""
    kept_checkpoint: str | None = None
    """Where run B's checkpoint was kept (``--keep-checkpoint``), or None when it was removed."""
    keep_error: str | None = None
    """Why ``--keep-checkpoint`` could not move the checkpoint there, and where it was left; None
    when it was kept or not asked for (the smoke's verdict is unchanged: the runs passed)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SmokeReport:
    """Every engine's result."""

    results: list[EngineResult]
    nproc: int
    steps: int

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r.ok for r in self.results)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "nproc": self.nproc, "steps": self.steps, "results": [r.to_dict() for r in self.results]}


# --------------------------------------------------------------------------------------------
# configs


def default_config(engine: Engine, nproc: int, batch: int) -> tuple[dict[str, Any], str]:
    """The config for ``engine``: a preset shipped in shardkit/ds_configs/, else generated."""
    for name in PRESET_CANDIDATES[engine]:
        preset = resources.files("shardkit").joinpath("ds_configs", name)
        if preset.is_file():
            with resources.as_file(preset) as path:
                return fit_config(engine, load_config(path), nproc, batch), f"preset {name}"
    if engine == "zero3":
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": batch,
            "gradient_accumulation_steps": 1,
            # torch's AdamW: no JIT-built op needed, identical on every DeepSpeed release tested.
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3},
            "steps_per_print": 1_000_000,
        }
    else:
        cfg = {
            "fsdp": {"mixed_precision": "none", "wrap": ["LlamaDecoderLayer"]},
            "train": {"micro_batch": batch, "lr": 1e-3, "weight_decay": 0.01, "clip": 1.0},
        }
    return cfg, "generated"


def fit_config(engine: Engine, cfg: dict[str, Any], nproc: int, batch: int) -> dict[str, Any]:
    """Make a user's/preset config runnable at this world size without changing what it tests.

    DeepSpeed refuses ``train_batch_size != micro * grad_accum * world_size`` and silently drops
    ``"auto"`` values (HF Trainer fills them); the smoke sets the batch keys itself.
    """
    cfg = copy.deepcopy(cfg)
    if engine == "zero3":
        cfg.pop("train_batch_size", None)
        cfg["train_micro_batch_size_per_gpu"] = batch
        ga = cfg.get("gradient_accumulation_steps")
        cfg["gradient_accumulation_steps"] = ga if isinstance(ga, int) and ga > 0 else 1
        cfg.setdefault("steps_per_print", 1_000_000)
        if not isinstance(cfg.get("optimizer"), dict):
            cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
        # "auto" is only meaningful to the HF Trainer; DeepSpeed would drop these silently.
        cfg = strip_auto(cfg)
    else:
        train = cfg.setdefault("train", {})
        if isinstance(train, dict):
            train["micro_batch"] = batch
    return cfg


def config_for(engine: Engine, opts: SmokeOptions) -> tuple[dict[str, Any], str]:
    if opts.config is None:
        return default_config(engine, opts.nproc, opts.batch)
    cfg = load_config(opts.config)
    kind = config_kind(cfg)
    wanted = "deepspeed" if engine == "zero3" else "fsdp"
    if kind != wanted:
        raise UsageError(
            f"--config {opts.config} is a {kind} config but --engine {engine} needs a {wanted} config; "
            f"pass --engine {'zero3' if kind == 'deepspeed' else 'fsdp2'}"
        )
    if engine == "zero3":
        if deepspeed_view(cfg).stage != 3:
            stage = get(cfg, "zero_optimization.stage", 0)
            raise UsageError(
                f"--config {opts.config}: zero_optimization.stage is {stage!r}, the zero3 smoke needs 3. "
                "Set it to 3 or generate one with `shardkit config zero3 -o ds_config.json`."
            )
    return fit_config(engine, cfg, opts.nproc, opts.batch), f"file {opts.config}"


class _Progress:
    """A rich progress bar per engine (A, B, C, compare) on a terminal; elsewhere (logs, CI) one
    line per stage on stderr, since a bar is never drawn there; nothing when ``show`` is False."""

    def __init__(self, show: bool, plain: bool | None = None) -> None:
        self._p = None
        self._plain = show and (plain if plain is not None else not sys.stdout.isatty())
        self._said: dict[str, str] = {}
        self._start = time.monotonic()
        if show and not self._plain:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            from shardkit.core.render import console

            self._p = Progress(
                TextColumn("{task.fields[engine]:<6}"),
                BarColumn(bar_width=20),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                console=console(),
                transient=False,
            )

    def __enter__(self) -> "_Progress":
        if self._p is not None:
            self._p.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._p is not None:
            self._p.__exit__(*exc)

    def task(self, engine: str, total: int = 4) -> Any:
        if self._plain:
            return engine
        return self._p.add_task("starting", total=total, engine=engine) if self._p is not None else None

    def update(self, task: Any, description: str, advance: int = 0) -> None:
        if self._plain and self._said.get(task) != description:
            self._said[task] = description
            print(f"[{time.monotonic() - self._start:6.1f}s] {task}: {description}", file=sys.stderr, flush=True)
        if self._p is not None:
            self._p.update(task, description=description, advance=advance)


def run_smoke(opts: SmokeOptions, progress: bool = True) -> SmokeReport:
    """Run the smoke for every engine in ``opts.engines`` and return the verdicts."""
    from shardkit.run.spawn import plan_ranks

    plan = plan_ranks(opts.nproc, opts.device)  # type: ignore[arg-type]  # refuses more ranks than GPUs
    opts = dataclasses.replace(opts, nproc=plan.nproc, device=plan.device)
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if opts.steps < 2:
        raise UsageError(f"--steps must be at least 2 (half before the checkpoint, half after), got {opts.steps}")
    for e in opts.engines:
        if e not in ENGINES:
            raise UsageError(f"--engine {e!r}: choose one of {', '.join(ENGINES)} or all")
    keep = _keep_destinations(opts)
    configs = {e: config_for(e, opts) for e in opts.engines}
    # What this machine cannot run (a TORCH_CUDA_ARCH_LIST DeepSpeed cannot parse, fp16 on a CPU
    # without fp16 ...) stops here with one line and the fix, before op builds and ranks start.
    from shardkit.platform.environment import require_runnable_here

    require_runnable_here({f"{e} ({src})": cfg for e, (cfg, src) in configs.items()}, accelerator=opts.device == "gpu")
    results = []
    with _Progress(progress) as bar:
        op_failure = _prebuild_deepspeed_ops(bar, opts.device) if "zero3" in opts.engines else None
        for engine in opts.engines:
            cfg, source = configs[engine]
            if engine == "zero3" and op_failure:
                # every ZeRO-3 rank would build the op again and fail the same way, minutes later
                results.append(EngineResult(engine=engine, config_source=source, failure=op_failure))
                continue
            results.append(_smoke_engine(engine, cfg, source, opts, bar, keep.get(engine)))
    return SmokeReport(results=results, nproc=opts.nproc, steps=opts.steps)  # type: ignore[arg-type]


def _prebuild_deepspeed_ops(bar: "_Progress", device: str) -> str | None:
    """Build DeepSpeed's ops once, outside the runs' timeouts, rather than inside every rank at once
    (a fresh machine JIT-builds them on first use: minutes on a small CPU box). Returns the one-line
    failure (op, cause, fix) when one did not build, else None."""
    from shardkit.engines.deepspeed import PREBUILT_OPS, op_failure_line, prebuild_ops_in_subprocess
    from shardkit.run.spawn import CPU_RANK_ENV

    task = bar.task("deepspeed ops", total=len(PREBUILT_OPS))

    def on_event(event: dict[str, Any]) -> None:
        op, stage = event["op"], event["stage"]
        if stage == "building":
            bar.update(task, f"building {op} (or loading it from the cache) ...")
        elif stage == "ok":
            bar.update(task, f"built {op} in {event['seconds']} s", advance=1)
        elif stage == "skipped":
            bar.update(task, f"{op} skipped ({event['detail']})", advance=1)
        else:
            bar.update(task, f"FAILED {op}: {event['detail']}", advance=1)

    # the ranks' environment, so the ops of the accelerator the ranks will use are the ones built
    env = {**os.environ, **CPU_RANK_ENV} if device == "cpu" else None
    status, output = prebuild_ops_in_subprocess(on_event, env=env)
    failed = [(name, s) for name, s in status.items() if s.startswith("failed")]
    if not failed:
        bar.update(task, "all ops ready")
        return None
    fd, log = tempfile.mkstemp(prefix="shardkit-op-build-", suffix=".log")
    with os.fdopen(fd, "w") as fh:
        fh.write(output)
    name, first = failed[0]
    more = f"; {len(failed) - 1} more op(s) failed too" if len(failed) > 1 else ""
    bar.update(task, f"FAILED: {', '.join(n for n, _ in failed)}")
    return f"{op_failure_line(name, first)}{more} (build output: {log}); the ZeRO-3 runs were not started"


def _keep_destinations(opts: SmokeOptions) -> dict[str, Path]:
    """Where each engine's checkpoint is kept; refused before anything runs if it would replace files."""
    if not opts.keep_checkpoint:
        return {}
    root = Path(opts.keep_checkpoint)
    dests = {e: root / e for e in opts.engines} if len(opts.engines) > 1 else {opts.engines[0]: root}
    for dest in dests.values():
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise UsageError(f"--keep-checkpoint {root}: {dest} already exists and is not an empty folder; "
                             "smoke never replaces files: pick a new path or remove it")
    return dests


def _smoke_engine(engine: Engine, cfg: dict[str, Any], source: str, opts: SmokeOptions, bar: _Progress,
                  keep: Path | None = None) -> EngineResult:
    result = EngineResult(engine=engine, config_source=source)
    task = bar.task(engine)
    own = opts.workdir is None
    base = Path(tempfile.mkdtemp(prefix=f"shardkit-smoke-{engine}-")) if own else Path(opts.workdir) / engine  # type: ignore[arg-type]
    base.mkdir(parents=True, exist_ok=True)
    ckpt = base / "checkpoint"
    half = opts.steps // 2
    common = dict(engine=engine, config=cfg, model=opts.model, seed=opts.seed, batch=opts.batch, seq_len=opts.seq_len)
    runs = [
        ("A", f"run A: {opts.steps} steps uninterrupted", RunSpec(start=0, stop=opts.steps, checkpoint_root=str(base / "unused"), **common)),
        ("B", f"run B: {half} steps, save", RunSpec(start=0, stop=half, checkpoint_root=str(ckpt), save=True, **common)),
        ("C", f"run C: resume in fresh ranks, {opts.steps - half} steps", RunSpec(start=half, stop=opts.steps, checkpoint_root=str(ckpt), resume=True, **common)),
    ]
    outputs: dict[str, list[dict[str, Any]]] = {}
    try:
        for name, label, spec in runs:
            bar.update(task, label)
            if name == "C" and opts.after_save is not None:
                opts.after_save(ckpt)
            t0 = time.monotonic()
            outputs[name] = _run(spec, opts, base / f"ranks-{name}", name)
            result.seconds[name] = round(time.monotonic() - t0, 2)
            bar.update(task, label, advance=1)
        a, b, c = outputs["A"], outputs["B"], outputs["C"]
        result.device = a[0]["device"]
        result.preflight = c[0]["preflight"]
        result.checkpoint = f"{b[0]['checkpoint']} -> {c[0]['checkpoint']}"
        result.losses_uninterrupted = [r["losses"] for r in a]
        result.losses_resumed = [rb["losses"] + rc["losses"] for rb, rc in zip(b, c)]
        _compare(result)
        bar.update(task, "compared" if result.ok else "FAILED", advance=1)
        if keep is not None and result.ok:
            result.keep_error = keep_checkpoint(ckpt, keep)
            result.kept_checkpoint = None if result.keep_error else str(keep)
    except _RunFailed as exc:
        result.failure = str(exc)
        bar.update(task, "FAILED")
    if own and result.ok and not result.keep_error:
        shutil.rmtree(base, ignore_errors=True)
    return result


def keep_checkpoint(ckpt: Path, keep: Path) -> str | None:
    """Move a passing run's checkpoint to ``keep`` (checked empty before the runs); None when it
    moved, else one line naming ``keep``, the error and where the checkpoint still is. Files that
    appeared in ``keep`` during the run, permissions or a full disk must not turn a passing smoke
    into a traceback."""
    try:
        keep.parent.mkdir(parents=True, exist_ok=True)
        if keep.exists():
            keep.rmdir()  # empty before the runs; OSError if something was put there since
        shutil.move(str(ckpt), str(keep))  # manifest paths are relative: still verifiable there
    except OSError as exc:
        return (f"--keep-checkpoint {keep}: could not move the checkpoint there: {exc}; it was left in "
                f"{ckpt} (move it yourself, or free/fix {keep} and run again)")
    return None


def run_failure(name: str, bad: "list[RankResult]", workdir: Path) -> "_RunFailed":
    """The one line for a run whose ranks failed: the rank that raised (over peers killed while
    waiting for it), its exception in one line, and its log."""
    from shardkit.run.spawn import failure_line

    first = next((r for r in bad if r.error_type), bad[0])
    what = {"A": "uninterrupted run", "B": "run before the checkpoint", "C": "resume"}[name]
    return _RunFailed(f"run {name} ({what}) failed on rank {first.rank}: {failure_line(first)} "
                      f"(log: {workdir / f'rank{first.rank}.log'})")


class _RunFailed(ShardkitError):
    """One of the three runs did not finish; the message is the line the report prints."""


def _run(spec: RunSpec, opts: SmokeOptions, workdir: Path, name: str) -> list[dict[str, Any]]:
    from shardkit.run.spawn import run_ranks

    workdir.mkdir(parents=True, exist_ok=True)
    spec = copy.copy(spec)
    spec.log_dir = str(workdir)
    results = run_ranks(
        rank_run, opts.nproc, args=(spec,), timeout=opts.timeout, device=opts.device, workdir=workdir, raise_on_error=False  # type: ignore[arg-type]
    )
    bad = [r for r in results if not r.ok]
    if not bad:
        return [r.value for r in results]
    raise run_failure(name, bad, workdir)


def _compare(result: EngineResult) -> None:
    a, r = result.losses_uninterrupted, result.losses_resumed
    diffs = [abs(x - y) for ra, rr in zip(a, r) for x, y in zip(ra, rr)]
    result.max_abs_diff = max(diffs) if diffs else None
    result.exact = a == r
    on_gpu = not result.device.startswith("cpu")
    if any(math.isnan(x) for row in a + r for x in row):
        result.failure = "loss is NaN"
    elif result.exact or (on_gpu and all(math.isclose(x, y, rel_tol=GPU_RTOL) for ra, rr in zip(a, r) for x, y in zip(ra, rr))):
        # (close, not exact, only on GPUs: non-deterministic reductions; see GPU_RTOL)
        result.ok = result.preflight == "passed"
        if not result.ok:
            result.failure = (
                f"the placement preflight after resume did not pass (it was {result.preflight!r}); "
                "a resume counts only when every tensor was checked to be on its expected device"
            )
    else:
        step, rank = _first_difference(a, r)
        result.failure = (
            f"resumed loss differs from the uninterrupted run at step {step} on rank {rank}: "
            f"{r[rank][step]!r} vs {a[rank][step]!r} (max |diff| {result.max_abs_diff:.3g}); the checkpoint "
            "did not restore the full training state"
        )


def _first_difference(a: list[list[float]], r: list[list[float]]) -> tuple[int, int]:
    for step in range(min(len(a[0]), len(r[0]))):
        for rank in range(len(a)):
            if a[rank][step] != r[rank][step]:
                return step, rank
    return 0, 0


def print_smoke_report(report: SmokeReport, file: Any = None) -> None:
    """A short table: engine, verdict, exactness, preflight, checkpoint path, time; then failures."""
    from rich.table import Table

    from shardkit.core.render import console

    con = console(file)
    table = Table(title=f"shardkit smoke: {report.nproc} ranks, {report.steps} steps, resume at step {report.steps // 2}")
    for col in ("engine", "result", "resumed vs uninterrupted", "preflight", "checkpoint save -> load", "device", "time"):
        table.add_column(col, overflow="fold")
    for r in report.results:
        verdict = "[green]pass[/]" if r.ok else "[bold red]FAIL[/]"
        if r.max_abs_diff is None:
            match = "-"
        elif r.exact:
            match = "bit-exact"
        else:
            match = f"max |diff| {r.max_abs_diff:.3g}"
        secs = sum(r.seconds.values())
        table.add_row(r.engine, verdict, match, r.preflight, r.checkpoint or "-", r.device or "-", f"{secs:.1f}s")
    con.print(table)
    for r in report.results:
        if r.ok and r.losses_uninterrupted:
            con.print(f"{r.engine}: rank 0 losses {', '.join(f'{x:.6f}' for x in r.losses_uninterrupted[0])} ({r.config_source} config)")
        if r.kept_checkpoint:
            con.print(f"{r.engine}: checkpoint kept in {r.kept_checkpoint} (try: shardkit verify {r.kept_checkpoint})")
        if r.keep_error:
            con.print(f"[yellow]warning[/] {r.engine}: {r.keep_error}")
    for r in report.results:
        if not r.ok:
            con.print(f"[bold red]FAIL[/] {r.engine}: {r.failure}")
    con.print("smoke: [green]all passed[/]" if report.ok else "smoke: [bold red]failed[/]")

