"""A model's shapes from its ``config.json``: the model is built by transformers on the meta device
(``AutoModelForCausalLM.from_config`` under ``torch.device("meta")``), so nothing is downloaded or
allocated. Imports torch and transformers when called; the rest of ``shardkit.estimate`` does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from shardkit.config.loading import load_config
from shardkit.core.errors import ConfigError
from shardkit.estimate.bounds import MAX_PARAM_TENSORS, MAX_PARAMS, MODEL_KEYS, check_config_number, check_model_config
from shardkit.estimate.layers import FULL_BUILD_LAYERS, SAMPLE_LAYERS, extend_layers, layer_list_name, sample_config
from shardkit.estimate.model import ModelShape, ParamShape


def read_model_config(source: str) -> tuple[dict[str, Any], str]:
    """The config dict of a ``config.json`` file or a model folder holding one, and a label for it."""
    p = Path(source)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ConfigError(
                f"{p}: a folder without config.json, so the model's shapes are unknown. Pass the model folder "
                "(the one save_pretrained wrote), its config.json, or --params N for a bare parameter count"
            )
        p = p / "config.json"
    elif not p.exists():
        raise ConfigError(
            f"--model {source}: no such file or folder. Pass a config.json, a model folder holding one, "
            "a Hugging Face model id (needs the hub), or --params N"
        )
    data = load_config(p)  # one ConfigError for missing, binary, malformed or hostile files
    if "model_type" not in data:
        engine_keys = sorted(k for k in data if k in ("zero_optimization", "fsdp", "train_micro_batch_size_per_gpu",
                                                      "optimizer", "bf16", "fp16"))
        why = (f"it looks like an engine config (it has {', '.join(engine_keys)}): pass that as CONFIG"
               if engine_keys else f"keys seen: {', '.join(sorted(data)[:8])}")
        raise ConfigError(
            f"{p}: has no \"model_type\" key, so transformers cannot tell which model it describes ({why}). "
            "Pass the model's config.json (written by save_pretrained) or its folder as --model"
        )
    return data, f"{data['model_type']} from {p}"


def model_shape(source: str, wrap: Sequence[str] = ("LlamaDecoderLayer",)) -> ModelShape:
    """Read ``source`` (a config.json, a model folder or, where the hub is reachable, a model id)."""
    if Path(source).exists() or source.endswith(".json") or source.startswith((".", "/")) or source.count("/") != 1:
        data, label = read_model_config(source)
        return shape_from_config_dict(data, label, wrap)
    return _from_hub(source, wrap)


def _from_hub(model_id: str, wrap: Sequence[str]) -> ModelShape:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_id)
    except Exception as exc:  # offline, gated, missing: one line with the fix
        raise ConfigError(
            f"--model {model_id}: not a local path, and its config could not be fetched from the Hugging Face hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}). Download its config.json and pass that file, "
            "or pass --params N"
        ) from None
    return _shape_from_config(config, f"{model_id} (hub)", wrap)


def shape_from_config_dict(data: dict[str, Any], label: str, wrap: Sequence[str] = ("LlamaDecoderLayer",)) -> ModelShape:
    """The shapes of the model a config dict (a parsed config.json) describes."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # deprecation chatter about config keys is not the user's problem here
    # before transformers sees them: some configs build per-layer lists in __init__ (a 1e9-layer typo
    # would be a list of 1e9 strings)
    check_model_config(data, label)
    kwargs = {k: v for k, v in data.items() if k != "model_type"}
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(data["model_type"], str) or data["model_type"] not in CONFIG_MAPPING:
        raise ConfigError(
            f"{label}: model_type {data['model_type']!r} is unknown to transformers {transformers.__version__}. "
            "Upgrade transformers if the model is newer, or pass --params N"
        )
    try:
        config = AutoConfig.for_model(data["model_type"], **kwargs)
    except Exception as exc:  # noqa: BLE001 - transformers' own validation, any type: one line naming it
        raise ConfigError(
            f"{label}: transformers {transformers.__version__} refuses this {data['model_type']} config "
            f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}). Fix that key, or pass --params N"
        ) from None
    return _shape_from_config(config, label, wrap)


def _shape_from_config(config: Any, label: str, wrap: Sequence[str]) -> ModelShape:
    import torch
    from transformers import AutoModelForCausalLM

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key, bound in MODEL_KEYS.items():  # aliases too (GPT-2's n_layer is num_hidden_layers)
        value = getattr(text, key, None)
        if value is not None:
            alias = getattr(text, "attribute_map", {}).get(key)
            check_config_number(value, f"{alias} ({key})" if alias else key, bound, label)  # the file's own name
    found = getattr(text, "num_hidden_layers", None)
    layers = found if isinstance(found, int) else 0
    sampled = layers > FULL_BUILD_LAYERS
    if sampled:
        sample_config(text, layers)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    except Exception as exc:
        raise ConfigError(
            f"{label}: transformers could not build a causal LM from this config ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else ''}). Only AutoModelForCausalLM models are read; "
            "pass --params N for other models"
        ) from None
    wrap_set = set(wrap)
    unit_of: dict[str, str] = {}
    largest_layer = 0
    for mod_name, module in model.named_modules():
        own = sum(p.numel() for p in module.parameters(recurse=False))
        largest_layer = max(largest_layer, own)
        if type(module).__name__ in wrap_set:
            for p_name, _ in module.named_parameters():
                unit_of[f"{mod_name}.{p_name}" if mod_name else p_name] = mod_name
    params = tuple(
        ParamShape(name=n, numel=p.numel(), dim0=p.shape[0] if p.dim() else 1, unit=unit_of.get(n, ""))
        for n, p in model.named_parameters() if p.requires_grad
    )
    notes = []
    if sampled:
        list_name = layer_list_name(model, SAMPLE_LAYERS)
        if list_name is None:
            raise ConfigError(f"{label}: num_hidden_layers={layers:,}: no list of decoder layers found in the model "
                              f"built with {SAMPLE_LAYERS}, so the others cannot be counted; pass --params N")
        params, note = extend_layers(params, list_name, layers, label)
        notes.append(note)
        text.num_hidden_layers = layers
    elif len(params) > MAX_PARAM_TENSORS:
        raise ConfigError(f"{label}: {len(params):,} parameter tensors, more than {MAX_PARAM_TENSORS:,} (about four "
                          "times the largest published models'); pass --params N for a bare count")
    total = sum(p.numel for p in params)
    if total > MAX_PARAMS.high:
        raise ConfigError(f"{label}: the config describes {total:.3g} parameters, more than {MAX_PARAMS.high:.0e} "
                          f"({MAX_PARAMS.why}). Check its sizes (hidden_size, num_hidden_layers, vocab_size ...)")
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if dtype is not None and str(dtype).replace("torch.", "") != "float32":
        notes.append(f"the config's dtype is {str(dtype).replace('torch.', '')}; the model is taken as built in "
                     "float32 (from_config's default), which only FSDP2's shards and --whole-model-init read")
    if wrap_set and not any(p.unit for p in params):
        notes.append(f"no module of class {', '.join(sorted(wrap_set))} in this model: FSDP2 would shard only the root")
    return ModelShape(
        source=label,
        total_params=total,
        params=params,
        largest_layer_params=largest_layer,
        model_type=getattr(config, "model_type", None),
        hidden_size=getattr(text, "hidden_size", None),
        num_layers=getattr(text, "num_hidden_layers", None),
        intermediate_size=getattr(text, "intermediate_size", None),
        vocab_size=getattr(text, "vocab_size", None),
        notes=tuple(notes),
    )
