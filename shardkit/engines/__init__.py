"""Engine glue, one module per engine: ``deepspeed`` (initialize on an existing process group, one
train step, op prebuild) and ``fsdp`` (apply shardkit's FSDP2 config, optimizer, clipping, one train
step). Each imports its engine (deepspeed, torch.distributed.fsdp) inside functions only."""
