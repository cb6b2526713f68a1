"""Conversion between engines' checkpoints with the optimizer state intact.

Each direction is an entry point plus one module per step: reading the source, planning the
target, writing it (the steps every operation shares, verify the source, reuse its tag, check the
output folder, stage and seal, come from ``storage.pipeline`` and ``staged_save``):

- ``zero3_to_dcp``: DeepSpeed ZeRO-3 -> a DCP checkpoint shardkit's FSDP2 resume loads at any world
  size (``convert_zero3_to_dcp``); ``zero3_to_dcp_plan`` (names, torch param groups, what is
  carried, reported or refused); the torch-free route: ``zero3_to_dcp_bytes`` (the output's items as
  byte ranges of the rank files, their files), ``zero3_to_dcp_share`` (one process's share under
  srun/torchrun, sealed by process 0) and ``dcp_format`` (DCP's item zips and ``.metadata`` pickle
  without torch); the torch route for what bytes cannot express:
  ``zero3_to_dcp_source`` (file-name refusals, the source's tensors as a lazy state dict of
  rank-file byte ranges) and ``zero3_to_dcp_write`` (``dcp.save`` with streamed tensor files).
- ``dcp_to_zero3``: the reverse, into per-rank files DeepSpeed's plain ``load_checkpoint`` accepts
  at N ranks (``convert_dcp_to_zero3``); ``dcp_to_zero3_source`` (the DCP folder, its items, what
  each model key is), ``dcp_to_zero3_plan`` (the resuming run's config and optimizer, param-group
  format, sub-group layout, steps, counters), ``dcp_to_zero3_write`` (each rank's two dicts and
  their files).
- shared by both: ``names`` (parameter-name mapping and what cannot be carried), ``result`` (what
  a conversion wrote and what it could not carry).
"""
