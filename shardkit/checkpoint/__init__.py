"""Checkpoints shardkit writes and reads: atomic saves, a manifest per checkpoint, verification
before resume, DeepSpeed and FSDP2 (torch.distributed.checkpoint) savers.

Layout of a checkpoint root written by shardkit::

    root/
      latest                      # the tag of the newest complete checkpoint (DeepSpeed's format)
      <tag>/                      # one checkpoint; complete only when it holds the manifest
        shardkit_manifest.json
        ...engine files...

Every writer goes through ``save.atomic_checkpoint``: a save is written under
``root/.shardkit-tmp-<tag>``, fsynced, renamed to ``root/<tag>``, and only then is ``latest``
replaced, so a save killed at any point leaves the previous checkpoint and its ``latest`` pointer
intact (re-saving an existing tag keeps a loadable copy named by ``latest`` until the new one is in
place). Every loader checks the manifest first (``verify.check_resumable_distributed``) and
unpickles nothing outside an allow-list (``safe_load``, ``dcp_safe``).
"""
