"""The DeepSpeed ZeRO-3 format: ``files`` (the rank files' names, and which tag folder a path
designates), ``checkpoint`` (a described checkpoint and its parameter slots, plain data), ``layout``
(partition arithmetic and DeepSpeed's model-state keys) and ``repartition`` (the sub-group layout at
another world size). The rank files are parsed by ``checkpoint.readers`` (``zero3_open``, ``zero3``);
the operations on them (save, resume, reshard, consolidate, convert) are in ``checkpoint.ops``."""
