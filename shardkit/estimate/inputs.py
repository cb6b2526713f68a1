"""From what a user types to the estimate's inputs: the model (a config.json, a folder, a hub id or a
parameter count), the engine config (a file, or the flags of ``shardkit config``) and the run."""

from __future__ import annotations

from typing import Any, Sequence

from shardkit.config.loading import load_config
from shardkit.config.view import as_int
from shardkit.core.errors import UsageError
from shardkit.estimate.meta_model import model_shape
from shardkit.estimate.model import ModelShape, from_count
from shardkit.estimate.units import parse_count


def resolve_model(model: str | None, params: str | None, largest_layer: str | None = None,
                  wrap: Sequence[str] = ("LlamaDecoderLayer",)) -> ModelShape:
    """The model named by --model (built on the meta device) or --params (a bare count)."""
    if model and params:
        raise UsageError(f"--model {model} and --params {params}: give one (a config.json/model folder, or a count)")
    if not model and not params:
        raise UsageError("no model: pass --model CONFIG_JSON_OR_FOLDER (built on the meta device, nothing "
                         "downloaded) or --params N (e.g. --params 6.8e9 --largest-layer 131M)")
    if largest_layer and not params:
        raise UsageError(f"--largest-layer {largest_layer}: only with --params (a config.json gives every layer)")
    if params:
        layer = parse_count(largest_layer, "--largest-layer") if largest_layer else 0
        total = parse_count(params, "--params")
        if layer > total:
            raise UsageError(f"--largest-layer {largest_layer} is more than --params {params}: one module cannot hold "
                             "more parameters than the whole model. Pass the parameters of its largest module")
        return from_count(total, layer)
    return model_shape(model or "", wrap)


def read_engine_config(path: str) -> dict[str, Any]:
    """A DeepSpeed or FSDP2 config file as a dict (one ConfigError for every unusable file)."""
    return load_config(path)


def micro_batch_of(cfg: dict[str, Any]) -> int | None:
    """train_micro_batch_size_per_gpu of a DeepSpeed config or train.micro_batch of an FSDP2 one, if set."""
    train = cfg.get("train")
    if isinstance(train, dict) and as_int(train.get("micro_batch")):
        return as_int(train.get("micro_batch"))
    return as_int(cfg.get("train_micro_batch_size_per_gpu"))


def wrap_of(cfg: dict[str, Any]) -> list[str] | None:
    """The FSDP2 wrap classes of a shardkit FSDP2 config, if it names them."""
    fsdp = cfg.get("fsdp")
    wrap = fsdp.get("wrap") if isinstance(fsdp, dict) else None
    return [w for w in wrap if isinstance(w, str)] if isinstance(wrap, list) else None
