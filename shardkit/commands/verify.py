"""`shardkit verify CKPT`: check a checkpoint against its manifest (sizes, digests, rank files,
world size, engine) before a resume trusts it; a plain save without a manifest (DeepSpeed, DCP, a
Trainer or Accelerate folder) gets the structural check of ``ops.verify_structure`` instead."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from shardkit.commands._parser import Stopwatch, add_command, add_engine, add_json, add_no_verify, add_world_size

if TYPE_CHECKING:
    from shardkit.core.findings import Report


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "verify",
        help="check a checkpoint's files against its shardkit manifest",
        example="shardkit verify checkpoints/ --world-size 8",
        description=(
            "Check a checkpoint written by shardkit: every file present with its recorded size and digest (blake3, or sha256 in older manifests), "
            "every rank file the world size needs, and (when given) the engine and world size of the run "
            "that will resume it. CKPT is the root holding 'latest' or one tag directory; a Hugging Face Trainer "
            "checkpoint-N folder is such a root, and a Trainer output_dir is checked at its newest checkpoint-N. "
            "A checkpoint without a shardkit manifest (a plain DeepSpeed ZeRO-1/2/3 or universal save, an FSDP2/DCP "
            "folder, an Accelerate FSDP1 folder) gets a structural check: every rank file present, every torch zip "
            "and DCP byte range inside its file, the pickles parsed through the allow-list, ranks agreeing, every "
            "tensor covered (no tensor bytes read; no digests exist to compare). "
            "Exit 0: resumable; 1: problems found; 2: usage error."
        ),
    )
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint root (with 'latest') or a tag directory")
    add_world_size(p, "world size of the run that will resume")
    add_engine(p, ["zero3", "fsdp2", "torch"], "engine of the run that will resume (zero3: a DeepSpeed checkpoint, any ZeRO stage; "
               "'deepspeed' is the old spelling)")
    add_no_verify(p, "check sizes only, skip the content digests (fast)", no_checksum_alias=True)
    p.add_argument("--write-manifest", action="store_true",
                   help="for a plain save without a shardkit manifest that passes the structural check: hash every "
                        "file once and write shardkit_manifest.json into its tag (or DCP) folder, so later verifies "
                        "compare digests")
    add_json(p)
    p.set_defaults(func=run)


#: What the manifest check says when there is no manifest to check: the structural check runs instead.
_NO_MANIFEST = frozenset({"ckpt.manifest.missing", "ckpt.trainer.no_deepspeed", "ckpt.none_complete"})


def run(args: argparse.Namespace) -> int:
    from shardkit.checkpoint.hf_trainer.folder import verify_trainer_checkpoint
    from shardkit.commands._parser import emit_json
    from shardkit.core.errors import UsageError
    from shardkit.core.render import print_report
    from shardkit.storage.verify import verify_checkpoint

    if args.world_size is not None and args.world_size < 1:
        raise UsageError(f"--world-size must be at least 1, got {args.world_size}")
    clock = Stopwatch()
    # the manifests name a ZeRO-3 checkpoint's engine 'deepspeed'
    engine = "deepspeed" if args.engine == "zero3" else args.engine
    kw = dict(world_size=args.world_size, engine=engine, checksums=not args.no_verify)
    # a Trainer checkpoint-N or output_dir (None: not Trainer-shaped, the plain rules apply)
    report = verify_trainer_checkpoint(args.checkpoint, **kw) or verify_checkpoint(args.checkpoint, **kw)
    if report.manifest is None and any(f.rule in _NO_MANIFEST for f in report.errors):
        code = _run_plain(args, engine, clock, report)
        if code is not None:
            return code
    if args.write_manifest and report.manifest is not None:
        raise UsageError(f"--write-manifest: {report.tag_dir}/shardkit_manifest.json exists already; verify checks "
                         "against it without the flag")
    if args.write_manifest:
        # no manifest, and no reader knows the folder: nothing to write one for (the findings say what it holds)
        why = "; ".join(f.message for f in report.errors[:2]) or "no checkpoint found"
        raise UsageError(f"--write-manifest: {args.checkpoint} is no checkpoint shardkit reads ({why}), so no manifest "
                         "was written. Pass a checkpoint root, tag folder, DCP folder or Trainer checkpoint-N "
                         "(`shardkit inspect PATH` says what a folder is)")
    if args.json or args.json_file:
        files = report.manifest.files if report.manifest is not None else []
        emit_json(args, {**report.to_dict(), "command": "verify", "files": len(files),
                         "bytes": sum(f.size for f in files),
                         "checked": "sizes only" if args.no_verify else "sizes and content digests",
                         "seconds": clock.seconds})
    if not args.json:
        print_report(report)
        if report.ok and report.manifest is not None:
            m = report.manifest
            print(f"resumable: {report.tag_dir} (engine {m.engine}, world size {m.world_size}, step {m.step}, "
                  f"{len(m.files)} files)")
    return report.exit_code


def _run_plain(args: argparse.Namespace, engine: str | None, clock: Stopwatch, manifest_report: Report) -> int | None:
    """The structural check of a checkpoint without a manifest (and, on request, its manifest written);
    None when it is no checkpoint a reader knows: the manifest check's own words then say what is missing
    (a Trainer checkpoint-N without its DeepSpeed save, a root with only interrupted saves; for a folder
    with no complete checkpoint the readers' reason is added: tags without 'latest', what the folder holds).
    The manifest check's findings that hold without a manifest (the Trainer's newest checkpoint, its RNG
    files) are carried over."""
    from shardkit.checkpoint.ops.verify_manifest import write_plain_manifest
    from shardkit.checkpoint.ops.verify_structure import NO_DIGESTS, verify_structure
    from shardkit.commands._parser import emit_json
    from shardkit.core.render import print_report

    report = verify_structure(args.checkpoint, world_size=args.world_size, engine=engine)
    if report.kind is None:
        if any(f.rule == "ckpt.none_complete" for f in manifest_report.errors):
            manifest_report.extend(report.errors)
        return None
    report.extend(f for f in manifest_report.findings if f.rule not in _NO_MANIFEST)
    if args.no_verify:
        import sys

        print("note: --no-verify changes nothing here: a checkpoint without a manifest has no digests to skip, and "
              "the structural check reads no tensor bytes", file=sys.stderr)
    written = write_plain_manifest(report) if args.write_manifest and report.ok else None
    links_nowhere = any(f.rule == "ckpt.link.nowhere" for f in report.findings)  # --write-manifest refuses them
    manifest_note = (f"wrote {report.tensor_folder}/shardkit_manifest.json ({len(written.files)} files hashed): later "
                     "verifies compare digests" if written is not None else None)
    if args.json or args.json_file:
        emit_json(args, {**report.to_dict(), "command": "verify", "manifest_written": written is not None,
                         "checked": "structure only (no manifest)", "seconds": clock.seconds})
    if not args.json:
        print_report(report)
        if report.ok:
            step = report.step if report.step is not None else "not recorded"
            world = report.world_size if report.world_size is not None else "not recorded"
            print(f"whole as far as its structure tells: {report.path} ({report.layout or report.kind}, world size "
                  f"{world}, step {step}, {report.files} files, {report.tensors} tensors covered)")
        hint = (f"; `shardkit verify {args.checkpoint} --write-manifest` hashes the files once so later verifies "
                "compare digests" if report.ok and not manifest_note and not links_nowhere else "")
        print(f"{NO_DIGESTS}{hint}.")
        if manifest_note:
            print(manifest_note)
        elif args.write_manifest:
            print("--write-manifest: no manifest was written: the checkpoint is not whole (the errors above), and a "
                  "manifest would vouch for it; fix them, then run it again")
    return report.exit_code
