"""ZeRO-3 checkpoints in DeepSpeed's own format: ``reader`` (open, map, gather), ``layout`` (partition
arithmetic and DeepSpeed's model-state keys), ``repartition`` (the state at another world size),
``reshard`` (written to files), ``resume`` (loaded in-process), ``consolidate`` (full weights to
safetensors), ``save`` (engine.save_checkpoint, atomic), ``cpu_adam_kernel``.
"""
