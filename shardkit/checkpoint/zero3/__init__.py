"""The DeepSpeed ZeRO-3 format: ``reader`` (find the files, describe the layout, copy partitions
out), ``layout`` (partition arithmetic and DeepSpeed's model-state keys) and ``repartition`` (the
state at another world size, as byte ranges). The operations on it (save, resume, reshard,
consolidate, convert) are in ``checkpoint.ops``."""
