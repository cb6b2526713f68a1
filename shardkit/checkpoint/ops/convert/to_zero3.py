"""FSDP2 (DCP) -> DeepSpeed ZeRO-3: the per-rank files a ZeRO-3 run at N ranks would have saved.

Input: a DCP checkpoint ``save_fsdp_checkpoint`` wrote (``{"model": ..., "optim": ...}`` from
``get_state_dict``: model FQNs, torch Adam/AdamW state ``step``/``exp_avg``/``exp_avg_sq`` per
parameter, ``param_groups`` listing FQNs in the optimizer's order). Output, under ``OUT/<tag>``
with ``OUT/latest`` moved last and a shardkit manifest (``atomic_checkpoint``):

- ``zero_pp_rank_{r}_mp_rank_00_model_states.pt``: what ``DeepSpeedEngine._save_checkpoint``
  writes (0.19.8): ``module`` (empty placeholders for parameters, as a partitioned ZeRO-3 module's
  ``state_dict`` holds them, and the buffers' values), ``buffer_names``, ``param_shapes`` (one
  ordered dict per sub-group), ``frozen_param_shapes``/``frozen_param_fragments``,
  ``shared_params``, counters, ``dp_world_size``, ``ds_config``, ``ds_version`` and the JSON
  client state the FSDP2 save kept (``extra``);
- ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt``: ``DeepSpeedZeroOptimizer_Stage3.
  _rigid_state_dict``: ``zero_stage``, ``loss_scaler``, ``partition_count``, the inner optimizer's
  ``state``/``param_groups`` (one entry per sub-group) and ``fp32_flat_groups``.

The trainable parameters are laid out as ZeRO-3 lays them out at N ranks (``plan_layout``: each
param group split into sub-groups at ``sub_group_size``, ``ceil(numel / N)`` elements per rank,
zero padding), in the order the DCP param groups list them: the model's ``parameters()`` order when
the FSDP2 optimizer was built from ``model.parameters()``, which is the order DeepSpeed uses.
``_rigid_load_state_dict`` copies flat tensors without looking at names, so that order is what
makes the load right; the tests compare every parameter after a real load.

The usual route imports no torch (1.2 s and 224 MB here): the ``.metadata`` is read by the
restricted, torch-free ``dcp.plain_metadata`` reader; each output rank's flat tensors are byte
ranges of the ``.distcp`` files plus zero runs (``dcp.slices`` checks each chunk's zip/pickle layout
first), buffers and steps the source's own records, param-group values plain data read by an
unpickler that takes no global; ``torch_pickle`` writes the pickle and the ranges are copied
through one 1 MiB buffer and hashed as they are written, one thread per rank file: every source
byte is read once, nothing is built in memory, and the manifest needs no second read. A chunk
layout ``dcp.slices`` does not take (or a dtype other than float32) is loaded whole through
``load_dcp_state`` (``weights_only`` bytes) in ``BATCH_BYTES`` batches, one rank file after
another, and written by ``stream_save`` (``dcp_to_zero3_write``: the torch route).

Bit-exactness: fp32 masters, ``exp_avg``, ``exp_avg_sq`` and ``step`` are copied bit for bit
(float32 sources; other dtypes are upcast and said so). What the files cannot hold: DeepSpeed's CPU
Adam kernels (``DeepSpeedCPUAdam`` with offload, ``FusedAdam`` on a CPU run) keep ``beta**step``
in C++; a plain ``engine.load_checkpoint`` of an engine guarded by
``resume_zero3.guard_plain_loads`` replays it, else call ``shardkit.restore_cpu_adam_kernel_state
(engine)`` on every rank after it (see ``checkpoint/ops/cpu_adam_kernel.py``). The update rule itself
differs from torch's AdamW in rounding, so the continued loss curve matches an FSDP2 continuation
to a tolerance, not bit for bit (README "Convert").

Modules: this one is the entry point and the order of the steps (the shared ones from
``io.pipeline``: verify the source, check the output folder; staging and sealing by
``atomic_checkpoint``). ``dcp_to_zero3_source`` reads the source (its tag folder, metadata and
items, and what each model key is); ``dcp_to_zero3_plan`` decides the target (the resuming run's
config and optimizer, param-group format, sub-group layout, steps and counters);
``dcp_to_zero3_write`` builds each rank's two dicts and writes the files.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path
from typing import Any, Callable

from shardkit.checkpoint.dcp.reader import METADATA_NAME
from shardkit.checkpoint.layout.support import refuse_unsupported
from shardkit.checkpoint.ops.convert.dcp_to_zero3_plan import (
    check_target_config,
    decide_precision,
    plan_zero3_target,
    read_ds_config,
    source_precision,
    target_names,
)
from shardkit.checkpoint.ops.convert.dcp_to_zero3_source import DcpSource, classify_source, resolve_dcp_tag_dir
from shardkit.checkpoint.ops.convert.dcp_to_zero3_write import RankStates, rank_file_workers, write_rank_files
from shardkit.checkpoint.ops.convert.result import ConvertResult
from shardkit.checkpoint.writers.dcp_files import CONVERT
from shardkit.config.loading import config_digest
from shardkit.core.errors import UsageError
from shardkit.platform.dist import process_group_active
from shardkit.platform.versions import library_versions
from shardkit.storage.atomic import os_errors_named
from shardkit.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, read_manifest
from shardkit.storage.pipeline import (
    check_output_root,
    check_source_digests,
    hash_beside,
    verify_before_reading,
    warn_unverified,
)
from shardkit.storage.request import RunRequest, source_of
from shardkit.storage.shared_save import Launch, launch_from_env, outcome_unchanged
from shardkit.storage.shared_tag import signatures, write_tag_shared
from shardkit.storage.staged_save import atomic_checkpoint
from shardkit.storage.tags import check_tag
from shardkit.storage.verify import refuse_links_leaving

MAX_WORLD_SIZE = 2**20


@os_errors_named("converting the checkpoint")
def convert_dcp_to_zero3(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    world_size: int,
    tag: str | None = None,
    force: bool = False,
    verify: bool = True,
    warn: Callable[[str], None] | None = None,
    ds_config: str | os.PathLike[str] | dict[str, Any] | None = None,
    name_prefix: str | None = None,
    workers: int | None = None,
    launch: Launch | None = None,
    **options: Any,
) -> ConvertResult:
    """Write the FSDP2 (DCP) checkpoint ``source`` as the ZeRO-3 files of a DeepSpeed run at
    ``world_size`` ranks under ``output/<tag>`` (+ ``output/latest``, a manifest), for DeepSpeed's
    plain ``engine.load_checkpoint(output)``.

    ``ds_config`` (path or dict): the resuming run's DeepSpeed config; gives ``sub_group_size``,
    bf16 (``bf16_`` optim file names, module placeholders), the optimizer whose param-group format
    is written (FusedAdam; DeepSpeedCPUAdam with ``offload_optimizer``; torch's with ``torch_adam``
    or no ``optimizer`` block), and is recorded as ``ds_config``. Without it: DeepSpeed's defaults
    and FusedAdam, in the precision the source records (a ZeRO-3 origin's, or bfloat16 parameters);
    a source that does not tell (float32 FSDP2 parameters, also kept under a bf16 mixed-precision
    policy) is refused, naming ``--ds-config``. ``name_prefix``: ``"module."`` when the resuming
    engine's model is a wrapper holding it as ``.module``, ``""`` when not; None keeps the source's
    names (or restores the prefix a ZeRO-3 origin had). ``workers``: rank files written at once
    (default: one per new rank's file, ``default_workers``). ``launch``: this process's share of the
    new ranks' files (default: from ``srun``/``torchrun``'s variables; one process does everything
    without them). ``options``: ``sub_group_size`` overrides the config's.

    The source is verified against its manifest first (sizes, digests unless ``verify=False``);
    ``output`` must be new, empty or a shardkit checkpoint folder (an existing tag only with
    ``force``). No process group may be initialized (DCP reads would otherwise be collective):
    under ``srun``/``torchrun`` the processes share the work through the output folder
    (``io.shared_tag``), each writing the files of the new ranks ``r`` with ``r % processes ==
    its rank``, hashing its share of the source beside them, and process 0 seals one manifest.
    """
    if workers is not None and workers < 1:
        raise UsageError(f"workers={workers}: must be at least 1 (rank files written at once)")
    unknown = sorted(set(options) - {"sub_group_size"})
    if unknown:
        raise UsageError(f"convert_dcp_to_zero3: unknown option(s) {unknown}; accepted: ds_config, sub_group_size")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise UsageError(f"--world-size {world_size!r}: must be a whole number from 1 to {MAX_WORLD_SIZE} (the data-"
                         "parallel ranks of the resuming DeepSpeed run)")
    if process_group_active():
        raise UsageError("convert_dcp_to_zero3 runs in one process, but a torch.distributed process group is "
                         "initialized here (its DCP reads would become collective); run `shardkit convert` outside "
                         "the training job")
    launch = launch or launch_from_env()
    warn = warn or warn_unverified
    refuse_unsupported(source, "convert --to zero3")  # a layout nothing converts correctly: refused before anything is read
    tag_dir = resolve_dcp_tag_dir(source)
    tag = check_tag(tag) if tag is not None else check_tag(tag_dir.name, "source tag (the source folder's name; no --tag given)")
    root = Path(output)
    if launch.rank == 0:
        # the others write into the staging folder process 0 claims after this check
        check_output_root(root, tag, tag_dir, force=force)
    cfg = read_ds_config(ds_config)
    sub_group_size, precision = check_target_config(cfg)
    if options.get("sub_group_size") is not None:
        sub_group_size = int(options["sub_group_size"])
        if sub_group_size < 1:
            raise UsageError(f"sub_group_size {sub_group_size}: must be at least 1")
    # One process: every digest before anything is read. Several (srun/torchrun): sizes and the
    # small .metadata now, each process's share of the .distcp digests while the files are written.
    checked = verify_before_reading(tag_dir, checksums=verify and not launch.distributed)
    # a folder without a manifest is not verified: a link out of it must still never be read
    refuse_links_leaving(tag_dir, "convert")
    if launch.rank == 0:
        for note in checked.warnings:
            if not (verify and launch.distributed and note.startswith("--no-verify")):
                warn(note)
    manifest = read_manifest(tag_dir) if (tag_dir / MANIFEST_NAME).is_file() else None
    expected = {e.path: e for e in manifest.files} if manifest is not None and verify and launch.distributed else {}
    if METADATA_NAME in expected:  # every process reads it next
        with ThreadPoolExecutor(max_workers=1) as pool:
            check_source_digests(hash_beside(pool, [(tag_dir / METADATA_NAME, expected.pop(METADATA_NAME))]),
                                 "convert", "convert another checkpoint")
    verified = checked.level if not launch.distributed or checked.manifest is None else ("hash" if verify else "sizes")
    if manifest is not None and manifest.engine != "fsdp2":
        raise UsageError(f"{tag_dir}: its manifest says engine {manifest.engine!r}, not 'fsdp2'; --to zero3 converts FSDP2 "
                         "checkpoints (a ZeRO-3 checkpoint at another world size: `shardkit reshard`)")

    src = DcpSource(tag_dir)
    extra = manifest.extra if manifest is not None else {}
    hint = extra.get("buffers", (extra.get("converted_from") or {}).get("buffer_names"))
    plan = classify_source(src, [str(n) for n in hint] if isinstance(hint, list) else None)
    precision = decide_precision(cfg, precision, source_precision(manifest, plan), tag_dir, plan.notes)
    names = target_names(plan, manifest, name_prefix, tag_dir)
    target = plan_zero3_target(plan, cfg, manifest, world_size, sub_group_size, tag_dir)
    opt, layout, client = target.opt, target.layout, target.client
    if cfg is None and precision == "bf16":
        target.cfg["bf16"] = {"enabled": True}  # the recorded config says what the files were written for

    out = RankStates(src=src, plan=plan, layout=layout, opt=opt, groups=target.groups, sub_steps=target.sub_steps,
                     precision=precision, global_steps=target.global_steps, counters=target.counters, client=client,
                     cfg=target.cfg, names=names)
    facts: dict[str, Any] = dict(world_size=world_size, step=target.global_steps, zero_stage=3, dtype=precision,
                 config_digest=config_digest(target.cfg),
                 extra={"converted_from": {"path": str(tag_dir), "engine": "fsdp2",
                                           "world_size": manifest.world_size if manifest else None,
                                           "verified": verified}})
    outcome = outcome_unchanged(root)
    # what every process must agree on before anything is written (io.shared_meet): the config's
    # digest stands for --ds-config (its content, the precision and sub-group size it decided)
    request = RunRequest("convert --to zero3", source_of(tag_dir), str(root.resolve()), tag, {
        "--world-size": world_size, "--sub-group-size": sub_group_size, "precision": precision,
        "--ds-config": facts["config_digest"], "--no-verify": not verify,
        "--name-prefix": None if name_prefix is None else name_prefix.rstrip(".") or "none"})
    mine = [r for r in range(world_size) if r % launch.world == launch.rank]
    share: list[FileEntry] = []
    with closing(src.slices):
        workers = workers or rank_file_workers(mine, out.byte_ranges)
        if launch.distributed:
            if not out.byte_ranges:
                raise UsageError(f"{tag_dir}: some tensors of this checkpoint are not plain float32 byte ranges "
                                 f"({out.not_byte_ranges}); they are read through torch.distributed.checkpoint, in one "
                                 f"process only, and {launch.launcher} started {launch.world}. Run shardkit convert "
                                 "once, without srun/torchrun")
            # each process: its share of the new ranks' files, and of the source's digests beside them
            def write_mine(staged: Path) -> list[FileEntry]:
                share.extend(write_rank_files(staged, out, precision, outcome, workers, mine))
                return share

            distcp = sorted(expected)
            written = [e.path for e in write_tag_shared(
                root, tag, launch, request=request, write_mine=write_mine,
                to_hash=[(tag_dir / n, expected[n]) for i, n in enumerate(distcp) if i % launch.world == launch.rank],
                hash_workers=len(os.sched_getaffinity(0)),
                before=signatures(sorted([*tag_dir.glob("*.distcp"), tag_dir / METADATA_NAME])), activity=CONVERT,
                facts=lambda entries: Manifest(engine="deepspeed", tag=tag, versions=library_versions(), **facts))]
        else:
            with atomic_checkpoint(root, tag, engine="deepspeed", **facts) as save:
                save.known_files = share = write_rank_files(save.path, out, precision, outcome, workers)
                written = [e.path for e in save.known_files]
    final = root / tag
    carried = ["fp32 masters", "exp_avg", "exp_avg_sq", "step", "param_groups (lr, betas, eps, weight_decay)"]
    if plan.buffers:
        carried.append("buffers")
    if plan.frozen:
        carried.append("frozen parameters")
    if plan.aliases:
        carried.append("tied weights (shared_params)")
    carried += [f"client_state.{k}" for k in client]
    notes = list(plan.notes)
    if out.torch_route_reason is not None:
        notes.append(f"written through torch (dcp.load; slower, more memory): {out.torch_route_reason}")
    notes.append(f"param groups written in {opt.name}'s format ({'AdamW' if opt.adam_w_mode else 'Adam'}); "
                 f"{len(layout.sub_groups)} sub-group(s) at sub_group_size {sub_group_size}")
    if opt.name in ("FusedAdam", "DeepSpeedCPUAdam"):
        notes.append("on a CPU run, load with shardkit.checkpoint.ops.resume_zero3.guard_plain_loads(engine)"
                     ".load_checkpoint(OUT), or call shardkit.restore_cpu_adam_kernel_state(engine) on every rank after "
                     "engine.load_checkpoint (DeepSpeed's CPU Adam kernels keep beta**step outside the checkpoint)")
    return ConvertResult(
        output=root, tag=tag, source_engine="fsdp2", target_engine="zero3", world_size=world_size,
        source_world_size=manifest.world_size if manifest is not None else 0,
        params=len(plan.trainable) + len(plan.frozen),
        bytes=sum((final / f).stat().st_size for f in written) if launch.rank == 0 else sum(e.size for e in share),
        carried=carried, not_carried=plan.not_carried, notes=notes, verified=verified,
        route="bytes" if out.plain else "torch", rank=launch.rank, processes=launch.world, share_files=len(share),
        share_bytes=sum(e.size for e in share), workers=workers, launcher=launch.launcher)
