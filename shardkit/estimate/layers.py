"""A deep model's parameters without building every layer: build a sample of the decoder layers, find the
pattern they repeat in, and count the rest.

transformers builds a model layer by layer (milliseconds each, even on the meta device), so a config.json
with ``"num_hidden_layers": 100000`` took minutes. Decoder layers repeat: all alike (Llama), or in a short
period (Gemma's sliding/full attention every 6, Jamba's attention every 8, MoE every k), after a few
different ones (DeepSeek's first dense layers). Above :data:`FULL_BUILD_LAYERS` the model is built with
:data:`SAMPLE_LAYERS` layers; the second half of the sample must repeat with a period of at most
:data:`MAX_PERIOD` layers, and layers past the sample continue that period. A model whose sample does not
repeat is refused, naming why (its per-layer lists make later layers unknowable from a sample).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from shardkit.core.errors import ConfigError
from shardkit.estimate.bounds import MAX_PARAM_TENSORS
from shardkit.estimate.model import ParamShape

#: Up to this many layers the model is built whole (every real model: the deepest causal LMs have ~130).
FULL_BUILD_LAYERS = 128
#: Layers built to find the pattern of a deeper model (about 0.3 s on the meta device).
SAMPLE_LAYERS = 64
#: The longest period looked for (published hybrids repeat every 2-8 layers).
MAX_PERIOD = 16
_HOLE = "\0layer\0"


def sample_config(text_config: Any, layers: int) -> None:
    """Set ``text_config`` (a transformers config, changed in place) to build ``SAMPLE_LAYERS`` of its
    ``layers``: per-layer lists of that length (layer_types, no_rope_layers ...) are cut to the sample."""
    text_config.num_hidden_layers = SAMPLE_LAYERS
    for key, value in list(vars(text_config).items()):
        if isinstance(value, (list, tuple)) and len(value) == layers:
            setattr(text_config, key, type(value)(value[:SAMPLE_LAYERS]))


def layer_list_name(model: Any, layers: int) -> str | None:
    """The dotted name of the ModuleList holding the ``layers`` decoder layers (``model.layers``)."""
    import torch

    found = [name for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == layers]
    return next((n for n in found if n.endswith("layers")), found[0] if found else None)


def extend_layers(params: tuple[ParamShape, ...], list_name: str, layers: int, label: str) -> tuple[tuple[ParamShape, ...], str]:
    """``params`` of a model built with SAMPLE_LAYERS layers under ``list_name``, extended to ``layers`` by the
    period the sample repeats in, and a note saying so. ConfigError when the sample does not repeat or the
    whole model would have more than MAX_PARAM_TENSORS tensors."""
    prefix = f"{list_name}."
    per_layer: list[list[ParamShape]] = [[] for _ in range(SAMPLE_LAYERS)]
    last = -1
    for i, p in enumerate(params):
        if p.name.startswith(prefix):
            index = int(p.name[len(prefix):].split(".", 1)[0])
            per_layer[index].append(p)
            last = i

    def signature(i: int) -> tuple[tuple[str, int, int, str], ...]:
        head = f"{prefix}{i}"
        return tuple((p.name[len(head):], p.numel, p.dim0, _in_layer(p.unit, head, _HOLE)) for p in per_layer[i])

    sigs = [signature(i) for i in range(SAMPLE_LAYERS)]
    half = SAMPLE_LAYERS // 2
    period = next((k for k in range(1, MAX_PERIOD + 1)
                   if all(sigs[i] == sigs[i - k] for i in range(half, SAMPLE_LAYERS))), None)
    if period is None or last < 0:
        raise ConfigError(
            f"{label}: num_hidden_layers={layers:,}: the first {SAMPLE_LAYERS} decoder layers do not repeat with a period "
            f"of at most {MAX_PERIOD}, so the other {layers - SAMPLE_LAYERS:,} cannot be counted from them, and building "
            f"more than {FULL_BUILD_LAYERS} layers one by one is too slow. Check num_hidden_layers, or pass --params N")
    start = SAMPLE_LAYERS - period
    per_period = sum(len(sigs[start + k]) for k in range(period))
    full, extra = divmod(layers - SAMPLE_LAYERS, period)
    added = full * per_period + sum(len(sigs[start + k]) for k in range(extra))
    if len(params) + added > MAX_PARAM_TENSORS:
        raise ConfigError(
            f"{label}: num_hidden_layers={layers:,} gives {len(params) + added:,} parameter tensors, more than "
            f"{MAX_PARAM_TENSORS:,} (about four times the largest published models'). Check num_hidden_layers, "
            "or pass --params N for a bare count")
    more: list[ParamShape] = []
    for j in range(SAMPLE_LAYERS, layers):
        src = start + (j - SAMPLE_LAYERS) % period
        head, new = f"{prefix}{src}", f"{prefix}{j}"
        more += [replace(p, name=new + p.name[len(head):], unit=_in_layer(p.unit, head, new)) for p in per_layer[src]]
    note = (f"layers {SAMPLE_LAYERS}-{layers - 1} counted, not built: the first {SAMPLE_LAYERS} built on the meta device "
            f"repeat every {period} layer(s) from layer {half} on, and the rest are taken to continue that pattern")
    return params[:last + 1] + tuple(more) + params[last + 1:], note


def _in_layer(unit: str, head: str, new: str) -> str:
    """``unit`` with the layer ``head`` (``model.layers.3``) replaced by ``new`` when it lies in that layer."""
    return new + unit[len(head):] if unit == head or unit.startswith(head + ".") else unit
