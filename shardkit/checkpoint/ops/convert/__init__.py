"""Conversion between engines' checkpoints with the optimizer state intact: ``zero3_to_dcp``
(DeepSpeed ZeRO-3 -> a DCP checkpoint shardkit's FSDP2 resume loads at any world size),
``dcp_to_zero3`` (the reverse, into per-rank files DeepSpeed's plain ``load_checkpoint`` accepts at
N ranks), ``names`` (parameter-name mapping and what cannot be carried), ``result`` (what a
conversion wrote and what it could not carry).
"""
