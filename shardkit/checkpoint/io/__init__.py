"""Byte-level checkpoint plumbing shared by every format and operation: ``atomic`` (crash-safe
files, tags, ``latest``), ``staged_save`` (the one staged save sequence), ``manifest``
(``shardkit_manifest.json``), ``verify`` (a checkpoint against its manifest), ``torch_load`` (the
unpickling allow-list), ``stream`` (torch's zip format written by streaming, parallel writers) and
``pipeline`` (the steps every operation shares: verify the source, check the output folder)."""
