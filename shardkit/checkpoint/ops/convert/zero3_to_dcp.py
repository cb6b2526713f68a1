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

Speed and memory: torch's writer ``torch.save``s every tensor from memory, so each would first be
gathered from the rank partitions. Here every big tensor (masters, moments, frozen parameters, tied
aliases) is written by ``stream.stream_save`` into its own ``.distcp`` file as a ``_ShapedLazyTensor``
whose record is the parameter's byte ranges in the rank optim files, padding left out: copied
through one 1 MiB buffer per thread, crc'd for the zip and sha256'd for the manifest as written,
fsynced by the thread that wrote it, several files at once (``_TensorFiles``: ``stream.write_parallel``
started before ``dcp.save``, so its ~0.9 s import overlaps the copying). ``dcp.save`` still plans and writes
``.metadata`` (``FileSystemWriter.finish``); ``_streaming_writer`` only answers each tensor item
with its file (offset 0, whole file) and writes the small items (param-group values, ``step``,
buffers) with torch's own ``_write_item``. ``dcp.load``, shardkit's restricted reader and
``dcp.slices`` read the result like any DCP checkpoint (tested). Measured on the 162M benchmark
checkpoint (1.95 GB, 2 ranks, bf16): see the README's convert section.

Modules: this one is the entry point and the order of the steps (the shared ones from
``io.pipeline``: verify the source, reuse its tag, check the output folder; staging and sealing by
``atomic_checkpoint``). ``zero3_to_dcp_plan`` decides what the output holds (names, param groups,
what is carried, reported or refused) from the source's metadata; ``zero3_to_dcp_source`` reads
the source (its file names' refusals, its tensors as the lazy state dict); ``zero3_to_dcp_write``
writes the ``.distcp`` files and ``dcp.save``'s ``.metadata`` into the staging folder.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from shardkit.checkpoint.io.atomic import os_errors_named
from shardkit.checkpoint.io.pipeline import (
    check_output_root,
    output_tag,
    verify_before_reading,
    warn_unverified,
)
from shardkit.checkpoint.io.staged_save import atomic_checkpoint
from shardkit.checkpoint.io.tags import LATEST_NAME
from shardkit.checkpoint.io.torch_load import safe_torch_load
from shardkit.checkpoint.io.verify import refuse_links_leaving
from shardkit.checkpoint.ops.convert.names import MODEL_KEY, OPTIM_KEY, not_carried_lines, refuse_if_any
from shardkit.checkpoint.ops.convert.result import ConvertResult
from shardkit.checkpoint.ops.convert.zero3_to_dcp_plan import plan_dcp_target
from shardkit.checkpoint.ops.convert.zero3_to_dcp_source import layout_refusals, state_template
from shardkit.checkpoint.ops.convert.zero3_to_dcp_write import write_dcp_files
from shardkit.checkpoint.zero3.files import resolve_tag_dir
from shardkit.checkpoint.zero3.reader import open_zero3_checkpoint
from shardkit.config.loading import config_digest
from shardkit.core.errors import UsageError


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
) -> ConvertResult:
    """Write the ZeRO-3 checkpoint ``source`` (root or tag folder) as a DCP checkpoint under
    ``output/<tag>`` + ``output/latest`` for ``load_fsdp_checkpoint``.

    The source is checked against its manifest first (sha256 unless ``verify=False``); ``output``
    follows reshard's rules (new, empty or a shardkit checkpoint folder; an existing tag only with
    ``force``). What cannot be carried is refused (CheckpointError naming each item) or listed in
    ``ConvertResult.not_carried``. ``adam_w_mode`` decides decoupled weight decay for a client
    optimizer the checkpoint does not name (only needed when a group's weight_decay is not 0).
    ``workers``: tensor files written at once (default ``default_workers``).
    """
    if workers is not None and workers < 1:
        raise UsageError(f"workers={workers}: must be at least 1 (files written at once)")
    warn = warn or warn_unverified
    source_dir, source_tag = resolve_tag_dir(source)
    refuse_if_any(layout_refusals(source_dir), source_dir, "fsdp2")
    tag = output_tag(tag, source, source_dir, source_tag)
    root = Path(output)
    check_output_root(root, tag, source_dir, force=force)
    checked = verify_before_reading(source_dir, checksums=verify)
    # a folder without a manifest is not verified: a link out of it must still never be read
    refuse_links_leaving(source_dir, "convert")
    for note in checked.warnings:
        warn(note)
    ckpt = open_zero3_checkpoint(source_dir)
    optim0 = safe_torch_load(ckpt.optim_files[0], mmap=True)["optimizer_state_dict"]
    plan = plan_dcp_target(ckpt, optim0, adam_w_mode)
    refuse_if_any(plan.uncarried, ckpt.tag_dir, "fsdp2")

    extra = {"format": "torch.distributed.checkpoint", "keys": [MODEL_KEY, OPTIM_KEY], "user": plan.user,
             "converted_from": {"engine": "deepspeed", "zero_stage": 3, "path": str(ckpt.tag_dir),
                                "world_size": ckpt.world_size, "ds_version": ckpt.ds_version,
                                "precision": ckpt.precision, "verified": checked.level,
                                # the prefix removed from every name: --to zero3 puts it back
                                "name_prefix": plan.names.prefix,
                                # which model keys are buffers: a frozen parameter written by one
                                # process looks like a buffer otherwise (--to zero3 reads this)
                                "buffer_names": [plan.names.fsdp_name(b) for b in ckpt.buffers()],
                                **plan.deepspeed}}
    step = ckpt.model_state.get("global_steps")
    outcome = f"nothing written: the staging folder was removed, {root / LATEST_NAME} is unchanged"
    with ExitStack() as stack:
        parts = [stack.enter_context(ckpt.open_rank(r)) for r in range(ckpt.world_size)]
        state, lazy = state_template(ckpt, plan, parts)
        # world_size=1: one process wrote it (one chunk per tensor); loading at N ranks is a reshard
        with atomic_checkpoint(root, tag, engine="fsdp2", world_size=1, step=step, dtype="float32",
                               config_digest=config_digest(ckpt.ds_config or None), extra=extra) as save:
            save.known_files = write_dcp_files(save.path, state, lazy, outcome, workers)
    final = root / tag
    return ConvertResult(
        output=root, tag=tag, source_engine="zero3", target_engine="fsdp2", world_size=ckpt.world_size,
        source_world_size=ckpt.world_size, params=len(ckpt.slots) + len(ckpt.frozen_param_shapes),
        bytes=sum(f.stat().st_size for f in final.iterdir() if f.is_file()),
        carried=plan.carried, not_carried=not_carried_lines(plan.uncarried), notes=plan.notes,
        verified=checked.level,
    )
