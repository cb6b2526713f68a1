"""Checkpoints shardkit writes and reads, in layers (``docs/architecture.md`` draws them; byte-level plumbing
every format shares, atomic files and tags, the staged save sequence, the manifest, verify, the unpickling
allow-list and streaming writers, lives below them in ``shardkit.storage``):

- ``model/``: the format-neutral checkpoint model every reader produces and every writer consumes;
- what each engine writes and how to recognise it: ``zero3/`` and ``zero12/`` (DeepSpeed ZeRO), ``dcp/``
  (torch.distributed.checkpoint), ``hf_trainer/`` (the Hugging Face Trainer's ``checkpoint-N``),
  ``layout/`` (which layout a folder is, and which commands take it);
- ``readers/`` and ``writers/``: one per format, to and from the model;
- ``ops/``: what users run (save/resume per engine, reshard, convert, consolidate, export), each built from
  the layers below it.

Layout of a checkpoint root written by shardkit::

    root/
      latest                      # the tag of the newest complete checkpoint (DeepSpeed's format)
      <tag>/                      # one checkpoint; complete only when it holds the manifest
        shardkit_manifest.json
        ...engine files...

Every writer goes through ``storage.staged_save.atomic_checkpoint``: a save is written under
``root/.shardkit-tmp-<tag>``, fsynced, renamed to ``root/<tag>``, and only then is ``latest``
replaced, so a save killed at any point leaves the previous checkpoint and its ``latest`` pointer
intact (re-saving an existing tag keeps a loadable copy named by ``latest`` until the new one is in
place). Every loader checks the manifest first (``storage.verify.check_resumable_distributed``) and
unpickles nothing outside an allow-list (``storage.torch_load``, ``dcp.safe_load``).
"""
