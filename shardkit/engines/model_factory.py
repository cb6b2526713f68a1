"""Small models built from a config (no downloads) and the `pkg.module:factory` model spec."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable

from shardkit.core.errors import UsageError

if TYPE_CHECKING:
    import torch

# name -> LlamaConfig kwargs. "160m" is the benchmark model named in the issues.
LLAMA_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=512),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, vocab_size=4096),
    "40m": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8, vocab_size=16000),
    "160m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, vocab_size=32000),
}


def tiny_llama(size: str = "tiny", seed: int = 0) -> "torch.nn.Module":
    """A randomly initialized LlamaForCausalLM of a named size, deterministic for a given seed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if size not in LLAMA_SIZES:
        raise UsageError(f"unknown model size {size!r}; choose one of {sorted(LLAMA_SIZES)}")
    kw: dict[str, Any] = dict(LLAMA_SIZES[size])
    cfg = LlamaConfig(num_key_value_heads=kw["num_attention_heads"], max_position_embeddings=256, **kw)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def synthetic_batch(vocab_size: int, batch: int, seq_len: int, step: int, rank: int = 0) -> "torch.Tensor":
    """Token ids for one step: a pure function of (step, rank) so resumed runs see the same data."""
    import torch

    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=g)


def resolve_model_factory(spec: str | None) -> Callable[[], Any]:
    """``None``/``llama:SIZE`` -> built-in Llama; ``pkg.module:factory`` -> the user's callable."""
    if not spec:
        return tiny_llama
    if spec.startswith("llama:"):
        size = spec.split(":", 1)[1]
        if size not in LLAMA_SIZES:
            raise UsageError(f"--model {spec!r}: unknown size {size!r}; choose one of {sorted(LLAMA_SIZES)}")
        return lambda: tiny_llama(size)
    if ":" not in spec:
        raise UsageError(
            f"--model {spec!r}: expected 'pkg.module:factory' (a function returning an nn.Module) "
            f"or 'llama:SIZE' with SIZE in {sorted(LLAMA_SIZES)}"
        )
    mod_name, attr = spec.split(":", 1)
    try:
        module = importlib.import_module(mod_name)
    except ImportError as exc:
        raise UsageError(f"--model {spec!r}: cannot import module {mod_name!r} ({exc}). Is it on PYTHONPATH?") from exc
    factory: Callable[[], Any] | None = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"--model {spec!r}: {mod_name} has no callable {attr!r}")
    return factory
