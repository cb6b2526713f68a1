"""What the machine and its software are: ``versions`` (every version gate and the known-bad
DeepSpeed table), ``environment`` (probes of this machine: accelerator, DeepSpeed ops, memlock,
arch list), ``device_rules`` (where tensors belong, shared by preflight and resume) and ``dist``
(process-group helpers that also work without a process group). Imports ``core`` and ``config``."""
