"""What the model class expects a saved folder to hold, from its ``config.json`` alone: the model is
built on the meta device (no memory, no weights) and asked the questions ``save_pretrained`` asks.

- names and shapes: ``model.state_dict()`` (persistent buffers included, non-persistent ones not);
- tied weights: ``transformers.modeling_utils.remove_tied_weights_from_state_dict``, the function
  ``save_pretrained`` calls, decides which alias is dropped (``lm_head.weight`` when
  ``tie_word_embeddings``);
- tensor order: the state dict's, which ``save_pretrained``'s shard split follows;
- ``total_parameters``: ``model.num_parameters()``, as the index records it.

Model classes whose ``save_pretrained`` renames or splits weights on the way out (transformers'
checkpoint conversion mappings: MoE experts fused in memory, for one) carry that conversion
(``conversion.save_conversion``): ``shapes`` stays the module state dict the checkpoint holds, and
``conversion`` says what is written from it, in save_pretrained's order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardkit.checkpoint.ops.export.conversion import SaveConversion, save_conversion
from shardkit.core.errors import UsageError
from shardkit.core.files import read_regular_text

CONFIG_NAME = "config.json"

#: config ``dtype``/``torch_dtype`` -> ``--dtype``.
CONFIG_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass
class ModelSpec:
    """The tensors a ``from_pretrained`` of this config expects, in ``save_pretrained``'s order."""

    class_name: str
    shapes: dict[str, tuple[int, ...]]
    """Every tensor to write (tied aliases already dropped), in state-dict order."""
    tied_dropped: list[str]
    """Aliases ``save_pretrained`` leaves out (the model re-ties them on load)."""
    tied_to: dict[str, str]
    """``{dropped alias: the name kept}``."""
    non_persistent: set[str] = field(default_factory=set)
    """Buffers the module has but its state dict leaves out (never written)."""
    total_parameters: int = 0
    config_dtype: str | None = None
    """``fp32``/``bf16``/``fp16`` from the config's ``dtype`` (or ``torch_dtype``), None when absent."""
    conversion: SaveConversion | None = None
    """What save_pretrained writes instead of the state dict (fused MoE experts split...); None: the state dict."""


def read_config(config_dir: Path) -> dict[str, Any]:
    path = config_dir / CONFIG_NAME
    try:
        data = json.loads(read_regular_text(path))
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: cannot be read as a model config ({type(exc).__name__}: {exc}); pass --model-config "
                         "DIR with the config.json the model was built from") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise UsageError(f"{path}: not a transformers model config (no 'model_type'); pass --model-config DIR with the "
                         "config.json the model was built from")
    return data


def config_dtype(cfg: dict[str, Any]) -> str | None:
    value = cfg.get("dtype") or cfg.get("torch_dtype")
    return CONFIG_DTYPES.get(str(value).removeprefix("torch.")) if value else None


def meta_model(config_dir: Path) -> Any:
    """The config's model class (its ``architectures[0]``, else ``AutoModelForCausalLM``) built on
    the meta device; refuses model types whose save format is not their state dict."""
    import torch
    import transformers

    raw = read_config(config_dir)
    _check_layer_count(raw, config_dir / CONFIG_NAME)
    try:
        cfg = transformers.AutoConfig.from_pretrained(str(config_dir))
    except Exception as exc:  # transformers' own validation: ValueError, TypeError, its strict-dataclass errors
        raise UsageError(f"{config_dir / CONFIG_NAME}: transformers cannot build a config from it "
                         f"({type(exc).__name__}: {_first_line(exc)}); pass --model-config DIR with the config.json "
                         "the model was built from") from None
    arch = (raw.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    with torch.device("meta"):
        try:
            return cls._from_config(cfg) if cls is not None else transformers.AutoModelForCausalLM.from_config(cfg)
        except Exception as exc:  # a model class refusing its config: ValueError, TypeError, ZeroDivisionError...
            raise UsageError(f"{config_dir / CONFIG_NAME}: transformers cannot build a model from it "
                             f"({type(exc).__name__}: {_first_line(exc)}); pass --model-config DIR with the "
                             "config.json of a causal LM transformers knows, the one the model was built from") from None


# More decoder layers than any released model has by two orders of magnitude: building a typo'd
# "num_hidden_layers": 1000000000 on the meta device would run for hours (the hostile sweep's finding).
MAX_LAYERS = 10_000


def _check_layer_count(raw: dict[str, Any], path: Path) -> None:
    for where, section in (("", raw), ("text_config.", raw.get("text_config"))):
        layers = section.get("num_hidden_layers") if isinstance(section, dict) else None
        if isinstance(layers, int) and not isinstance(layers, bool) and layers > MAX_LAYERS:
            raise UsageError(f"{path}: {where}num_hidden_layers is {layers:,}, more than {MAX_LAYERS:,}: a typo? "
                             "Pass --model-config DIR with the config.json the model was built from")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "no detail"


def model_spec(config_dir: Path) -> ModelSpec:
    """Build the config's model class on the meta device and read off what it expects."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    model = meta_model(config_dir)
    state = model.state_dict()
    kept = remove_tied_weights_from_state_dict(dict(state), model)
    dropped = [n for n in state if n not in kept]
    ptr = {id(model.get_parameter_or_buffer(n)): n for n in kept}
    tied_to = {n: ptr.get(id(model.get_parameter_or_buffer(n)), "") for n in dropped}
    buffers = {n for n, _ in model.named_buffers()}
    return ModelSpec(
        class_name=type(model).__name__,
        shapes={n: tuple(t.shape) for n, t in kept.items()},
        tied_dropped=dropped,
        tied_to=tied_to,
        non_persistent=buffers - set(state),
        total_parameters=model.num_parameters(),
        config_dtype=config_dtype(read_config(config_dir)),
        conversion=save_conversion(model, kept),
    )
