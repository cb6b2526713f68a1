"""What ``save_pretrained`` writes for model classes whose files are not their module state dict,
asked of transformers itself and turned into byte ranges where the bytes allow it.

transformers 5 fuses some weights in memory and splits them back on save through its checkpoint
conversion mappings (``transformers.conversion_mapping``; ``save_pretrained`` calls
``core_model_loading.revert_weight_conversion``): Mixtral's ``mlp.experts.gate_up_proj`` (one 3-D
tensor) is written as ``block_sparse_moe.experts.{e}.w1.weight``/``w3.weight``, Qwen-MoE and DeepSeek
likewise. A checkpoint of such a model (ZeRO-3, DCP) holds the in-memory names.

``save_conversion`` builds the model class's own mapping (``get_model_conversion_mapping``, reversed
with each transform's ``reverse_transform``, grouped by ``apply_converters``/``apply_renamings`` as
``revert_weight_conversion`` groups them) and runs every group's reverse operations on meta tensors
(no memory) to learn the names and shapes written, while following each output as a strided window
onto its source tensor. The whole result is then checked against ``revert_weight_conversion`` itself
(names, order, shapes): a transformers release that groups differently is refused, never guessed.

``apply_conversion`` turns the checkpoint's tensors into the written ones:

- a rename, or a chunk/split/select along a dim (``Chunk``, ``Split``, ``SplitModulelist``: every MoE
  expert split): the output is a window onto the source's bytes, expressed as ``Piece``s (streaming,
  nothing loaded); an expert's rows are one contiguous run of the fused tensor;
- a transpose, concat, stack, interleave or rope permutation (``LOADED_OPS``): the bytes move, so the
  group's source tensors are read and transformers' own reverse converter runs on them
  (``SourceTensor.load``: that group in memory, never the model), and the notes say so;
- any other operation (quantization, vision-specific fusions) is refused by name before anything is
  written.
"""

from __future__ import annotations

import math
from copy import deepcopy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardkit.checkpoint.model.tensors import Piece, SourceTensor, read_slice
from shardkit.core.errors import CheckpointError
from shardkit.storage.torch_load import ITEMSIZE

if TYPE_CHECKING:
    import torch

#: Reverse operations that only narrow or select along a dim: the output's bytes stay where they are.
VIEW_OPS = frozenset({"Chunk", "Split", "SplitModulelist"})
#: Reverse operations that move bytes (pure functions of the tensors and the config): run by
#: transformers on the loaded group.
LOADED_OPS = frozenset({"Transpose", "Concatenate", "MergeModulelist", "Interleave", "PermuteForRope"})
#: A window needing more contiguous runs than this is read whole instead (a narrow on the last dim
#: of a large tensor would otherwise be millions of tiny copies).
MAX_RUNS = 1 << 16


@dataclass(frozen=True)
class View:
    """A strided window onto one source tensor (element offset and strides in its row-major layout)."""

    source: str
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @classmethod
    def whole(cls, source: str, shape: tuple[int, ...]) -> View:
        strides, step = [], 1
        for size in reversed(shape):
            strides.append(step)
            step *= size
        return cls(source, 0, shape, tuple(reversed(strides)))

    def narrow(self, dim: int, start: int, length: int) -> View:
        shape = list(self.shape)
        shape[dim] = length
        return View(self.source, self.offset + start * self.strides[dim], tuple(shape), self.strides)

    def select(self, dim: int, index: int) -> View:
        return View(self.source, self.offset + index * self.strides[dim], self.shape[:dim] + self.shape[dim + 1:],
                    self.strides[:dim] + self.strides[dim + 1:])

    def runs(self) -> list[tuple[int, int]] | None:
        """``(first source element, count)`` per contiguous run in row-major output order; None when
        there are more than ``MAX_RUNS``."""
        dims = [(n, s) for n, s in zip(self.shape, self.strides) if n != 1]
        merged: list[list[int]] = []
        for n, s in reversed(dims):  # merge a dim into the inner one when they are laid out back to back
            if merged and s == merged[-1][0] * merged[-1][1]:
                merged[-1][0] *= n
            else:
                merged.append([n, s])
        merged.reverse()
        if not merged:
            return [(self.offset, 1)]
        run = merged[-1][0] if merged[-1][1] == 1 else 1
        outer = merged[:-1] if run > 1 else merged
        if math.prod(n for n, _ in outer) > MAX_RUNS:
            return None
        starts = [self.offset]
        for n, s in outer:
            starts = [b + i * s for b in starts for i in range(n)]
        return [(b, run) for b in starts]


@dataclass(frozen=True)
class _Group:
    """One reversed converter of transformers and the tensors it takes, to re-run on loaded tensors."""

    converter: Any
    members: tuple[tuple[str, str, str], ...]
    """``(grouping key, source name, source pattern)`` in the order revert_weight_conversion adds them."""
    first: str
    ops: tuple[str, ...]


@dataclass(frozen=True)
class Derived:
    """One tensor ``save_pretrained`` writes, and how it is made of the module's tensors."""

    name: str
    shape: tuple[int, ...]
    view: View | None
    """The window onto one source tensor; None when the bytes move (``group`` re-runs transformers)."""
    group: _Group | None = None
    key: str = ""
    """The output's key in the group converter's result (before the renamings)."""


@dataclass
class SaveConversion:
    """The model class's save-time conversion: every written tensor, in save_pretrained's order."""

    outputs: dict[str, Derived]
    model: Any
    """The meta model (reverse operations read parameter shapes and the config from it)."""
    ops: list[str] = field(default_factory=list)
    """Reverse operation names used, for the notes."""


def _op_name(op: Any) -> str:
    return type(op).__name__


def save_conversion(model: Any, state: dict[str, Any]) -> SaveConversion | None:
    """The conversion ``save_pretrained`` applies to ``state`` (meta tensors, tied aliases already
    removed) for ``model`` (built on the meta device); None when it writes the state dict as it is."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        PrefixChange,
        WeightConverter,
        WeightRenaming,
        apply_converters,
        apply_renamings,
        dot_natural_key,
        revert_weight_conversion,
    )

    # As revert_weight_conversion for a model not loaded by from_pretrained: no legacy renamings, no
    # PrefixChange (it would add a prefix the model never had).
    transforms = [t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)]
    if not transforms:
        return None
    reverse = [t.reverse_transform() for t in transforms[::-1]]
    renamings = [t for t in reverse if isinstance(t, WeightRenaming)]
    converters = [t for t in reverse if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}

    groups: dict[str, tuple[Any, list[tuple[str, str, str]]]] = {}
    renamed: dict[str, str] = {}
    for key in sorted(state, key=dot_natural_key):
        target, pattern = apply_converters(key, converters)
        if pattern is not None:
            groups.setdefault(target, (by_pattern[pattern], []))[1].append((target, key, pattern))
            renamed.setdefault(target, "")
        else:
            renamed[apply_renamings(key, renamings)] = key
    outputs: dict[str, Derived] = {}
    used: set[str] = set()
    for target, key in renamed.items():
        if not key:  # a converter group, in the order revert_weight_conversion meets it
            converter, members = groups[target]
            group = _Group(converter, tuple(members), target, tuple(_op_name(op) for op in converter.operations))
            used.update(group.ops)
            for d in _group_outputs(group, state, model):
                name = apply_renamings(d.name, renamings)
                outputs[name] = Derived(name, d.shape, d.view, d.group, d.key)
        else:
            outputs[target] = Derived(target, tuple(state[key].shape), View.whole(key, tuple(state[key].shape)))
    expected = revert_weight_conversion(model, dict(state))
    got = [(n, d.shape) for n, d in outputs.items()]
    if got != [(n, tuple(t.shape)) for n, t in expected.items()]:
        raise CheckpointError(
            f"{type(model).__name__}: shardkit's reading of transformers' save-time conversion differs from what "
            "revert_weight_conversion writes (names, order or shapes); this transformers release changed how it "
            "groups the conversion. Load the checkpoint into the model and call save_pretrained, and report the "
            "transformers version to shardkit")
    return SaveConversion(outputs, model, sorted(used))


def _group_outputs(group: _Group, state: dict[str, Any], model: Any) -> list[Derived]:
    """Names and shapes from transformers' own ``convert`` on meta tensors; each output's window
    from stepping the same operations."""
    unknown = [op for op in group.ops if op not in VIEW_OPS | LOADED_OPS]
    if unknown:
        raise CheckpointError(
            f"{type(model).__name__}: save_pretrained converts {group.first!r} with {', '.join(unknown)}, an operation "
            f"shardkit export does not know how to apply to checkpoint bytes (it knows {', '.join(sorted(VIEW_OPS))} "
            f"as byte ranges and {', '.join(sorted(LOADED_OPS))} in memory); nothing was written. Load the "
            "checkpoint into the model and call save_pretrained")
    named = deepcopy(group.converter)
    for target, key, pattern in group.members:
        named.add_tensor(target, key, pattern, state[key])
    result = named.convert(group.first, model=model, config=model.config)
    final = [(n, tuple((t[0] if isinstance(t, list) else t).shape)) for n, t in result.items()]
    keys = list(result)
    if any(op in LOADED_OPS for op in group.ops):
        return [Derived(n, shape, None, group, n) for n, shape in final]
    views = _step_views(group, state, model)
    if [v.shape for v in views] != [shape for _, shape in final]:
        raise CheckpointError(f"{type(model).__name__}: {group.first!r}: the windows shardkit followed through "
                              f"{', '.join(group.ops)} do not have the shapes transformers writes; nothing was written. "
                              "Report the transformers version to shardkit")
    return [Derived(n, shape, v, None, k) for (n, shape), v, k in zip(final, views, keys)]


def _step_views(group: _Group, state: dict[str, Any], model: Any) -> list[View]:
    """Run the group's operations one by one on meta tensors, following each value as a ``View``."""
    conv = deepcopy(group.converter)
    values: dict[str, list[Any]] = {}
    windows: dict[str, list[View]] = {}
    for _, key, pattern in group.members:
        values.setdefault(pattern, []).append(state[key])
        windows.setdefault(pattern, []).append(View.whole(key, tuple(state[key].shape)))
    current: dict[str, Any] = dict(values)
    for op in conv.operations:
        before = [(k, windows[k]) for k in current]
        out = op.convert(current, source_patterns=conv.source_patterns, target_patterns=conv.target_patterns,
                         full_layer_name=group.first, model=model, config=model.config, missing_keys=None)
        shapes = [tuple((t[0] if isinstance(t, list) else t).shape) for t in out.values()]
        produced = _apply_view_op(op, before, shapes)
        windows = {k: [v] for k, v in zip(out, produced)}
        current = out
    return [w[0] for w in windows.values()]


def _apply_view_op(op: Any, before: list[tuple[str, list[View]]], shapes: list[tuple[int, ...]]) -> list[View]:
    """The windows an operation of ``VIEW_OPS`` yields, in its output order (shapes as it returned them)."""
    dim = int(op.dim)
    if _op_name(op) == "SplitModulelist":  # each input tensor, each index along dim, in input order
        out = [w[0].select(dim, i) for _, w in before for i in range(w[0].shape[dim])]
    else:  # Chunk / Split: consecutive pieces of the one input along dim, sized as returned
        if len(before) != 1:
            raise CheckpointError(f"{_op_name(op)} of {len(before)} tensors at once: not a split shardkit follows")
        src, out, at = before[0][1][0], [], 0
        for shape in shapes:
            out.append(src.narrow(dim, at, shape[dim]))
            at += shape[dim]
    if [v.shape for v in out] != shapes:
        raise CheckpointError(f"{_op_name(op)}(dim={dim}): the windows followed have shapes {[v.shape for v in out]}, "
                              f"transformers returned {shapes}; nothing was written")
    return out


def apply_conversion(conv: SaveConversion, tensors: dict[str, SourceTensor]) -> tuple[dict[str, SourceTensor], list[str]]:
    """The tensors ``save_pretrained`` writes, by name in its order, from the module's ``tensors``."""
    out: dict[str, SourceTensor] = {}
    loaded: list[str] = []
    moving: set[str] = set()
    split = renamed = 0
    for name, d in conv.outputs.items():
        if d.view is None:
            assert d.group is not None  # a Derived has a window or a group (save_conversion builds them so)
            out[name] = _loaded(d, conv.model, tensors)
            loaded.append(name)
            moving.update(op for op in d.group.ops if op in LOADED_OPS)
            continue
        src = tensors[d.view.source]
        if d.view == View.whole(d.view.source, tuple(src.shape)):
            out[name] = src
            renamed += name != d.view.source
            continue
        split += 1
        out[name] = _windowed(src, d.view, name)
    notes = [f"written as save_pretrained writes {type(conv.model).__name__} (transformers' save-time conversion: "
             f"{', '.join(conv.ops) or 'renames'}): {len(tensors)} module tensors -> {len(out)} tensors, {split} of them "
             f"byte ranges of fused tensors, {renamed} renamed"]
    if loaded:
        notes.append(f"{len(loaded)} tensor(s) are not byte ranges of one stored tensor (their conversion moves bytes: "
                     f"{', '.join(sorted(moving))}"
                     f"), so each is built in memory by transformers from its group's tensors: {', '.join(loaded[:3])}"
                     f"{' ...' if len(loaded) > 3 else ''}")
    return out, notes


def _windowed(src: SourceTensor, view: View, name: str) -> SourceTensor:
    """``view`` of ``src`` as pieces of its files; a loader where ``src`` is not pieces or too scattered."""
    runs = view.runs() if src.load is None else None
    if runs is None:
        return SourceTensor(src.name, src.dtype, view.shape, load=lambda: _strided(_read(src), view))
    pieces, at = [], 0
    ordered = sorted(src.pieces, key=lambda p: p.start)
    size = ITEMSIZE[src.dtype]
    for first, count in runs:
        for p in ordered:  # the source pieces this run overlaps, clipped to it
            lo, hi = max(first, p.start), min(first + count, p.start + p.numel)
            if lo < hi:
                pieces.append(Piece(p.file, p.offset + (lo - p.start) * size, at + lo - first, hi - lo))
        at += count
    return SourceTensor(f"{src.name} (for {name})", src.dtype, view.shape, pieces)


def _strided(t: torch.Tensor, view: View) -> torch.Tensor:
    return t.reshape(-1).as_strided(view.shape, view.strides, view.offset).contiguous()


def _loaded(d: Derived, model: Any, tensors: dict[str, SourceTensor]) -> SourceTensor:
    group = d.group
    assert group is not None
    members = [tensors[key] for _, key, _ in group.members]
    first = members[0]

    def load() -> torch.Tensor:
        conv = deepcopy(group.converter)
        for (target, key, pattern), t in zip(group.members, members):
            conv.add_tensor(target, key, pattern, _read(t))
        value = conv.convert(group.first, model=model, config=model.config)[d.key]
        tensor: torch.Tensor = value[0] if isinstance(value, list) else value
        return tensor

    return SourceTensor(f"{first.name} (+{len(members) - 1} more, for {d.name})", first.dtype, d.shape, load=load)


def _read(t: SourceTensor) -> torch.Tensor:
    """The whole source tensor in memory (only for a conversion that moves bytes)."""
    return read_slice(t, 0, t.numel, "the file is truncated; restore it from a good copy").reshape(t.shape)

