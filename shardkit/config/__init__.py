"""Everything that reads or writes a config: ``loading`` (files -> dicts, one ConfigError for every
unusable or hostile file, ``config_kind``, ``config_digest``), ``parsing`` (what parsing alone hides:
repeated keys, NaN), ``paths`` (dotted key paths, "auto" values), ``view`` (the typed DeepSpeed view
the rules and the version table read), ``fsdp`` (shardkit's FSDP2 config model) and ``generate`` (the
configs `shardkit config` writes: DeepSpeed ZeRO-2/3, shardkit's FSDP2, Accelerate's FSDP2 section).
Nothing here imports torch or deepspeed, and nothing here imports another shardkit package but ``core``.
"""
