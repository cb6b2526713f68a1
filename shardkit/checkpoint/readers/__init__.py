"""One reader per checkpoint format, each producing ``model.checkpoint.TrainingCheckpoint`` from the
source's files, mostly without torch (``registry.read_checkpoint`` picks the reader by the source's
kind): ``zero3`` (with ``zero3_open``: the layout from the small files, ``zero3_rank_values``: values
a rank kept for itself, ``zero3_run_state``: what DeepSpeed's own loaders take), ``zero12`` (with
``zero12_place``), ``deepspeed_scalars`` (the scalars every DeepSpeed reader shares), ``universal``,
``dcp``, ``fsdp1`` and ``fsdp1_bins`` (accelerate's FSDP files; ``sharded_tensor_pickle`` and
``dtensor_pickle`` read their per-rank pickles) and ``accelerate_state`` (a plain
``Accelerator.save_state`` folder).
"""
