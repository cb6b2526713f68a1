"""What the commands that move checkpoint bytes (reshard, convert, consolidate, export) share at the
CLI: the ``--dry-run`` plan (what would be read, where it would be written and through which staging
place, by how many processes) and the byte progress display around the real run.

A dry run is the real command stopped where it would first write (``run_checks``,
``storage.dry_run``): every check the run makes before writing (the source's layout and manifest, the
model config, the output path, ``--force``) is made by the run's own code, with the same exit code and
message, and nothing is created or removed. The plan itself then reads directory listings and the
``latest`` pointer only.
"""

from __future__ import annotations

import argparse
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator


def source_tag_dir(path: str | Path) -> tuple[Path, str]:
    """The folder whose files an operation reads: a Trainer output_dir's newest checkpoint-N, a root's
    ``latest`` tag, a tag folder itself, or a rank file's folder; and that folder's tag."""
    from shardkit.checkpoint.hf_trainer.folder import resolve_source
    from shardkit.core.errors import CheckpointError
    from shardkit.storage.tags import latest_tag

    p = resolve_source(path, lambda _note: None)
    if not p.exists():
        raise CheckpointError(f"{p}: checkpoint path does not exist; pass the checkpoint folder (the one holding "
                              "'latest') or one tag folder")
    if p.is_file():
        p = p.parent
    tag = latest_tag(p)
    if tag is not None and (p / tag).is_dir():
        return p / tag, tag
    return p, p.name


def listing(folder: Path) -> tuple[int, int]:
    """(files, bytes) of the regular files under ``folder`` (a Trainer checkpoint-N's tag folder included)."""
    files = size = 0
    for dirpath, _dirs, names in os.walk(folder):
        for name in names:
            try:
                st = os.stat(os.path.join(dirpath, name), follow_symlinks=False)
            except OSError:
                continue
            files, size = files + 1, size + st.st_size
    return files, size


def launch_summary() -> dict[str, Any]:
    """How many processes would share the work (srun/torchrun variables, else one)."""
    from shardkit.storage.shared_save import launch_from_env

    launch = launch_from_env()
    return {"processes": launch.world, "launcher": launch.launcher, "rank": launch.rank}


def run_checks(args: argparse.Namespace, command: Callable[[argparse.Namespace], int]) -> None:
    """--dry-run: ``command`` run as without --dry-run (no JSON, no progress display) up to its first
    write, so the dry run refuses exactly what the run refuses; nothing is written."""
    from shardkit.storage.dry_run import checks_only

    real = argparse.Namespace(**{**vars(args), "dry_run": False, "json": False, "json_file": None, "quiet": True})
    with checks_only(args.command):
        command(real)


def plan_of(command: str, source: str, output: Path, staging: str, workers: int | None,
            **extra: Any) -> dict[str, Any]:
    """The --dry-run plan as plain data (the JSON result, and what ``print_plan`` says)."""
    tag_dir, tag = source_tag_dir(source)
    files, size = listing(tag_dir)
    return {"command": command, "dry_run": True, "ok": True, "source": source, "source_tag_dir": str(tag_dir),
            "source_tag": tag, "read": {"files": files, "bytes": size}, "output": str(output), "staging": staging,
            **launch_summary(), "workers": workers, "wrote": None, **extra}


def print_plan(plan: dict[str, Any]) -> None:
    from shardkit.core.progress import format_bytes

    share = f"{plan['processes']} processes ({plan['launcher']})" if plan["processes"] > 1 else "1 process"
    workers = plan["workers"] if plan["workers"] is not None else "default (one per file, at most max(cores, 8))"
    print(f"dry run: shardkit {plan['command']} would read {plan['read']['files']} files "
          f"({format_bytes(plan['read']['bytes'])}) from {plan['source_tag_dir']}")
    print(f"  write {plan['output']}, assembled in {plan['staging']} and renamed into place when complete")
    print(f"  by {share}; writer threads per process: {workers}")
    for key in ("world_size", "to", "dtype"):
        if plan.get(key) is not None:
            print(f"  {key.replace('_', ' ')}: {plan[key]}")
    print("  nothing was written (--dry-run)")


def tag_of(args: argparse.Namespace, source: str) -> str:
    """The tag the output gets: --tag, else the source's."""
    return args.tag or source_tag_dir(source)[1]


@contextmanager
def byte_progress(args: argparse.Namespace, command: str) -> Iterator[None]:
    """Bytes written, rate and time left on stderr while the block runs (shardkit.core.progress);
    under srun/torchrun only rank 0 shows it, for the whole job."""
    from shardkit.core.progress import reporting

    launch = launch_summary()
    with reporting(f"shardkit {command}", quiet=getattr(args, "quiet", False), rank=launch["rank"],
                   processes=launch["processes"]):
        yield


def result_base(command: str, source: str, seconds: float, **extra: Any) -> dict[str, Any]:
    """The fields every byte-moving command's JSON result starts with."""
    tag_dir, _tag = source_tag_dir(source)
    files, size = listing(tag_dir)
    return {"command": command, "dry_run": False, "ok": True, "source": source, "source_tag_dir": str(tag_dir),
            "read": {"files": files, "bytes": size}, "seconds": seconds, **extra}
