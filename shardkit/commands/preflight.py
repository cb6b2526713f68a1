"""`shardkit preflight CONFIG`: static checks, then a real multi-rank placement preflight and one step."""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from typing import Iterator

from shardkit.commands._parser import MODEL_SPEC_HELP, add_command, add_json, add_world_size, alias_action


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "preflight",
        help="check that every rank's tensors sit on the device CONFIG implies, before the first step",
        example="shardkit preflight ds_config.json --world-size 2 --json-file placement.json",
        description=(
            "Runs the static config checks (stops on errors; --static stops there), then spawns N ranks that "
            "build the model, initialize DeepSpeed or FSDP2 from CONFIG, run the placement preflight "
            "(parameters, ZeRO partitions, fp32 masters, gradients, optimizer state vs. the devices the config "
            "implies; versions, config digest and parameter set across ranks) and one training step. "
            "With --observed SNAPSHOT, judges a recorded run offline instead (every tensor gets an expectation or is "
            "listed as not checked); --record FILE writes such a snapshot from the live ranks. "
            "Exit 0 clean, 1 findings, 2 usage error."
        ),
    )
    p.add_argument("config", nargs="?", default=None,
                   help="DeepSpeed config (JSON/YAML) or shardkit FSDP2 config (top-level \"fsdp\" key)")
    p.add_argument("--observed", default=None, metavar="SNAPSHOT",
                   help="judge a recorded snapshot (--record output, or tests/data/gpu_truth/*.json) offline: no ranks; "
                   "expectations from --config/CONFIG, else the snapshot's own spec")
    p.add_argument("--config", dest="config_opt", default=None, metavar="CFG",
                   help="with --observed: the config to judge the snapshot against (same as the CONFIG argument)")
    p.add_argument("--record", default=None, metavar="FILE",
                   help="each rank writes where every tensor is after init and after the step (rank N>0: FILE.rankN.json), "
                   "in the ground-truth format --observed reads")
    add_world_size(p, "ranks to spawn (default: visible GPUs, else 2 CPU ranks with gloo)", nproc_alias=True)
    p.add_argument(
        "--device", choices=["auto", "cpu", "gpu"], default="auto",
        help="auto: one rank per visible GPU (nccl), CPU ranks (gloo) without GPUs; cpu: gloo ranks that never touch "
        "a GPU (any --world-size); gpu: GPUs only. More ranks than visible GPUs is refused unless --device cpu",
    )
    p.add_argument("--model", default=None, metavar="SPEC", help=f"{MODEL_SPEC_HELP} (default: llama:tiny)")
    p.add_argument("--static", action="store_true", help="only the static config checks; spawn nothing")
    add_json(p, file_after_json=True)
    p.add_argument("--rank-wait", type=float, default=60.0, metavar="S",
                   help="seconds to wait for a late rank at the preflight (default: 60)")
    p.add_argument("--timeout", dest="rank_wait", type=float, metavar="S", action=alias_action("--rank-wait"),
                   help="old spelling of --rank-wait (a late rank's wait, not a limit on the run)")
    p.set_defaults(func=preflight_command)


def preflight_command(args: argparse.Namespace) -> int:
    from shardkit.core.errors import UsageError
    from shardkit.placement.snapshot import check_record_target
    from shardkit.run.preflight import PreflightOptions, run_preflight

    if args.config and args.config_opt and args.config != args.config_opt:
        raise UsageError(f"two configs given ({args.config} and --config {args.config_opt}): pass one")
    config = args.config or args.config_opt
    if args.observed:
        live_only = [flag for flag, given in (("--world-size", args.world_size is not None), ("--device", args.device != "auto"),
                                              ("--record", args.record), ("--static", args.static), ("--model", args.model))
                     if given]
        if live_only:
            raise UsageError(f"--observed judges a recording offline: {', '.join(live_only)} would be ignored; "
                             "drop them, or run the live preflight without --observed")
        return observed_command(args, config)
    if not config:
        raise UsageError("preflight needs CONFIG (a DeepSpeed or FSDP2 config), or --observed SNAPSHOT to judge a recording")
    if args.record:
        check_record_target(args.record)  # before any rank starts: never replace a config or a checkpoint
    with _placement_json(args) as json_path:
        code = run_preflight(
            PreflightOptions(
                config=config,
                nproc=args.world_size,
                device=args.device,
                model=args.model,
                static=args.static,
                json_path=json_path,
                record_path=args.record,
                timeout=args.rank_wait,
            )
        )
    if (args.json or args.json_file) and not getattr(args, "json_emitted", False):
        # no rank wrote a placement report (--static, or the static checks stopped the run)
        from shardkit.commands._parser import emit_json

        emit_json(args, {"command": "preflight", "ok": code == 0, "exit_code": code, "static_only": args.static,
                         "placement": None})
    return code


@contextmanager
def _placement_json(args: argparse.Namespace) -> Iterator[str | None]:
    """The ranks write the placement report to a file; with --json it is read back and printed alone on
    stdout (also when ranks died: the failure record), with --json-file it is that file."""
    import tempfile
    from pathlib import Path

    from shardkit.commands._parser import emit_json

    if not args.json:
        before = _stamp(args.json_file)
        try:
            yield args.json_file
        finally:
            # the ranks wrote it, or the failure record when they died: never replaced by a shorter one
            args.json_emitted = _stamp(args.json_file) not in (None, before)
        return
    with tempfile.TemporaryDirectory(prefix="shardkit-preflight-json-") as tmp:
        path = Path(tmp) / "placement.json"
        try:
            yield str(path)
        finally:
            if path.is_file():
                emit_json(args, json.loads(path.read_text()))


def _stamp(path: str | None) -> tuple[int, int] | None:
    import os

    try:
        st = os.stat(path) if path else None
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_ino) if st is not None else None


def observed_command(args: argparse.Namespace, config: str | None) -> int:
    """``--observed``: judge a recording; exit 0 and one summary line when healthy, 1 and the table when not."""
    from shardkit.commands._parser import emit_json
    from shardkit.placement.observed import judge_snapshot_file

    report = judge_snapshot_file(args.observed, config)
    if args.json or args.json_file:
        emit_json(args, report.to_dict())
    if not args.json:
        print(report.render() if not report.ok or report.not_checked else report.summary())
    return report.exit_code
