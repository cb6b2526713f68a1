"""FSDP2 checkpoints through torch.distributed.checkpoint: ``checkpoint`` (save, load, export to
safetensors) and ``safe_load`` (DCP's metadata and items read through an allow-list).
"""
