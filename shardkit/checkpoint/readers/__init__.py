"""One reader per checkpoint format, each producing ``model.checkpoint.TrainingCheckpoint``
(``registry.read_checkpoint`` picks the reader by the source's kind)."""
