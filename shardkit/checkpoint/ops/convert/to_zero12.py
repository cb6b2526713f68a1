"""``convert --to zero1|zero2``: any checkpoint whose reader describes the optimizer (``readers.registry``:
ZeRO-3, FSDP2/DCP, FSDP1, universal) -> the files DeepSpeed's plain ``engine.load_checkpoint`` resumes at
N ranks under ZeRO-1 or ZeRO-2 (``writers.zero12`` says what they hold). The composition: resolve the
source, verify it, read it through the registry, plan (``plan_zero12_target``: the resuming run's config,
the optimizer and param-group format it loads, one step per param group, names, counters), write into a
staging folder and seal it (``atomic_checkpoint``: ``OUT/<tag>``, ``OUT/latest`` moved last, a manifest).
A ZeRO-1/2 source is refused (``shardkit reshard`` changes its world size), as is a weights-only reader.

Bit-exactness: fp32 masters, ``exp_avg`` and ``exp_avg_sq`` are copied bit for bit from float32 sources
(the optimizer files are byte ranges of the source then, written without torch); the module in bf16 is
the masters cast as DeepSpeed casts them. One process writes every file (no srun/torchrun split yet).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from shardkit.checkpoint.model.checkpoint import TrainingCheckpoint
from shardkit.checkpoint.ops.convert.arguments import check_workers, check_world_size
from shardkit.checkpoint.ops.convert.result import ConvertResult
from shardkit.checkpoint.ops.convert.single_source import open_source
from shardkit.checkpoint.ops.convert.to_zero3_plan import (
    carry_run_state,
    decide_precision,
    minimal_config,
    read_ds_config,
    single_adam_step,
    source_precision,
    target_groups,
    target_names,
)
from shardkit.checkpoint.ops.export.sources import Source
from shardkit.checkpoint.writers.zero12 import Zero12Files, Zero12Target, write_files
from shardkit.config.loading import config_digest
from shardkit.config.paths import get
from shardkit.core.errors import UsageError
from shardkit.storage.atomic import os_errors_named
from shardkit.storage.listing import lists_source_once
from shardkit.storage.pipeline import warn_unverified
from shardkit.storage.shared_save import outcome_unchanged
from shardkit.storage.staged_save import atomic_checkpoint

ZERO12_KINDS = ("zero12",)
"""Source kinds that are ZeRO-1/2 already: ``shardkit reshard`` moves them."""
GRADIENT_CLIPPING_DEFAULT = 1.0
"""DeepSpeed's ``gradient_clipping`` when a config does not set it (0.19, ``runtime/constants.py``)."""


@os_errors_named("converting the checkpoint")
@lists_source_once("source", "output")  # each step asking what the source holds: one listing of its folders
def convert_to_zero12(
    source: str | Path,
    output: str | Path,
    *,
    stage: int,
    world_size: int,
    tag: str | None = None,
    force: bool = False,
    verify: bool = True,
    warn: Callable[[str], None] | None = None,
    ds_config: str | os.PathLike[str] | dict[str, Any] | None = None,
    name_prefix: str | None = None,
    workers: int | None = None,
) -> ConvertResult:
    """Write ``source`` as the ZeRO-``stage`` (1 or 2) files of a DeepSpeed run at ``world_size`` ranks
    under ``output/<tag>`` (+ ``output/latest``, a manifest), for DeepSpeed's plain
    ``engine.load_checkpoint(output)``.

    ``ds_config`` (path or dict): the resuming run's config (its stage must be ``stage``; bf16 decides the
    module's dtype and the ``bf16_`` file names; the optimizer block and offload the param-group format;
    ``zero_optimization.parameter_alignment`` the flat layout); recorded as ``ds_config``. Without it: a
    DeepSpeed source's own config at the new stage, else DeepSpeed's defaults in the precision the source
    records (refused when it does not tell). ``name_prefix``: as ``convert_to_zero3``'s."""
    if stage not in (1, 2):
        raise UsageError(f"stage {stage!r}: --to zero1 or zero2 writes ZeRO stage 1 or 2")
    check_world_size(world_size)
    check_workers(workers)

    def already_zero12(found: Source) -> str | None:
        if found.kind not in ZERO12_KINDS:
            return None
        return (f"{found.tag_dir}: is a DeepSpeed ZeRO-1/2 checkpoint already; --to zero{stage} converts other "
                f"formats. For another world size use `shardkit reshard {source} --world-size N -o OUT`")

    opened = open_source(source, output, target=f"zero{stage}", label=f"ZeRO-{stage}",
                         needs="fp32 masters and Adam moments", same_format=already_zero12, tag=tag, force=force,
                         verify=verify, warn=warn or warn_unverified)
    ckpt, tag, root, checked, tag_dir = opened.ckpt, opened.tag, opened.root, opened.checked, opened.tag_dir
    ckpt.refuse_uncovered()
    notes: list[str] = [*opened.found.notes]
    cfg = _config(read_ds_config(ds_config), ckpt, stage, notes)
    target, not_carried = plan_zero12_target(ckpt, cfg, stage, world_size, target_names(ckpt, name_prefix, notes),
                                             notes, given=ds_config is not None)
    files = Zero12Files(ckpt, target)
    engine = opened.engine
    facts: dict[str, Any] = dict(world_size=world_size, step=target.global_steps, zero_stage=stage,
                                 dtype=target.precision, config_digest=config_digest(target.cfg),
                                 extra={"converted_from": {"path": str(tag_dir), "engine": engine,
                                                           "world_size": ckpt.world_size, "verified": checked.level}})
    outcome = outcome_unchanged(root)
    with atomic_checkpoint(root, tag, engine="deepspeed", **facts) as save:
        save.known_files = entries = write_files(save.path, files, outcome, workers)
    carried = ["fp32 masters", "exp_avg", "exp_avg_sq", "step", "param_groups (lr, betas, eps, weight_decay)"]
    carried += [label for label, present in (("buffers", ckpt.buffers), ("frozen parameters", ckpt.frozen),
                                             ("tied weights (shared_params)", ckpt.aliases)) if present]
    carried += [f"client_state.{k}" for k in target.client]
    notes += [n for n in ckpt.notes if not n.startswith("FSDP2/DCP checkpoint ")]
    if files.torch_route_reason is not None:
        notes.append(f"optimizer files written through torch (slower, more memory): {files.torch_route_reason}")
    notes.append(f"param groups written in {target.opt.name}'s format ({'AdamW' if target.opt.adam_w_mode else 'Adam'})"
                 f"; the module in {target.precision}")
    return ConvertResult(
        output=root, tag=tag, source_engine=engine, target_engine=f"zero{stage}", world_size=world_size,
        source_world_size=ckpt.world_size or 0, params=len(ckpt.trainable) + len(ckpt.frozen),
        bytes=sum(e.size for e in entries), carried=carried, not_carried=not_carried, notes=notes,
        verified=checked.level, route="bytes" if files.plain else "torch", share_files=len(entries),
        share_bytes=sum(e.size for e in entries), workers=workers or 1)


def _config(cfg: dict[str, Any] | None, ckpt: TrainingCheckpoint, stage: int, notes: list[str]) -> dict[str, Any] | None:
    """The resuming run's config: the given one (checked), else a DeepSpeed source's own at ``stage``."""
    if cfg is not None:
        given = get(cfg, "zero_optimization.stage", 0)
        if given != stage:
            raise UsageError(f"ds_config zero_optimization.stage is {given!r}: --to zero{stage} writes ZeRO-{stage} "
                             f"files; pass the config of the resuming ZeRO-{stage} run")
        return cfg
    origin = (ckpt.scalars.get("source") or {}).get("ds_config")
    if not isinstance(origin, dict) or not origin:
        return None
    own = dict(origin)
    zero = {k: v for k, v in (own.get("zero_optimization") or {}).items() if not str(k).startswith("stage3_")}
    own["zero_optimization"] = {**zero, "stage": stage}
    notes.append(f"no --ds-config: the source's own DeepSpeed config is recorded, at zero_optimization.stage {stage}")
    return own


def plan_zero12_target(ckpt: TrainingCheckpoint, cfg: dict[str, Any] | None, stage: int, world_size: int,
                       names: dict[str, str], notes: list[str], *, given: bool) -> tuple[Zero12Target, list[str]]:
    """The ZeRO-``stage`` files for ``world_size`` ranks of the run ``cfg`` configures; what cannot be
    held is refused or returned as not carried."""
    tag_dir = ckpt.folder
    not_carried: list[str] = list(ckpt.scalars.get("not_carried") or [])
    for key in ("bf16.enabled", "fp16.enabled", "zero_optimization.offload_optimizer.device"):
        if cfg is not None and get(cfg, key) == "auto":
            raise UsageError(f"ds_config {key} is 'auto': it decides the files' names and param-group format, and only "
                             "the HF Trainer fills it in at launch. Pass the config with the value the run uses")
    if cfg is not None and get(cfg, "fp16.enabled", False) is True:
        raise UsageError(f"ds_config fp16.enabled is true: an fp16 ZeRO-{stage} run resumes its loss scaler's state, "
                         "which this converter does not write. Resume in bf16 or fp32 (bf16.enabled or neither)")
    config_precision = "bf16" if cfg is not None and get(cfg, "bf16.enabled", False) is True else "fp32"
    precision = decide_precision(cfg if given else None, config_precision, source_precision(ckpt), tag_dir, notes) \
        if given or cfg is None else config_precision
    source_groups, opt, groups = target_groups(ckpt, cfg, not_carried)
    steps_by_name: dict[str, float] = dict(ckpt.scalars.get("step") or {})
    group_params = [list(g["params"]) for g in source_groups]
    steps = [_group_step(ckpt, g, params, steps_by_name) for g, params in enumerate(group_params)]
    counters = dict(ckpt.scalars.get("counters") or {})
    global_steps = int(counters.pop("global_steps", steps[0] if steps else 0))
    counters.setdefault("skipped_steps", 0)
    client = carry_run_state(ckpt, cfg, counters, global_steps, precision, notes, not_carried)
    dtypes = sorted({ckpt.weights[n].dtype for n in ckpt.optimizer} - {"float32"})
    if dtypes:
        notes.append(f"parameters/moments saved as {dtypes} were upcast to float32 (ZeRO's masters and moments are fp32)")
    # the optimizer's clip_grad is restored from the file (stage_1_and_2._load_global_state), so it must be the
    # resuming run's gradient_clipping; DeepSpeed's default is 1.0 (runtime/constants.py GRADIENT_CLIPPING_DEFAULT)
    clip = get(cfg, "gradient_clipping", None) if cfg is not None else ckpt.scalars.get("clip_grad")
    if clip is None:
        clip = GRADIENT_CLIPPING_DEFAULT
    record = cfg if cfg is not None else {**minimal_config(source_groups[0], opt), "zero_optimization": {"stage": stage}}
    if cfg is None and precision == "bf16":
        record["bf16"] = {"enabled": True}
    target = Zero12Target(stage=stage, world_size=world_size, precision=precision, opt=opt, groups=groups,
                          group_params=group_params, steps=steps,
                          parameter_alignment=bool(get(cfg or {}, "zero_optimization.parameter_alignment", False)),
                          global_steps=global_steps, counters=counters, client=client, cfg=record, names=names,
                          clip_grad=float(clip))
    return target, not_carried


def _group_step(ckpt: TrainingCheckpoint, g: int, params: list[str], steps: dict[str, float]) -> int:
    """The one Adam step of param group ``g`` (ZeRO-1/2 keeps one per group's flat partition)."""
    return single_adam_step(params, steps, f"{ckpt.folder}: param group {g}", "its parameters",
                            "ZeRO-1/2 keeps one step per param group")
