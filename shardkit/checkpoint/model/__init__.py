"""The format-neutral checkpoint model: one description of a training checkpoint that every reader
(``checkpoint.readers``: ZeRO-1/2/3, DCP, FSDP1, universal) produces and every writer
(``checkpoint.writers``) consumes. ``checkpoint`` holds ``TrainingCheckpoint`` (the tensors, the
optimizer state and the scalars of one save, opened and verified once); ``tensors`` says where each
tensor's bytes are without reading them (``SourceTensor`` as ``Piece`` byte ranges of the source files).
"""
