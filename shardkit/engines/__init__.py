"""Engine glue, one module per engine: ``deepspeed`` (initialize on an existing process group, one
train step, op prebuild) and ``fsdp`` (apply shardkit's FSDP2 config, optimizer, clipping, one train
step); ``model_factory`` (small Llama models built without downloads, and the "llama:tiny" /
"pkg.module:factory" model spec).
Each imports its engine (deepspeed, torch.distributed.fsdp) and torch inside functions only."""
