"""The Hugging Face Trainer's ``checkpoint-N`` format (with DeepSpeed): ``folder`` (find a ``checkpoint-N``
or an output_dir's newest, the DeepSpeed root inside it, the Trainer's files beside it and which of them
a conversion does not carry, and verify it), ``rng_files`` (the per-rank RNG files, the Trainer's and
Accelerate's ``save_state``'s, and which of them each rank reads at another world size) and
``fsdp_files`` (what a ``checkpoint-N`` saved under FSDP holds, as accelerate writes it, and why
shardkit does not take it). Resharding a whole ``checkpoint-N`` is an operation:
``ops.reshard_trainer``.
"""
