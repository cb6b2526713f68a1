"""Byte-level checkpoint plumbing shared by every format and operation: ``tags`` (what a tag may be,
which tag ``latest`` names), ``atomic`` (crash-safe files, publishing a tag, ``latest`` written
last), ``staged_save`` (the one staged save sequence), ``manifest`` (``shardkit_manifest.json``),
``verify`` (a checkpoint against its manifest), ``torch_load`` (the unpickling allow-list),
``stream`` (torch's zip format written by streaming, parallel writers) and ``pipeline`` (the steps
every operation shares: verify the source, choose the output's tag, check the output folder)."""
