"""The DCP (torch.distributed.checkpoint) format FSDP2 saves: ``reader`` (``.metadata`` and items
read through an allow-list, no code run, for ``dcp.load``), ``plain_metadata`` (the same
``.metadata`` read without torch, as plain dataclasses) and ``slices`` (element ranges, whole
tensors and plain values read straight from the ``.distcp`` files, no torch). Saving and resuming
FSDP2 through it is ``checkpoint.ops.fsdp_checkpoint``."""
