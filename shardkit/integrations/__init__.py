"""shardkit inside other people's training loops (``hf``: the Hugging Face Trainer).

Each integration module imports its framework at import time, so nothing here is imported by
``import shardkit``; import the one you use (``from shardkit.integrations.hf import PreflightCallback``).
"""
