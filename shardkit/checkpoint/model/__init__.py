"""The format-neutral checkpoint model: one description of a training checkpoint that every reader
(``checkpoint.readers``: ZeRO-1/2/3, DCP, FSDP1, universal) produces and every writer consumes."""
