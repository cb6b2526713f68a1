"""One writer per checkpoint format, each writing any ``model.checkpoint.TrainingCheckpoint`` (``dcp``:
the DCP checkpoint FSDP2 resumes at any world size)."""
