"""Conversion between engines' checkpoints with the optimizer state intact: any checkpoint whose reader
describes the optimizer (``readers.registry``: ZeRO-1/2/3, FSDP2/DCP, FSDP1, universal) into another
engine's format.

Each target is an entry point plus one module per step: reading the source, planning the target,
writing it (the steps every operation shares, verify the source, reuse its tag, check the output
folder, stage and seal, come from ``storage.pipeline`` and ``storage.staged_save``):

- ``to_dcp``: a DCP checkpoint shardkit's FSDP2 resume loads at any world size (``convert_to_dcp``):
  the reader, ``to_dcp_plan`` (names, torch param groups, what is carried, reported or refused) and
  the DCP writer (``checkpoint.writers.dcp``: the items as byte ranges of the source files;
  ``writers.dcp_files``: their files, split across srun/torchrun processes; ``writers.dcp_format``:
  DCP's item zips and ``.metadata`` pickle without torch).
- ``to_zero3``: per-rank files DeepSpeed's plain ``load_checkpoint`` accepts at N ranks
  (``convert_to_zero3``): the reader, ``to_zero3_plan`` (the resuming run's config and optimizer,
  param-group format, sub-group layout, steps, names, counters) and the ZeRO-3 writer
  (``checkpoint.writers.zero3``: each rank's two dicts, the flat partitions as byte ranges of the
  source's pieces, and their files).
- ``to_zero12``: the files a ZeRO-1 or ZeRO-2 run at N ranks saves (``convert_to_zero12``, through
  ``writers.zero12``); ``to_universal``: a DeepSpeed universal checkpoint (``convert_to_universal``,
  through ``writers.universal``). Both open their source through ``single_source``.
- shared by all: ``arguments`` (the world-size and worker checks, said once), ``names``
  (parameter-name mapping and what cannot be carried), ``result`` (what a conversion wrote and what it
  could not carry).
"""
