"""What a checkpoint is, from its small files alone: one reader per format describes it (format,
stage, world size, dtypes, parameters, optimizer, step, size) without reading tensor bytes, and
``support`` decides, in one place, which shardkit commands take it and why the others refuse it.

The seed of the format-neutral checkpoint model (issue 27): today a ``CheckpointDescription``
(``description``) per source, produced by ``deepspeed_files`` (ZeRO-0..3, universal checkpoints,
the layouts nothing converts correctly), ``torch_files`` (FSDP2/DCP, accelerate's FSDP1 files,
Hugging Face folders) and dispatched by ``detect``.
"""
