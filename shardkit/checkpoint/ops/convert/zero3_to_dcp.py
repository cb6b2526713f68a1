"""DeepSpeed ZeRO-3 -> a DCP checkpoint shardkit's FSDP2 resume (``load_fsdp_checkpoint``) loads at
any world size, with or without CPU offload, optimizer state included.

What is written is what ``save_fsdp_checkpoint`` writes: ``dcp.save({"model": model_sd, "optim":
optim_sd})`` with the keys ``get_state_dict`` produces (``model.<fqn>``, ``optim.state.<fqn>.
{step,exp_avg,exp_avg_sq}``, ``optim.param_groups.<i>.<key>``) inside ``atomic_checkpoint(engine=
"fsdp2")``. The tensors are plain, unsharded ones written by one process (``no_dist=True``): DCP
records each as one chunk, and ``dcp.load`` into a run's DTensor shards reads just the slice each
rank owns, so any world size loads it (checked at 1 and 3 ranks in tests/test_convert_zero3_to_fsdp.py).

Values: the model state holds the fp32 *masters* (not the bf16/fp16 module weights), bit for bit;
``exp_avg``/``exp_avg_sq`` bit for bit; ``step`` (per ZeRO-3 sub-group) as torch's float32 scalar;
each ZeRO-3 param group becomes one torch param group with its ``lr``/``betas``/``eps``/
``weight_decay`` and ``decoupled_weight_decay`` (DeepSpeed's ``Adam`` is AdamW unless
``adam_w_mode: false``, runtime/engine.py ``_configure_basic_optimizer``).

Speed and memory: nothing imports torch or unpickles a tensor on the usual route
(``zero3_to_dcp_bytes``): the rank files are parsed by ``read_structure``, every big tensor
(masters, moments, frozen parameters, tied aliases) is a ``torch.save`` zip written into its own
``.distcp`` file from the parameter's byte ranges in the rank files, padding left out, copied
through one 1 MiB buffer per writer thread, crc'd and hashed (blake3 by default) as written, fsynced by its writer;
``.metadata`` and the small items' file (``step``, buffers, param-group values) are written by
``dcp_format`` as torch's ``FileSystemWriter`` would. ``workers`` threads write at once; under
``srun``/``torchrun`` every launched process writes its share of the tensor files (balanced by
bytes) into one staging folder, and process 0 writes ``.metadata`` and seals one manifest
(``io.shared_save``); each process hashes its share of the source files on threads beside its
writers, and nothing is published unless every digest matched the source's manifest.
The torch route (``zero3_to_dcp_source`` + ``zero3_to_dcp_write``: ``dcp.save`` with lazy tensors,
one process) stays for what byte ranges cannot express (``dcp_items`` names it, and the result's
notes say so): rank files whose partitions are not one contiguous run of rank 0's dtype (a cast),
a tensor ``step``, a non-contiguous buffer, a param-group value that is not plain data.
``dcp.load``, shardkit's restricted reader and ``dcp.slices`` read both like any DCP checkpoint
(tested). Measured on the 162M benchmark checkpoint (1.95 GB, 2 ranks, bf16): docs/benchmarks.md.

Modules: this one is the entry point and the order of the steps (the shared ones from
``io.pipeline``: verify the source, reuse its tag, check the output folder; staging and sealing by
``atomic_checkpoint``). ``zero3_to_dcp_plan`` decides what the output holds (names, param groups,
what is carried, reported or refused) from the source's metadata; ``zero3_to_dcp_source`` reads
the source (its file names' refusals, its tensors as the lazy state dict); ``zero3_to_dcp_write``
writes the ``.distcp`` files and ``dcp.save``'s ``.metadata`` into the staging folder (torch route);
``zero3_to_dcp_bytes`` (the items as byte ranges, their files), ``dcp_format`` (DCP's formats
without torch) and ``zero3_to_dcp_share`` (one process's share, sealed by process 0) are the
torch-free route.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from shardkit.checkpoint.layout.support import refuse_unsupported
from shardkit.checkpoint.ops.convert.names import MODEL_KEY, OPTIM_KEY, not_carried_lines, refuse_if_any
from shardkit.checkpoint.ops.convert.result import ConvertResult
from shardkit.checkpoint.ops.convert.zero3_to_dcp_bytes import (
    DcpItems,
    dcp_items,
    steps_not_plain,
)
from shardkit.checkpoint.ops.convert.zero3_to_dcp_plan import DcpTarget, plan_dcp_target
from shardkit.checkpoint.ops.convert.zero3_to_dcp_share import ShareResult, source_signatures, write_share
from shardkit.checkpoint.ops.convert.zero3_to_dcp_source import layout_refusals, state_template
from shardkit.checkpoint.ops.convert.zero3_to_dcp_write import write_dcp_files
from shardkit.checkpoint.zero3.checkpoint import Zero3Checkpoint, zero3_optimizer_sd
from shardkit.checkpoint.zero3.files import resolve_tag_dir
from shardkit.checkpoint.zero3.reader import open_zero3_checkpoint
from shardkit.config.loading import config_digest
from shardkit.core.errors import UsageError
from shardkit.platform.versions import library_versions
from shardkit.storage.atomic import os_errors_named
from shardkit.storage.manifest import Manifest
from shardkit.storage.pipeline import (
    check_output_root,
    output_tag,
    verify_before_reading,
    warn_unverified,
)
from shardkit.storage.request import RunRequest, source_of
from shardkit.storage.shared_save import (
    Launch,
    launch_from_env,
    outcome_unchanged,
)
from shardkit.storage.staged_save import atomic_checkpoint
from shardkit.storage.torch_load import read_structure, safe_torch_load
from shardkit.storage.verify import refuse_links_leaving


@os_errors_named("converting the checkpoint")
def convert_zero3_to_dcp(
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
    """Write the ZeRO-3 checkpoint ``source`` (root or tag folder) as a DCP checkpoint under
    ``output/<tag>`` + ``output/latest`` for ``load_fsdp_checkpoint``.

    The source is checked against its manifest (sizes first, digests unless ``verify=False`` while
    the output is written: nothing is published unless it matched); ``output`` follows reshard's
    rules (new, empty or a shardkit checkpoint folder; an existing tag only with ``force``). What cannot be carried is refused (CheckpointError naming
    each item) or listed in ``ConvertResult.not_carried``. ``adam_w_mode`` decides decoupled weight
    decay for a client optimizer the checkpoint does not name (only needed when a group's
    weight_decay is not 0). ``workers``: tensor files written at once by this process (default
    ``default_workers``). ``launch``: this process's share of the files (default: from
    ``srun``/``torchrun``'s variables; one process does everything without them).
    """
    if workers is not None and workers < 1:
        raise UsageError(f"workers={workers}: must be at least 1 (files written at once)")
    launch = launch or launch_from_env()
    warn = warn or warn_unverified
    refuse_unsupported(source, "convert --to fsdp2")  # a layout nothing converts correctly: refused before anything is read
    source_dir, source_tag = resolve_tag_dir(source)
    refuse_if_any(layout_refusals(source_dir), source_dir, "fsdp2")
    tag = output_tag(tag, source, source_dir, source_tag)
    root = Path(output)
    if launch.rank == 0:
        check_output_root(root, tag, source_dir, force=force)
    # sizes now; the digests of the source (this process's share) while the output is written
    checked = verify_before_reading(source_dir, checksums=False)
    # a folder without a manifest is not verified: a link out of it must still never be read
    refuse_links_leaving(source_dir, "convert")
    verified = "none" if checked.manifest is None else ("hash" if verify else "sizes")
    if launch.rank == 0:
        for note in checked.warnings:
            if not (verify and note.startswith("--no-verify")):
                warn(note)
    # the torch-free route first; the torch route writes what byte ranges cannot (dcp_items says why)
    before = source_signatures(source_dir)
    ckpt = open_zero3_checkpoint(source_dir, torch_free=True)
    optim0 = zero3_optimizer_sd(read_structure(ckpt.optim_files[0]), ckpt.optim_files[0])
    why_torch = steps_not_plain(optim0)
    items: DcpItems | None = None
    if why_torch is None:
        plan = plan_dcp_target(ckpt, optim0, adam_w_mode)
        refuse_if_any(plan.uncarried, ckpt.tag_dir, "fsdp2")
        found = dcp_items(ckpt, optim0, plan)
        why_torch, items = (found, None) if isinstance(found, str) else (None, found)
    if why_torch is not None:
        if launch.distributed:
            raise UsageError(f"{ckpt.tag_dir}: this checkpoint needs the torch route ({why_torch}), which runs in one "
                             f"process only; {launch.launcher} started {launch.world}. Run shardkit convert once, "
                             "without srun/torchrun")
        ckpt = open_zero3_checkpoint(source_dir)
        optim0 = safe_torch_load(ckpt.optim_files[0], mmap=True)["optimizer_state_dict"]
        plan = plan_dcp_target(ckpt, optim0, adam_w_mode)
        refuse_if_any(plan.uncarried, ckpt.tag_dir, "fsdp2")
        plan.notes.append(f"written through torch (one process, slower, more memory): {why_torch}")

    extra = {"format": "torch.distributed.checkpoint", "keys": [MODEL_KEY, OPTIM_KEY], "user": plan.user,
             "converted_from": {"engine": "deepspeed", "zero_stage": 3, "path": str(ckpt.tag_dir),
                                "world_size": ckpt.world_size, "ds_version": ckpt.ds_version,
                                "precision": ckpt.precision, "verified": verified,
                                # the prefix removed from every name: --to zero3 puts it back
                                "name_prefix": plan.names.prefix,
                                # which model keys are buffers: a frozen parameter written by one
                                # process looks like a buffer otherwise (--to zero3 reads this)
                                "buffer_names": [plan.names.fsdp_name(b) for b in ckpt.buffers()],
                                **plan.deepspeed}}
    # world_size=1: one process wrote it (one chunk per tensor); loading at N ranks is a reshard
    facts = Manifest(engine="fsdp2", tag=tag, world_size=1, step=ckpt.model_state.get("global_steps"),
                     dtype="float32", versions=library_versions(), config_digest=config_digest(ckpt.ds_config or None),
                     extra=extra)
    expected = {e.path: e for e in checked.manifest.files} if checked.manifest is not None and verify else {}
    share = ShareResult()
    if items is not None:
        # what every process must agree on before anything is written (io.shared_meet)
        request = RunRequest("convert --to fsdp2", source_of(source_dir), str(root.resolve()), tag,
                             {"--no-verify": not verify,
                              "--adam-w-mode": {None: None, True: "on", False: "off"}[adam_w_mode]})
        share = write_share(root, tag, items, facts, expected, before, workers, launch, request)
    else:
        if expected:
            # one file per core: blake3 and hashlib release the GIL; more threads would only add read buffers
            verify_before_reading(source_dir, checksums=True, workers=len(os.sched_getaffinity(0)))
        _write_through_torch(root, tag, ckpt, plan, facts, workers)
    final = root / tag
    return ConvertResult(
        output=root, tag=tag, source_engine="zero3", target_engine="fsdp2", world_size=ckpt.world_size,
        source_world_size=ckpt.world_size, params=len(ckpt.slots) + len(ckpt.frozen_param_shapes),
        bytes=sum(f.stat().st_size for f in final.iterdir() if f.is_file()) if launch.rank == 0 else share.bytes,
        carried=plan.carried, not_carried=not_carried_lines(plan.uncarried), notes=plan.notes,
        verified=verified, route="torch" if items is None else "bytes", rank=launch.rank, processes=launch.world,
        share_files=share.files, share_bytes=share.bytes, workers=share.workers, launcher=launch.launcher,
    )


def _write_through_torch(root: Path, tag: str, ckpt: Zero3Checkpoint, plan: DcpTarget, facts: Manifest,
                         workers: int | None) -> None:
    """The torch route (one process): ``dcp.save`` of the lazy state dict in ``atomic_checkpoint``."""
    outcome = outcome_unchanged(root)
    with ExitStack() as stack:
        parts = [stack.enter_context(ckpt.open_rank(r)) for r in range(ckpt.world_size)]
        state, lazy = state_template(ckpt, plan, parts)
        with atomic_checkpoint(root, tag, engine="fsdp2", world_size=1, step=facts.step, dtype="float32",
                               config_digest=facts.config_digest, extra=facts.extra) as save:
            save.known_files = write_dcp_files(save.path, state, lazy, outcome, workers)
