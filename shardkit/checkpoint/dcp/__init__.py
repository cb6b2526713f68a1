"""The DCP (torch.distributed.checkpoint) format FSDP2 saves: ``reader`` (``.metadata`` and items
read through an allow-list, no code run) and ``slices`` (element ranges of tensors read straight
from the ``.distcp`` files). Saving and resuming FSDP2 through it is
``checkpoint.ops.fsdp_checkpoint``."""
