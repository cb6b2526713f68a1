"""Everything that reads a config: ``loading`` (files -> dicts, one ConfigError for every unusable or
hostile file, ``config_kind``, ``config_digest``), ``parsing`` (what parsing alone hides: repeated
keys, NaN), ``paths`` (dotted key paths, "auto" values), ``view`` (the typed DeepSpeed view the rules
and the version table read) and ``fsdp`` (shardkit's FSDP2 config model). Nothing here imports torch
or deepspeed, and nothing here imports another shardkit package but ``errors`` and ``findings``.
"""
