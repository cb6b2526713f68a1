"""User-facing checkpoint operations, each built from ``storage`` and the format packages
(``zero3``, ``dcp``, ``hf_trainer``): save and resume per engine (``save_zero3``, ``resume_zero3``
with ``cpu_adam_kernel``, ``fsdp_checkpoint``, ``torch_training``), ``reshard`` (a ZeRO-3 checkpoint
for another world size), ``reshard_trainer`` (a whole Hugging Face Trainer ``checkpoint-N``),
``convert/`` (ZeRO-3 <-> FSDP2/DCP) and ``consolidate`` (full weights to one safetensors file). No
operation imports another's internals; what they share lives in ``storage.pipeline``."""
