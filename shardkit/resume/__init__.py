"""Resuming right: put loaded optimizer state where the parameters are (``replace``). Loading a plain
torch / Accelerate-style training checkpoint in the right order is ``shardkit.checkpoint.torch_training``."""
