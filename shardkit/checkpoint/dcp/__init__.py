"""The DCP (torch.distributed.checkpoint) format FSDP2 saves, below its reader: ``plain_metadata``
(``.metadata`` read without torch, as plain dataclasses), ``slices`` (element ranges, whole tensors
and plain values read straight from the ``.distcp`` files, no torch) and ``safe_load`` (torch's
``torch.distributed.checkpoint.load`` with ``.metadata`` and items read through an allow-list, no code
run). The checkpoint model of a DCP folder is ``readers.dcp``; saving and resuming FSDP2 through it is
``ops.fsdp_checkpoint``.
"""
