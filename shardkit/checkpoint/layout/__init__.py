"""What a checkpoint is, from its small files alone: one describer per family of formats says what it
holds (format, stage, world size, dtypes, parameters, optimizer, step, size) without reading tensor
bytes, and ``support`` decides, in one place, which shardkit commands take it and why the others
refuse it. This is what ``shardkit inspect`` prints; reading the tensors themselves is the readers'
job (``checkpoint.readers``, into the checkpoint model).

Its modules: ``description`` (``CheckpointDescription``, the plain record), ``deepspeed_files``
(ZeRO-0..3, universal checkpoints, the layouts nothing converts correctly), ``torch_files``
(FSDP2/DCP, accelerate's FSDP1 files, Hugging Face folders), ``detect`` (which checkpoint a path
designates, and the describer for it) and ``support`` (the command-by-layout table).
"""
