"""User-facing checkpoint operations, each built from ``checkpoint.io`` and the format packages
(``zero3``, ``dcp``, ``hf_trainer``): save and resume per engine (``save_zero3``, ``resume_zero3``,
``fsdp_checkpoint``, ``torch_training``), ``reshard``, ``convert/``, ``consolidate`` and the
Hugging Face Trainer's ``checkpoint-N`` (``hf_trainer``). No operation imports another's internals;
what they share lives in ``checkpoint.io.pipeline``."""
