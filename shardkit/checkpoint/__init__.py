"""Checkpoints shardkit writes and reads. The format-independent core: ``atomic`` (file-level
atomic writes, tags, ``latest``), ``save`` (the one staged save sequence), ``manifest``, ``verify``,
``safe_load`` (the unpickling allow-list), ``stream`` (streaming torch.save); one subpackage per
format: ``zero3/`` (DeepSpeed ZeRO-3: reader, layout, repartition, reshard, in-process resume,
consolidate, save, CPU Adam kernel state) and ``dcp/`` (FSDP2 through torch.distributed.checkpoint);
``torch_training`` (plain torch training save/resume) beside them.

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
unpickles nothing outside an allow-list (``safe_load``, ``dcp.safe_load``).
"""
