"""Checkpoints shardkit writes and reads, in three layers:

- ``io/``: byte-level plumbing every format and operation shares (atomic files and tags, the one
  staged save sequence, manifest, verify, the unpickling allow-list, streaming writers, and the
  pipeline of steps every operation runs);
- one package per on-disk format: ``zero3/`` (DeepSpeed ZeRO-3), ``dcp/`` (FSDP2 through
  torch.distributed.checkpoint), ``hf_trainer/`` (the Hugging Face Trainer's ``checkpoint-N``);
- ``ops/``: what users run (save/resume per engine, reshard, convert, consolidate), each built from
  the two layers below it.

Layout of a checkpoint root written by shardkit::

    root/
      latest                      # the tag of the newest complete checkpoint (DeepSpeed's format)
      <tag>/                      # one checkpoint; complete only when it holds the manifest
        shardkit_manifest.json
        ...engine files...

Every writer goes through ``io.staged_save.atomic_checkpoint``: a save is written under
``root/.shardkit-tmp-<tag>``, fsynced, renamed to ``root/<tag>``, and only then is ``latest``
replaced, so a save killed at any point leaves the previous checkpoint and its ``latest`` pointer
intact (re-saving an existing tag keeps a loadable copy named by ``latest`` until the new one is in
place). Every loader checks the manifest first (``io.verify.check_resumable_distributed``) and
unpickles nothing outside an allow-list (``io.torch_load``, ``dcp.safe_load``).
"""
