# Lazy boundary: commands import their implementation inside their run function, so --help imports no torch/deepspeed.
"""One module per CLI command; each defines ``register(subparsers)`` (see shardkit/cli.py)."""
