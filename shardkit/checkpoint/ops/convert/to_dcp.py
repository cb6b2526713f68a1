"""Any checkpoint whose reader describes the optimizer -> a DCP checkpoint shardkit's FSDP2 resume
(``load_fsdp_checkpoint``) loads at any world size, with or without CPU offload, optimizer state
included: ``convert_to_dcp`` is the registry's reader (``readers.registry.read_checkpoint``), the
plan (``to_dcp_plan``: names, param groups, what is carried, reported or refused) and the DCP
writer (``writers.dcp`` + ``writers.dcp_files``), between the steps every operation shares
(``storage.pipeline``: verify the source, reuse its tag, check the output folder; staging and
sealing by ``storage.shared_tag``).

What is written is what ``save_fsdp_checkpoint`` writes (``writers.dcp``). Values: the model state
holds the fp32 *masters* where the source keeps them (not the bf16/fp16 module weights), bit for
bit; ``exp_avg``/``exp_avg_sq`` bit for bit; ``step`` per parameter as torch's float32 scalar;
each source param group becomes one torch param group with its ``lr``/``betas``/``eps``/
``weight_decay`` and ``decoupled_weight_decay`` (DeepSpeed's ``Adam`` is AdamW unless
``adam_w_mode: false``, runtime/engine.py ``_configure_basic_optimizer``).

Speed and memory: nothing imports torch or unpickles a tensor where the reader describes every
tensor as byte ranges (ZeRO-3: always): each big tensor is copied from its pieces in the source
files into its own ``.distcp`` file through one 1 MiB buffer per writer thread, crc'd and hashed
(blake3 by default) as written, fsynced by its writer. ``workers`` threads write at once; under
``srun``/``torchrun`` every launched process writes its share of the tensor files (balanced by
bytes) into one staging folder, process 0 writes ``.metadata`` and seals one manifest; each
process hashes its share of the source files on threads beside its writers, and nothing is
published unless every digest matched the source's manifest. Measured on the 162M benchmark
checkpoint (1.95 GB, 2 ranks, bf16): docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from shardkit.checkpoint.layout.support import refuse_unsupported
from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.ops.convert.arguments import check_workers
from shardkit.checkpoint.ops.convert.names import not_carried_lines, refuse_if_any
from shardkit.checkpoint.ops.convert.result import ConvertResult
from shardkit.checkpoint.ops.convert.single_source import refuse_weights_only
from shardkit.checkpoint.ops.convert.to_dcp_plan import DcpTarget, plan_dcp_target
from shardkit.checkpoint.ops.export.sources import resolve_source
from shardkit.checkpoint.readers.registry import read_checkpoint
from shardkit.checkpoint.writers.dcp import MODEL_KEY, OPTIM_KEY, dcp_items
from shardkit.checkpoint.writers.dcp_files import ShareResult, source_files, write_dcp
from shardkit.config.loading import config_digest
from shardkit.core.errors import UsageError
from shardkit.platform.versions import library_versions
from shardkit.storage.atomic import os_errors_named
from shardkit.storage.listing import lists_source_once
from shardkit.storage.manifest import Manifest
from shardkit.storage.pipeline import (
    check_output_root,
    check_source,
    output_tag,
    warn_unverified,
)
from shardkit.storage.request import RunRequest, source_of
from shardkit.storage.shared_save import Launch, launch_from_env
from shardkit.storage.shared_tag import signatures
from shardkit.storage.verify import refuse_links_leaving


@os_errors_named("converting the checkpoint")
@lists_source_once("source", "output")  # each step asking what the source holds: one listing of its folders
def convert_to_dcp(
    source: str | Path,
    output: str | Path,
    *,
    tag: str | None = None,
    force: bool = False,
    verify: bool = True,
    warn: Callable[[str], None] | None = None,
    adam_w_mode: bool | None = None,
    workers: int | None = None,
    launch: Launch | None = None,
) -> ConvertResult:
    """Write the checkpoint ``source`` (any kind the readers registry reads with its optimizer state:
    a root, tag or Trainer folder) as a DCP checkpoint under ``output/<tag>`` + ``output/latest`` for
    ``load_fsdp_checkpoint``.

    The source is checked against its manifest (sizes first, digests unless ``verify=False`` while
    the output is written: nothing is published unless it matched); ``output`` follows reshard's
    rules (new, empty or a shardkit checkpoint folder; an existing tag only with ``force``). What
    cannot be carried is refused (CheckpointError naming each item) or listed in
    ``ConvertResult.not_carried``. ``adam_w_mode`` decides decoupled weight decay for a client
    optimizer the checkpoint does not name (only needed when a group's weight_decay is not 0).
    ``workers``: tensor files written at once by this process (default ``default_workers``).
    ``launch``: this process's share of the files (default: from ``srun``/``torchrun``'s variables;
    one process does everything without them).
    """
    check_workers(workers)
    launch = launch or launch_from_env()
    warn = warn or warn_unverified
    refuse_unsupported(source, "convert --to fsdp2")  # a layout nothing converts correctly: refused before anything is read
    found = resolve_source(source)
    if found.kind == "dcp":  # the same format: a rewrite would change nothing a resume needs
        raise UsageError(f"{found.tag_dir}: is an FSDP2/DCP checkpoint already; FSDP2 loads it at any world size as it "
                         "is (load_fsdp_checkpoint), so there is nothing to convert. For DeepSpeed: --to zero3 "
                         "(or zero2/zero1) --world-size N")
    source_dir = found.tag_dir
    tag = output_tag(tag, source, source_dir, source_dir.name)
    root = Path(output)
    if launch.rank == 0:
        check_output_root(root, tag, source_dir, force=force)
    # sizes now; the digests of the source (this process's share) while the output is written
    checked = check_source(source_dir, verify=verify, hash_now=False)  # also refuses a link out of it, manifest or not
    verified, expected = checked.level, checked.owed
    for note in checked.warnings if launch.rank == 0 else []:
        warn(note)
    ckpt = read_checkpoint(found.kind, source_dir)
    files = source_files(ckpt)
    outside = sorted({f.parent for f in files if source_dir.resolve() not in f.resolve().parents})
    if outside:  # a reader reading beside the folder it was given (accelerate's optimizer_0/): no link out of those either
        refuse_links_leaving(found.folder, "convert")
    # the files whose bytes are copied, as they are now: one rewritten during the copy fails the run
    before = signatures(files)
    refuse_weights_only(ckpt, found, "fsdp2", "so an FSDP2 resume would start Adam from zero")
    ckpt.refuse_uncovered()  # before the staging folder exists (the writer's own check meets it mid-write)
    plan = plan_dcp_target(ckpt, adam_w_mode)
    refuse_if_any(plan.uncarried, source_dir, "fsdp2")
    items = dcp_items(ckpt, plan.layout)
    loaded = [t.name for t in [*ckpt.weights.values(), *(s for st in ckpt.optimizer.values() for s in st.values())]
              if t.load is not None]
    if loaded:
        plan.notes.append(f"read through torch, one tensor at a time (the reader found no byte ranges for them): "
                          f"{', '.join(sorted(set(loaded))[:5])}{' ...' if len(set(loaded)) > 5 else ''}")
    facts = _manifest_facts(ckpt, plan, tag, verified)
    # what every process must agree on before anything is written (storage.shared_meet)
    request = RunRequest("convert --to fsdp2", source_of(source_dir), str(root.resolve()), tag,
                         {"--no-verify": not verify,
                          "--adam-w-mode": {None: None, True: "on", False: "off"}[adam_w_mode]})
    share: ShareResult = write_dcp(root, tag, items, facts, source_dir, expected, before, workers, launch, request)
    final = root / tag
    world = ckpt.world_size or 1
    return ConvertResult(
        output=root, tag=tag, source_engine=ckpt.format, target_engine="fsdp2", world_size=world,
        source_world_size=world, params=len(ckpt.trainable) + len(ckpt.frozen),
        bytes=sum(f.stat().st_size for f in final.iterdir() if f.is_file()) if launch.rank == 0 else share.bytes,
        carried=plan.carried, not_carried=not_carried_lines(plan.uncarried), notes=[*found.notes, *plan.notes],
        verified=verified, route="torch" if loaded else "bytes", rank=launch.rank, processes=launch.world,
        share_files=share.files, share_bytes=share.bytes, workers=share.workers, launcher=launch.launcher,
    )


def _manifest_facts(ckpt: TrainingCheckpoint, plan: DcpTarget, tag: str, verified: str) -> Manifest:
    """The output's manifest: one process wrote it (world_size 1: one chunk per tensor; loading at N
    ranks is a reshard), and where it came from (``extra.converted_from``, which --to zero3 reads)."""
    origin = dict(ckpt.scalars.get("source") or {})
    ds_config = origin.pop("ds_config", None)
    extra = {"format": "torch.distributed.checkpoint", "keys": [MODEL_KEY, OPTIM_KEY], "user": plan.user,
             "converted_from": {"engine": origin.get("engine", ckpt.format), "zero_stage": origin.get("zero_stage"),
                                "path": str(ckpt.folder), "world_size": ckpt.world_size,
                                "ds_version": origin.get("ds_version"), "precision": ckpt.precision,
                                "verified": verified,
                                # the prefix removed from every name: --to zero3 puts it back
                                "name_prefix": plan.names.prefix,
                                # which model keys are buffers: a frozen parameter written by one
                                # process looks like a buffer otherwise (--to zero3 reads this)
                                "buffer_names": [plan.names.fsdp_name(b) for b in ckpt.weights if b in ckpt.buffers],
                                **plan.deepspeed}}
    step = (ckpt.scalars.get("counters") or {}).get("global_steps")
    return Manifest(engine="fsdp2", tag=tag, world_size=1, step=step, dtype="float32", versions=library_versions(),
                    config_digest=config_digest(ds_config or None), extra=extra)
