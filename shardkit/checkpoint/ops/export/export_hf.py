"""``export_hf_folder``: the export operation, step by step (see the package doc for the modules).

1. resolve SRC (``sources``) and find the config (``--model-config`` or beside the checkpoint);
2. verify the source against its shardkit manifest before anything is read (``pipeline``);
3. describe the source's tensors as byte ranges (``readers.registry.read_checkpoint``), build the model
   class on the meta device (``model_spec``) and pair them (``match``), refusing before writing; turn
   them into what save_pretrained writes where transformers converts on save (``conversion``); a
   PEFT adapter's tensors (``lora_A``...) are paired with what peft saves instead (``adapter_spec``)
   and written as ``adapter_model.safetensors`` beside ``adapter_config.json``;
4. split into shards as ``save_pretrained`` (``shard_plan``), write them streaming, one thread per
   shard (``writer``), plus the index, ``config.json`` (its ``dtype`` set to what was written),
   ``generation_config.json`` and tokenizer files;
5. seal with a manifest and rename the staging folder into place (``output``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from shardkit.checkpoint.layout.support import refuse_unsupported
from shardkit.checkpoint.model.tensors import SourceTensor, refuse_uncovered, written_as
from shardkit.checkpoint.ops.export.adapter_spec import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_spec
from shardkit.checkpoint.ops.export.conversion import apply_conversion
from shardkit.checkpoint.ops.export.match import adapter_names, match, normalize
from shardkit.checkpoint.ops.export.model_spec import CONFIG_NAME, model_spec, read_config
from shardkit.checkpoint.ops.export.output import check_output_dir, remove_staging, seal_export
from shardkit.checkpoint.ops.export.shard_plan import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_FILE,
    Shard,
    parse_shard_size,
    plan_shards,
)
from shardkit.checkpoint.ops.export.sources import COMPANION_FILES, Source, find_config_dir, resolve_source
from shardkit.checkpoint.ops.export.writer import ShardJob, entry_dtype, output_dtype, write_shards
from shardkit.checkpoint.readers.registry import read_checkpoint
from shardkit.core.errors import CheckpointError, UsageError
from shardkit.core.files import copy_regular
from shardkit.storage.atomic import atomic_write_text, disk_full_named, os_errors_named, publish_dir
from shardkit.storage.dry_run import writing_starts
from shardkit.storage.listing import lists_source_once
from shardkit.storage.pipeline import default_workers, verify_before_reading, warn_unverified
from shardkit.storage.sibling_staging import remove_stale_staging, staging_folder
from shardkit.storage.torch_load import ITEMSIZE


@dataclass
class ExportResult:
    """What ``export_hf_folder`` wrote."""

    output: Path
    files: list[str]
    """Weight files written (``model.safetensors`` or the shards)."""
    tensors: int
    parameters: int
    """``total_parameters`` as the index records it (the model's ``num_parameters()``)."""
    bytes: int
    """Bytes of tensor data (the index's ``total_size``)."""
    dtype: str
    """``fp32``/``bf16``/``fp16``: what floating-point tensors were written as."""
    source_kind: str
    model_class: str
    copied: list[str] = field(default_factory=list)
    """config.json, generation_config.json and tokenizer files copied beside the weights."""
    verified: str = "none"
    notes: list[str] = field(default_factory=list)


@dataclass
class Plan:
    """What will be written: tensors by output name (in order), their dtype, and for the report."""

    tensors: dict[str, SourceTensor]
    dtype: str
    class_name: str
    total_parameters: int
    adapter_dir: Path | None
    """Where adapter_config.json is, for an adapter export; None for a full model."""
    notes: list[str]


@os_errors_named("exporting the checkpoint")
@lists_source_once("source", "output")  # each step asking what the source holds: one listing of its folders
def export_hf_folder(
    source: str | Path,
    output: str | Path,
    *,
    dtype: str | None = None,
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
    model_config: str | Path | None = None,
    workers: int | None = None,
    force: bool = False,
    verify: bool = True,
    warn: Callable[[str], None] | None = None,
) -> ExportResult:
    """Write the checkpoint at ``source`` as a ``from_pretrained`` folder at ``output``.

    ``dtype``: ``fp32``/``bf16``/``fp16`` for floating-point tensors (default: the config's
    ``dtype``/``torch_dtype``, else fp32); ``max_shard_size``: save_pretrained's forms (``5GB``,
    ``500MB``, ``50KB``); ``model_config``: a folder with the model's ``config.json`` when the
    checkpoint has none beside it; ``workers``: shard files written at once (default
    ``default_workers``); ``force``: replace an earlier shardkit export at ``output``;
    ``verify=False``: check the source's file sizes only, not their digests.
    """
    if dtype is not None:
        output_dtype(dtype)
    if workers is not None and workers < 1:
        raise UsageError(f"--workers {workers}: must be at least 1 (shard files written at once)")
    limit = parse_shard_size(max_shard_size)
    final = Path(output)
    refuse_unsupported(source, "export")  # a layout nothing converts correctly: refused before anything is read
    src = resolve_source(source)
    config_dir = find_config_dir(src, model_config)
    check_output_dir(final, [src.folder, src.tag_dir], force=force)
    raw_config = read_config(config_dir)
    checked = verify_before_reading(src.tag_dir, checksums=verify, workers=workers or default_workers(4))
    for note in checked.warnings:
        (warn or warn_unverified)(note)

    ckpt = read_checkpoint(src.kind, src.tag_dir)
    tensors, aliases, notes = ckpt.weights, ckpt.aliases, [*src.notes, *ckpt.notes]
    tensors, aliases, name_notes = normalize(tensors, aliases)
    notes += name_notes
    lora = adapter_names(list(tensors))
    plan = (_adapter_plan(tensors, lora, src, config_dir, model_config, dtype) if lora else
            _model_plan(tensors, aliases, src, config_dir, dtype))
    notes += plan.notes
    out_name = output_dtype(plan.dtype)
    sizes = {n: t.numel * ITEMSIZE[entry_dtype(t, out_name)] for n, t in plan.tensors.items()}
    shards = [Shard(ADAPTER_WEIGHTS, tuple(sizes), sum(sizes.values()))] if plan.adapter_dir else plan_shards(sizes, limit)
    jobs = [ShardJob(s, {n: plan.tensors[n] for n in s.names}, out_name) for s in shards]
    n_workers = min(workers or default_workers(len(jobs)), len(jobs))

    writing_starts(str(final))  # a --dry-run stops here: every check before it has passed
    final.parent.mkdir(parents=True, exist_ok=True)
    leftovers = remove_stale_staging(final)
    if leftovers:
        notes.append(f"removed staging folders of killed earlier exports to {final.name}: {', '.join(leftovers)}")
    staged = staging_folder(final)
    outcome = f"nothing written: the staging folder was removed, {final} is unchanged"
    try:
        with disk_full_named(staged, outcome):
            staged.mkdir()
            write_shards(staged, jobs, n_workers)
            total = sum(sizes.values())
            if len(shards) > 1:
                index = {"metadata": {"total_parameters": plan.total_parameters, "total_size": total},
                         "weight_map": {n: s.filename for s in shards for n in s.names}}
                atomic_write_text(staged / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True) + "\n")
            if plan.adapter_dir is not None:
                copy_regular(plan.adapter_dir / ADAPTER_CONFIG, staged / ADAPTER_CONFIG)
                copied = [ADAPTER_CONFIG, *_copy_companions(plan.adapter_dir, config_dir, staged)]
            else:
                copied = _copy_config(staged, raw_config, out_name) + _copy_companions(config_dir, config_dir, staged)
            seal_export(staged, final, dtype=plan.dtype, extra={
                "source": str(Path(source).resolve()), "source_kind": src.kind, "model_class": plan.class_name,
                "adapter": plan.adapter_dir is not None, "verified": checked.level})
            publish_dir(staged, final)
    except BaseException:
        remove_staging(staged)
        raise
    return ExportResult(final, [s.filename for s in shards], len(plan.tensors), plan.total_parameters, total,
                        plan.dtype, src.kind, plan.class_name, copied, checked.level, notes)


def _model_plan(tensors: dict[str, SourceTensor], aliases: dict[str, str], src: Source, config_dir: Path,
                dtype: str | None) -> Plan:
    """A full model: the config's class on the meta device says which tensors, in which order."""
    spec = model_spec(config_dir)
    matched = match(tensors, aliases, spec, src.tag_dir)
    refuse_uncovered(src.tag_dir, written_as(matched.tensors))
    written, notes = matched.tensors, list(matched.notes)
    if spec.conversion is not None:  # fused in memory, split on disk (MoE experts): as save_pretrained writes them
        written, converted = apply_conversion(spec.conversion, written)
        notes += converted
    out_dtype = dtype or spec.config_dtype or "fp32"
    if dtype is None:
        notes.append(f"dtype {out_dtype} ({'the config says so' if spec.config_dtype else 'the config names none'}; "
                     "--dtype chooses)")
    return Plan(written, out_dtype, spec.class_name, spec.total_parameters, None, notes)


def _adapter_plan(tensors: dict[str, SourceTensor], lora: list[str], src: Source, config_dir: Path,
                  model_config: str | Path | None, dtype: str | None) -> Plan:
    """A PEFT adapter: its tensors under the names PeftModel.save_pretrained gives them (base weights left out)."""
    places = [Path(model_config) if model_config is not None else None, src.folder, src.tag_dir.parent, config_dir]
    adapter_dir = next((d for d in places if d is not None and (d / ADAPTER_CONFIG).is_file()), None)
    if adapter_dir is None:
        raise CheckpointError(
            f"{src.tag_dir}: holds PEFT adapter tensors ({', '.join(lora[:3])}{', ...' if len(lora) > 3 else ''}) but no "
            f"{ADAPTER_CONFIG} was found beside it or in --model-config: the adapter's config says how its tensors "
            f"apply to the base model. Pass --model-config DIR holding {ADAPTER_CONFIG} (and the base model's config.json)")
    spec = adapter_spec(config_dir, adapter_dir)
    chosen, missing, wrong = {}, [], []
    for saved, name in spec.source_names.items():
        t = tensors.get(name)
        if t is None:
            missing.append(name)
        elif tuple(t.shape) != spec.shapes[saved]:
            wrong.append(f"{name}: {list(t.shape)} in the checkpoint, {list(spec.shapes[saved])} in the adapter config")
        else:
            chosen[saved] = t
    if missing or wrong:
        raise CheckpointError(
            f"{src.tag_dir}: does not match {adapter_dir / ADAPTER_CONFIG} ({spec.peft_type}): "
            + "; ".join(([f"missing {len(missing)} adapter tensor(s): {', '.join(missing[:5])}"] if missing else [])
                        + ([f"shape differs: {'; '.join(wrong[:5])}"] if wrong else []))
            + ". Pass --model-config DIR with the adapter_config.json and base config.json it was trained with; "
            "nothing was written")
    refuse_uncovered(src.tag_dir, written_as(chosen))
    left = len(tensors) - len(chosen)
    notes = [f"PEFT {spec.peft_type} adapter: {len(chosen)} tensors written as {ADAPTER_WEIGHTS} with {adapter_dir / ADAPTER_CONFIG}; "
             f"{left} base-model tensors left out (load with PeftModel.from_pretrained(base_model, DIR))"]
    return Plan(chosen, dtype or "fp32", f"PEFT {spec.peft_type} adapter", spec.total_parameters, adapter_dir, notes)


def _copy_config(staged: Path, raw_config: dict[str, object], out_name: str) -> list[str]:
    """config.json with its ``dtype`` set to what was written (as save_pretrained records the model's
    dtype; a stale one would make from_pretrained cast on load)."""
    cfg = dict(raw_config)
    cfg["dtype"] = out_name
    cfg.pop("torch_dtype", None)
    atomic_write_text(staged / CONFIG_NAME, json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return [CONFIG_NAME]


def _copy_companions(first: Path, second: Path, staged: Path) -> list[str]:
    """generation_config.json and tokenizer files, from ``first`` else ``second``, as they are."""
    copied = []
    for name in COMPANION_FILES:
        f = next((d / name for d in (first, second) if (d / name).is_file() and not (d / name).is_symlink()), None)
        if f is not None:
            copy_regular(f, staged / name)
            copied.append(name)
    return copied
