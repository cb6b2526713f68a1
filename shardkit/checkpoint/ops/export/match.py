"""Pair the source's tensors with the names the model class expects, or refuse naming what differs.

Source names are what the training engine recorded: DeepSpeed's ``module.`` prefix (a model wrapped
before ``deepspeed.initialize``; stripped only when every name has it, as ``convert`` does) and
torch's wrapper segments (``_orig_mod``, ``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``)
are removed. Tied aliases follow ``save_pretrained``: the alias it drops is not written, and a tied
weight stored only under its alias (ZeRO-3 keeps the first name ``named_parameters`` yields) is
written under the name kept. Anything missing, unexpected or of another shape is refused, all named
at once: a folder that loads with randomly initialized weights is worse than none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardkit.checkpoint.model.tensors import SourceTensor
from shardkit.checkpoint.ops.convert.names import DEEPSPEED_PREFIX, TORCH_WRAPPER_SEGMENTS, strip_wrapper_segments
from shardkit.checkpoint.ops.export.model_spec import ModelSpec
from shardkit.core.errors import CheckpointError

#: Name parts only PEFT adapters have (``lora_A``/``lora_B`` of LoRA layers, their dropout/magnitude).
ADAPTER_MARKERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


@dataclass
class Matched:
    """The tensors to write, by output name in the model's order, and what the user should know."""

    tensors: dict[str, SourceTensor]
    notes: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    """Source tensors not written (tied aliases save_pretrained drops, non-persistent buffers)."""


def _clean(name: str, strip_module: bool) -> str:
    return strip_wrapper_segments(name[len(DEEPSPEED_PREFIX):] if strip_module else name)


def normalize(tensors: dict[str, SourceTensor], aliases: dict[str, str]) -> tuple[dict[str, SourceTensor], dict[str, str], list[str]]:
    """Engine and wrapper prefixes removed from every name; refuses two names that become one."""
    names = [*tensors, *aliases]
    strip = bool(names) and all(n.startswith(DEEPSPEED_PREFIX) for n in names)
    out: dict[str, SourceTensor] = {}
    for name, t in tensors.items():
        new = _clean(name, strip)
        if new in out:
            raise CheckpointError(f"source tensors {out[new].name!r} and {name!r} both become {new!r} once engine and "
                                  "wrapper prefixes are removed; the checkpoint holds two models. Export one of them")
        out[new] = t
    new_aliases = {_clean(a, strip): _clean(h, strip) for a, h in aliases.items()}
    notes = [f"removed DeepSpeed's '{DEEPSPEED_PREFIX}' prefix from every name (the model was wrapped before "
             "deepspeed.initialize)"] if strip else []
    if any(n != _clean(n, False) for n in names):
        notes.append(f"removed torch wrapper segments ({', '.join(TORCH_WRAPPER_SEGMENTS)}) from names")
    return out, new_aliases, notes


def adapter_names(names: list[str]) -> list[str]:
    """The names only a PEFT adapter has (``lora_A``, ``lora_B`` ... as a dotted component)."""
    return [n for n in names if any(m in n.split(".") for m in ADAPTER_MARKERS)]


def match(tensors: dict[str, SourceTensor], aliases: dict[str, str], spec: ModelSpec, source: object) -> Matched:
    """The tensors to write for ``spec``, from ``tensors`` (normalized names) and ``aliases``."""
    chosen: dict[str, SourceTensor] = {}
    used: set[str] = set()
    missing: list[str] = []
    wrong: list[str] = []
    notes: list[str] = []
    partners = {kept: alias for alias, kept in spec.tied_to.items()}
    for name, shape in spec.shapes.items():
        holder = name if name in tensors else aliases.get(name)
        if holder not in tensors and partners.get(name) in tensors:
            holder = partners[name]  # a tied weight stored only under the alias save_pretrained drops
            notes.append(f"{name} written from {holder} (tied weights; the checkpoint stored it under that name)")
        if holder is None or holder not in tensors:
            missing.append(name)
            continue
        t = tensors[holder]
        used.add(holder)
        if tuple(t.shape) != tuple(shape):
            wrong.append(f"{name}: {list(t.shape)} in the checkpoint, {list(shape)} in {spec.class_name}")
            continue
        chosen[name] = t
    dropped, unexpected = [], []
    for name in tensors:
        if name in used:
            continue
        if name in spec.tied_dropped or name in spec.non_persistent:
            dropped.append(name)
        else:
            unexpected.append(name)
    dropped += [a for a in aliases if a in spec.tied_dropped and a not in tensors]  # a tie the reader recorded
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s) {spec.class_name} needs: {', '.join(missing[:5])}"
                        f"{' ...' if len(missing) > 5 else ''} (from_pretrained would initialize them randomly)")
    if unexpected:
        problems.append(f"{len(unexpected)} tensor(s) {spec.class_name} has no place for: {', '.join(unexpected[:5])}"
                        f"{' ...' if len(unexpected) > 5 else ''} (they would be dropped on load)")
    if wrong:
        problems.append(f"shape differs for {len(wrong)} tensor(s): {'; '.join(wrong[:5])}")
    if problems:
        raise CheckpointError(
            f"{source}: does not match the model config ({spec.class_name}): {'; '.join(problems)}. The config is not "
            "the one this checkpoint was trained with (pass --model-config DIR with the right config.json), or the "
            "checkpoint is partial (tensor/pipeline parallel shards, a failed save); nothing was written")
    if dropped:
        notes.append(f"not written, as save_pretrained leaves them out: {', '.join(sorted(dropped))}")
    return Matched(chosen, notes, dropped)
