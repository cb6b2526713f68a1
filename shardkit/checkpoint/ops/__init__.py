"""The checkpoint operations users run, each built from the layers below it (``storage``, the format
packages, ``readers``, ``model``, ``writers``); no operation imports another's internals, and the steps
they share (verify the source, choose the tag, check the output, stage, seal) live in
``storage.pipeline``.

- save and resume per engine: ``save_zero3`` (an atomic DeepSpeed save, any ZeRO stage), in-process
  resume at another world size (``resume_zero3`` with ``resume_zero3_state`` for ZeRO-3 engines,
  ``resume_zero12`` for ZeRO-1/2 ones, ``resume_state`` what they share; ``cpu_adam_kernel`` the
  step state DeepSpeed's CPU Adam keeps outside every checkpoint), ``fsdp_checkpoint`` (FSDP2
  through DCP) and ``torch_training`` (plain torch / Accelerate-style training);
- ``reshard``: a ZeRO-1/2/3 checkpoint rewritten for another world size in DeepSpeed's own format,
  planned by ``reshard_zero3`` or ``reshard_zero12`` (``reshard_source`` the plan they hand it), the
  root's other files carried by ``carried_files``; ``reshard_trainer`` a whole Hugging Face Trainer
  ``checkpoint-N``;
- ``convert/``: any checkpoint a reader describes into DCP, ZeRO-1/2, ZeRO-3 or a universal checkpoint;
- ``consolidate`` (with ``consolidate_output`` and ``consolidate_shared``): full weights to one
  safetensors file; ``export/``: a folder ``transformers`` loads with ``from_pretrained``;
- ``verify_structure``, ``verify_files`` and ``verify_manifest``: ``shardkit verify`` of a save that
  has no shardkit manifest, and the manifest ``--write-manifest`` writes over one that passed.
"""
