"""The DeepSpeed ZeRO-3 format: ``files`` (the rank files' names, and which tag folder a path
designates), ``reader`` (``open_zero3_checkpoint``: describe a checkpoint's layout without reading
tensors), ``checkpoint`` (the described checkpoint, its parameter slots and one rank's
memory-mapped partitions), ``file_offsets`` (where a mapped tensor's bytes lie in its file),
``gather`` (full tensors copied out of every rank's partitions), ``layout`` (partition arithmetic and
DeepSpeed's model-state keys) and ``repartition`` (the state at another world size, as byte ranges).
The operations on it (save, resume, reshard, consolidate, convert) are in ``checkpoint.ops``."""
