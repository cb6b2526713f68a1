"""Conversion between engines' checkpoints with the optimizer state intact.

Each direction is an entry point plus one module per step: reading the source, planning the
target, writing it (the steps every operation shares, verify the source, reuse its tag, check the
output folder, stage and seal, come from ``storage.pipeline`` and ``staged_save``):

- ``to_dcp``: any checkpoint whose reader describes the optimizer (``readers.registry``: ZeRO-1/2/3,
  universal...) -> a DCP checkpoint shardkit's FSDP2 resume loads at any world size
  (``convert_to_dcp``): the reader, ``to_dcp_plan`` (names, torch param groups, what is carried,
  reported or refused) and the DCP writer (``checkpoint.writers.dcp``: the items as byte ranges of
  the source files; ``writers.dcp_files``: their files, split across srun/torchrun processes;
  ``writers.dcp_format``: DCP's item zips and ``.metadata`` pickle without torch).
- ``dcp_to_zero3``: the reverse, into per-rank files DeepSpeed's plain ``load_checkpoint`` accepts
  at N ranks (``convert_dcp_to_zero3``); ``dcp_to_zero3_source`` (the DCP folder, its items, what
  each model key is), ``dcp_to_zero3_plan`` (the resuming run's config and optimizer, param-group
  format, sub-group layout, steps, counters), ``dcp_to_zero3_write`` (each rank's two dicts and
  their files).
- shared by both: ``names`` (parameter-name mapping and what cannot be carried), ``result`` (what
  a conversion wrote and what it could not carry).
"""
