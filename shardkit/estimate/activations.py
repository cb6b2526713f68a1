"""An activation estimate, labelled as one: what autograd saves for backward in a Llama-style decoder.

Per token of one decoder layer (hidden h, MLP width i, c bytes per compute element: 2 for bf16/fp16,
4 for fp32; SDPA/flash attention, so no s x s score matrix is kept):
- two RMSNorm inputs upcast to fp32 (transformers' LlamaRMSNorm computes in fp32): 8h bytes;
- the two norm outputs (inputs of q/k/v and of gate/up), q/k/v before and after rotary (k/v taken as wide
  as q: multi-query models keep less), the attention output: c(2h + 6h + h);
- gate and up outputs, SiLU(gate), their product (input of down): 4ci.
So ``c(9h + 4i) + 8h`` bytes per token per layer; with activation checkpointing only each layer's input
(ch per token) is kept, plus one layer recomputed in backward. The logits add ``V(c + 8)`` per token (the
16-bit logits, their fp32 upcast for the loss and its gradient). Not counted: the attention kernels'
workspace, the allocator's fragmentation, the CUDA context (0.5-1 GiB per GPU).
"""

from __future__ import annotations

from shardkit.estimate.model import ModelShape
from shardkit.estimate.report import MemoryItem, RunShape


def activation_items(model: ModelShape, run: RunShape, compute_bytes: int) -> tuple[list[MemoryItem], list[str]]:
    """The activation items of one rank for one micro-batch, and the notes when they cannot be computed."""
    h, n_layers, inter, vocab = model.hidden_size, model.num_layers, model.intermediate_size, model.vocab_size
    if not (h and n_layers and inter and vocab):
        return [], ["activations not estimated: the model's hidden_size, num_hidden_layers, intermediate_size and "
                    "vocab_size are unknown (pass --model with the model's config.json)"]
    c = compute_bytes
    tokens = run.micro_batch * run.seq_len
    per_layer = tokens * (c * (9 * h + 4 * inter) + 8 * h)
    if run.activation_checkpointing:
        layers_bytes = n_layers * tokens * c * h + per_layer
        how = (f"checkpointed: {n_layers} layer inputs x {tokens} tokens x {c}h bytes + one layer recomputed "
               f"({tokens} tokens x (c(9h+4i)+8h)), h={h}, i={inter}")
    else:
        layers_bytes = n_layers * per_layer
        how = f"{n_layers} layers x {tokens} tokens x (c(9h+4i)+8h) bytes, c={c}, h={h}, i={inter}"
    items = [
        MemoryItem("act.layers", "activations saved for backward", "activations", "gpu", layers_bytes, "step",
                   how=how, estimate=True),
        MemoryItem("act.logits", "logits, their fp32 copy for the loss, its gradient", "activations", "gpu",
                   tokens * vocab * (c + 8), "step", how=f"{tokens} tokens x vocab {vocab} x ({c}+4+4) bytes",
                   estimate=True),
    ]
    return items, []
