"""What ``SRC`` is: a ZeRO-3 checkpoint, an FSDP2/DCP checkpoint, or a Hugging Face Trainer
``checkpoint-N`` (or ``output_dir``: its newest ``checkpoint-N``) holding either; and where the
model's ``config.json`` is.

A Trainer's DeepSpeed ``checkpoint-N`` *is* the DeepSpeed root (``hf_trainer.folder``); its FSDP
``checkpoint-N`` (``hf_trainer.fsdp_files``) is kind ``fsdp1-sharded`` under ``SHARDED_STATE_DICT``
(the tensors' folder is the model DCP folder ``pytorch_model_fsdp_0/``, ``optimizer_0/`` beside it)
and ``fsdp1-full`` under ``FULL_STATE_DICT`` (the ``checkpoint-N`` itself), both read by
``readers.fsdp1``; per-rank SHARDED files (``use_dcp=False``) are ``fsdp1-sharded-bins`` (ShardedTensors)
or ``fsdp2-sharded-bins`` (DTensors) (``readers.fsdp1_bins``), LOCAL_STATE_DICT files are refused. The config is looked for in ``--model-config``
first, then in the folder holding the tag (the Trainer's ``checkpoint-N``, which holds the
``config.json``, ``generation_config.json`` and tokenizer files the Trainer saved), then the tag
folder itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from shardkit.checkpoint.dcp.plain_metadata import METADATA_NAME
from shardkit.checkpoint.hf_trainer.folder import checkpoint_dirs
from shardkit.checkpoint.hf_trainer.fsdp_files import fsdp_layout, per_rank_kind, read_by_shardkit, unread_why
from shardkit.checkpoint.layout.torch_files import HF_WEIGHTS, is_accelerate_state
from shardkit.checkpoint.ops.export.model_spec import CONFIG_NAME
from shardkit.checkpoint.readers.fsdp1 import MODEL_FILE as FSDP_FULL_MODEL
from shardkit.checkpoint.readers.universal import universal_tag_dir
from shardkit.checkpoint.zero3.files import RANK_FILE, resolve_tag_dir
from shardkit.checkpoint.zero12.files import is_zero12_folder
from shardkit.core.errors import CheckpointError, UsageError
from shardkit.storage.tags import LATEST_NAME, STAGING_PREFIX, latest_tag

#: Files ``save_pretrained`` and tokenizers write beside the weights, copied when present.
COMPANION_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "vocab.txt",
    "merges.txt", "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json",
)


@dataclass
class Source:
    """A resolved ``SRC``."""

    kind: str
    """``zero3``, ``zero12``, ``dcp``, ``fsdp1-sharded``... (a key of ``readers.registry.READERS``)."""
    tag_dir: Path
    """The folder holding the tensors (ZeRO-3 tag folder, or DCP folder with ``.metadata``)."""
    folder: Path
    """The folder the user's SRC designates after output_dir resolution (root, tag or checkpoint-N)."""
    notes: list[str] = field(default_factory=list)


def resolve_source(path: str | Path) -> Source:
    """Decide what ``path`` is; CheckpointError naming it (and what it holds) when it is nothing exportable."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: checkpoint path does not exist")
    if p.is_file():
        if p.name in (METADATA_NAME, LATEST_NAME) or RANK_FILE.match(p.name):
            p = p.parent
        else:
            raise CheckpointError(f"{p}: is a file; pass the checkpoint folder (a DeepSpeed or FSDP2 checkpoint "
                                  "folder, or a Trainer checkpoint-N/output_dir)")
    if p.name.startswith(STAGING_PREFIX):
        raise CheckpointError(f"{p}: is the staging folder of a save that never completed; pass a complete checkpoint")
    notes: list[str] = []
    found = checkpoint_dirs(p) if not (p / LATEST_NAME).exists() else []
    if found:
        newest = found[-1][1]
        older = f"; also there: {', '.join(d.name for _, d in found[:-1])}" if found[:-1] else ""
        notes.append(f"{p} is a Trainer output_dir: exporting {newest.name}, its newest checkpoint{older}. Pass a "
                     "checkpoint-N folder to choose another")
        p = newest
    universal = universal_tag_dir(p)
    if universal is not None:  # ds_to_universal output, or the root whose latest_universal names it
        return Source("universal", universal, p, notes)
    if (p / METADATA_NAME).exists():  # of any kind: a FIFO there is named by the DCP read
        return Source("dcp", p, p, notes)
    fsdp = fsdp_layout(p)
    if fsdp is not None:
        if fsdp.state_dict_type == "SHARDED_STATE_DICT":  # model DCP + optimizer_0/ (readers.fsdp1)
            return Source("fsdp1-sharded", p / fsdp.model[0].rstrip("/"), p, notes)
        if fsdp.state_dict_type == "FULL_STATE_DICT" and (p / FSDP_FULL_MODEL).is_file():
            return Source("fsdp1-full", p, p, notes)  # pytorch_model_fsdp.bin (+ optimizer.bin): readers.fsdp1
        if read_by_shardkit(fsdp, p):  # per-rank SHARDED_STATE_DICT files (use_dcp=False): readers.fsdp1_bins
            return Source(per_rank_kind(p / fsdp.model[0]), p, p, notes)
        raise CheckpointError(f"{p}: an FSDP Trainer checkpoint saved with {fsdp.state_dict_type} ({', '.join(fsdp.model)}): "
                              f"{unread_why(fsdp, p)}. Nothing was written")
    tag = latest_tag(p) if (p / LATEST_NAME).exists() else None
    if tag is not None and (p / tag / METADATA_NAME).exists():
        return Source("dcp", p / tag, p, notes)
    if tag is None and is_accelerate_state(p):  # Accelerator.save_state in one process: readers.accelerate_state
        return Source("accelerate-state", p, p, notes)
    full = [n for n in HF_WEIGHTS if (p / n).is_file()]
    if full and tag is None and not any(RANK_FILE.match(e.name) for e in p.iterdir()):
        raise UsageError(f"{p}: holds full weights already ({', '.join(full)}: a save_pretrained folder, or a Trainer "
                         "checkpoint saved without DeepSpeed or sharded FSDP): from_pretrained loads it as it is; "
                         "there is nothing to export")
    if is_zero12_folder(p / tag if tag is not None else p):  # ZeRO-1/2: a root, a Trainer checkpoint-N, a tag
        return Source("zero12", p / tag if tag is not None else p, p, notes)
    tag_dir, _ = resolve_tag_dir(p)  # ZeRO-3, or one CheckpointError saying what the folder is not
    return Source("zero3", tag_dir, p, notes)


def find_config_dir(source: Source, model_config: str | Path | None) -> Path:
    """The folder whose ``config.json`` describes the model; UsageError naming ``--model-config`` when none."""
    if model_config is not None:
        d = Path(model_config)
        if d.is_file() and d.name == CONFIG_NAME:
            d = d.parent
        if not (d / CONFIG_NAME).is_file():
            raise UsageError(f"--model-config {model_config}: no {CONFIG_NAME} there; pass the folder holding the "
                             "model's config.json (the one you load the base model from, or a save_pretrained folder)")
        return d
    looked = []
    for d in (source.tag_dir.parent, source.tag_dir, source.folder):
        if d in looked:
            continue
        looked.append(d)
        if (d / CONFIG_NAME).is_file():
            return d
    raise UsageError(
        f"{source.folder}: no {CONFIG_NAME} found (looked in {', '.join(str(d) for d in looked)}): export needs the "
        "model's config to name, check and order the tensors, and from_pretrained needs it in the folder. Pass "
        "--model-config DIR, a folder holding the config.json the model was built from (a Trainer checkpoint-N holds "
        "one)")
