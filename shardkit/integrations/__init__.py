"""shardkit inside other people's training loops: ``hf/`` (the Hugging Face Trainer's
``PreflightCallback``) and ``trainer_hook`` (the import hook `shardkit launch` puts on
``transformers.Trainer`` so every Trainer a rank builds gets that callback).

Each integration imports its framework at import time, so nothing here is imported by
``import shardkit``; import the one you use (``from shardkit.integrations.hf import PreflightCallback``).
"""
