"""Any checkpoint whose reader describes the optimizer -> DeepSpeed ZeRO-3: the per-rank files a
ZeRO-3 run at N ranks would have saved, for DeepSpeed's plain ``engine.load_checkpoint``.
``convert_to_zero3`` is the registry's reader (``readers.registry.read_checkpoint``: FSDP2/DCP,
ZeRO-1/2, universal, FSDP1 SHARDED/FULL), the plan (``to_zero3_plan``: the resuming run's config,
optimizer format, sub-group layout, steps, names, counters) and the ZeRO-3 writer
(``writers.zero3``), between the steps every operation shares (``storage.pipeline``: verify the
source, check the output folder; staging and sealing by ``atomic_checkpoint`` or, under
srun/torchrun, ``storage.shared_tag``). A ZeRO-3 source is refused (``shardkit reshard`` changes its
world size), as is a reader that describes weights only.

Output, under ``OUT/<tag>`` with ``OUT/latest`` moved last and a shardkit manifest: the
``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` and ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt``
of every new rank (``writers.zero3`` says what they hold).

The usual route imports no torch: each output rank's flat tensors are byte ranges of the source's
pieces plus zero runs, copied through one 1 MiB buffer and hashed as they are written, one thread
per rank file. A tensor the pieces cannot describe or a cast (bf16 parameters for an fp32 run) is
read slice by slice through torch and written by ``stream_save`` (the torch route).

Bit-exactness: fp32 masters, ``exp_avg``, ``exp_avg_sq`` and ``step`` are copied bit for bit
(float32 sources; other dtypes are upcast and said so). What the files cannot hold: DeepSpeed's CPU
Adam kernels (``DeepSpeedCPUAdam`` with offload, ``FusedAdam`` on a CPU run) keep ``beta**step``
in C++; a plain ``engine.load_checkpoint`` of an engine guarded by
``resume_zero3.guard_plain_loads`` replays it, else call ``shardkit.restore_cpu_adam_kernel_state
(engine)`` on every rank after it (see ``checkpoint/ops/cpu_adam_kernel.py``).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from shardkit.checkpoint.ops.convert.arguments import check_workers, check_world_size
from shardkit.checkpoint.ops.convert.result import ConvertResult
from shardkit.checkpoint.ops.convert.single_source import locate, refuse_weights_only
from shardkit.checkpoint.ops.convert.to_zero3_plan import (
    check_target_config,
    decide_precision,
    plan_zero3_target,
    read_ds_config,
    source_precision,
    target_names,
)
from shardkit.checkpoint.readers.registry import read_checkpoint
from shardkit.checkpoint.writers.dcp_files import CONVERT
from shardkit.checkpoint.writers.zero3 import RankStates, rank_file_workers, write_rank_files
from shardkit.config.loading import config_digest
from shardkit.core.errors import UsageError
from shardkit.platform.dist import process_group_active
from shardkit.platform.versions import library_versions
from shardkit.storage.atomic import os_errors_named
from shardkit.storage.listing import list_folder, lists_source_once
from shardkit.storage.manifest import FileEntry, Manifest
from shardkit.storage.pipeline import (
    check_source,
    check_source_digests,
    hash_beside,
    warn_unverified,
)
from shardkit.storage.request import RunRequest, source_of
from shardkit.storage.shared_save import Launch, launch_from_env, outcome_unchanged
from shardkit.storage.shared_tag import signatures, write_tag_shared
from shardkit.storage.staged_save import atomic_checkpoint


@os_errors_named("converting the checkpoint")
@lists_source_once("source", "output")  # each step asking what the source holds: one listing of its folders
def convert_to_zero3(
    source: str | Path,
    output: str | Path,
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
    (``storage.shared_tag``), each writing the files of the new ranks ``r`` with ``r % processes ==
    its rank``, hashing its share of the source beside them, and process 0 seals one manifest.
    """
    check_workers(workers, "rank files")
    unknown = sorted(set(options) - {"sub_group_size"})
    if unknown:
        raise UsageError(f"convert_to_zero3: unknown option(s) {unknown}; accepted: ds_config, sub_group_size")
    check_world_size(world_size)
    if process_group_active():
        raise UsageError("convert_to_zero3 runs in one process, but a torch.distributed process group is "
                         "initialized here (its DCP reads would become collective); run `shardkit convert` outside "
                         "the training job")
    launch = launch or launch_from_env()
    warn = warn or warn_unverified
    found, tag, root = locate(source, output, target="zero3", tag=tag, force=force, rank=launch.rank,
                              same_format=lambda f: None if f.kind != "zero3" else (
                                  f"{f.tag_dir}: is a DeepSpeed ZeRO-3 checkpoint already; --to zero3 converts other "
                                  f"formats. For another world size use `shardkit reshard {source} --world-size N -o OUT`"))
    tag_dir = found.tag_dir
    cfg = read_ds_config(ds_config)
    sub_group_size, precision = check_target_config(cfg)
    if options.get("sub_group_size") is not None:
        sub_group_size = int(options["sub_group_size"])
        if sub_group_size < 1:
            raise UsageError(f"sub_group_size {sub_group_size}: must be at least 1")
    # One process: every digest before anything is read. Several (srun/torchrun): sizes and the small files
    # now, each process's share of the large ones' digests while the files are written. A link out: refused.
    checked = check_source(tag_dir, verify=verify, hash_now=not launch.distributed)
    for note in checked.warnings if launch.rank == 0 else []:
        warn(note)
    verified, expected = checked.level, checked.owed
    _check_now(tag_dir, expected, [n for n in expected if n == ".metadata"])  # every process parses it next
    before = signatures(sorted(tag_dir / name for name in list_folder(tag_dir).files))

    ckpt = read_checkpoint(found.kind, tag_dir)
    refuse_weights_only(ckpt, found, "zero3", "and a ZeRO-3 checkpoint needs fp32 masters and Adam moments")
    ckpt.refuse_uncovered()
    notes: list[str] = [*found.notes]
    precision = decide_precision(cfg, precision, source_precision(ckpt), tag_dir, notes)
    names = target_names(ckpt, name_prefix, notes)
    planned = plan_zero3_target(ckpt, cfg, world_size, sub_group_size, precision, names, notes)
    target = planned.target
    opt, layout = target.opt, target.layout
    if cfg is None and precision == "bf16":
        target.cfg["bf16"] = {"enabled": True}  # the recorded config says what the files were written for

    out = RankStates(ckpt, target)
    # files no tensor is copied from (pickles, metadata) were parsed by every process: checked now;
    # the others, shared out, while the files are written (nothing is published unless all match)
    copied = {p.file.name for t in [*ckpt.weights.values(), *(s for st in ckpt.optimizer.values() for s in st.values())]
              for p in t.pieces if p.file.parent == tag_dir}
    _check_now(tag_dir, expected, [n for n in expected if n not in copied])
    facts: dict[str, Any] = dict(world_size=world_size, step=target.global_steps, zero_stage=3, dtype=precision,
                                 config_digest=config_digest(target.cfg),
                                 extra={"converted_from": {"path": str(tag_dir), "engine": _engine(ckpt.format),
                                                           "world_size": ckpt.world_size, "verified": verified}})
    outcome = outcome_unchanged(root)
    # what every process must agree on before anything is written (storage.shared_meet): the config's
    # digest stands for --ds-config (its content, the precision and sub-group size it decided)
    request = RunRequest("convert --to zero3", source_of(tag_dir), str(root.resolve()), tag, {
        "--world-size": world_size, "--sub-group-size": sub_group_size, "precision": precision,
        "--ds-config": facts["config_digest"], "--no-verify": not verify,
        "--name-prefix": None if name_prefix is None else name_prefix.rstrip(".") or "none"})
    mine = [r for r in range(world_size) if r % launch.world == launch.rank]
    share: list[FileEntry] = []
    workers = workers or rank_file_workers(mine, out.byte_ranges)
    if launch.distributed:
        if not out.byte_ranges:
            raise UsageError(f"{tag_dir}: some tensors of this checkpoint are not plain float32 byte ranges "
                             f"({out.not_byte_ranges}); they are read through torch, in one process only, and "
                             f"{launch.launcher} started {launch.world}. Run shardkit convert once, without srun/torchrun")

        # each process: its share of the new ranks' files, and of the source's digests beside them
        def write_mine(staged: Path) -> list[FileEntry]:
            share.extend(write_rank_files(staged, out, outcome, workers, mine))
            return share

        big = sorted(expected)
        written = [e.path for e in write_tag_shared(
            root, tag, launch, request=request, write_mine=write_mine,
            to_hash=[(tag_dir / n, expected[n]) for i, n in enumerate(big) if i % launch.world == launch.rank],
            hash_workers=len(os.sched_getaffinity(0)), before=before, activity=CONVERT,
            facts=lambda entries: Manifest(engine="deepspeed", tag=tag, versions=library_versions(), **facts))]
    else:
        with atomic_checkpoint(root, tag, engine="deepspeed", **facts) as save:
            save.known_files = share = write_rank_files(save.path, out, outcome, workers)
            written = [e.path for e in save.known_files]
    final = root / tag
    carried = ["fp32 masters", "exp_avg", "exp_avg_sq", "step", "param_groups (lr, betas, eps, weight_decay)"]
    if out.buffers:
        carried.append("buffers")
    if out.frozen:
        carried.append("frozen parameters")
    if ckpt.aliases:
        carried.append("tied weights (shared_params)")
    carried += [f"client_state.{k}" for k in target.client]
    notes += [n for n in ckpt.notes if not n.startswith("FSDP2/DCP checkpoint ")]
    if out.torch_route_reason is not None:
        notes.append(f"written through torch (slower, more memory): {out.torch_route_reason}")
    notes.append(f"param groups written in {opt.name}'s format ({'AdamW' if opt.adam_w_mode else 'Adam'}); "
                 f"{len(layout.sub_groups)} sub-group(s) at sub_group_size {sub_group_size}")
    if opt.name in ("FusedAdam", "DeepSpeedCPUAdam"):
        notes.append("on a CPU run, load with shardkit.guard_plain_loads(engine)"
                     ".load_checkpoint(OUT), or call shardkit.restore_cpu_adam_kernel_state(engine) on every rank after "
                     "engine.load_checkpoint (DeepSpeed's CPU Adam kernels keep beta**step outside the checkpoint)")
    return ConvertResult(
        output=root, tag=tag, source_engine=_engine(ckpt.format), target_engine="zero3", world_size=world_size,
        source_world_size=ckpt.world_size or 0, params=len(ckpt.trainable) + len(out.frozen),
        bytes=sum((final / f).stat().st_size for f in written) if launch.rank == 0 else sum(e.size for e in share),
        carried=carried, not_carried=planned.not_carried, notes=notes, verified=verified,
        route="bytes" if out.plain else "torch", rank=launch.rank, processes=launch.world, share_files=len(share),
        share_bytes=sum(e.size for e in share), workers=workers, launcher=launch.launcher)


def _check_now(tag_dir: Path, expected: dict[str, FileEntry], names: list[str]) -> None:
    """The digests of ``names`` (taken out of ``expected``) checked before going on."""
    if names:
        with ThreadPoolExecutor(max_workers=1) as pool:
            check_source_digests(hash_beside(pool, [(tag_dir / n, expected.pop(n)) for n in names]),
                                 "convert", "convert another checkpoint")


def _engine(kind: str) -> str:
    """The source in the result's and manifest's words: ``fsdp2`` for DCP, else the reader's format
    (``zero1``, ``zero2``, ``universal``, ``fsdp1-sharded``...)."""
    return "fsdp2" if kind == "dcp" else kind
