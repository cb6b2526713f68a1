"""shardkit's own release (pyproject.toml's version); a module of its own so that reading it imports
nothing else."""

__version__ = "0.1.0"
