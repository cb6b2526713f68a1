"""Byte-level checkpoint plumbing shared by every format and operation, nothing engine-specific:

- tags and publishing: ``tags`` (what a tag may be, which tag ``latest`` names), ``atomic``
  (crash-safe files, publishing a tag, ``latest`` written last), ``staged_save`` (the one staged save
  sequence), ``sibling_staging`` (a whole folder assembled beside its destination);
- the manifest and checking against it: ``manifest`` (``shardkit_manifest.json``), ``digest``
  (BLAKE3 / sha256), ``verify`` (a checkpoint against its manifest), ``rank_coverage`` (which rank
  files a world size needs), ``links`` (symlinks leading out of a folder), ``listing`` (one listing of a
  folder for every step), ``checkpoint_file`` (opening one file, with the words a user acts on);
- torch's file format without torch: ``torch_load`` (the unpickling allow-list, ``read_structure``),
  ``torch_pickle`` and ``torch_zip`` (``torch.save``'s files written back), ``stream`` (streaming,
  hashing, parallel writers), ``structure_observers`` (what ``shardkit verify`` sees readers parse),
  ``safetensors_file`` (the safetensors header and file-to-file copies);
- operations: ``pipeline`` (the steps every operation shares: verify the source, choose the output's
  tag, check the output folder), ``dry_run`` (``--dry-run`` as the real run stopped before its first
  write), and split runs written by every ``srun``/``torchrun`` process: ``request`` (what each was
  asked), ``shared_meet`` (their first contact), ``shared_save`` and ``shared_tag`` (one output or tag
  folder written by all).
"""
