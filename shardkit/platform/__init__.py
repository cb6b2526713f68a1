"""What the machine and its software are: ``versions`` (every version gate and the known-bad
DeepSpeed table), ``verified`` (the verified-releases record and why a combination is not on it), ``environment/`` (probes of this machine, one module per thing probed:
accelerator, memlock, TORCH_CUDA_ARCH_LIST; then the facts they make, the table's environment rows
judged against them, and the stop/report commands build on them), ``device_rules`` (where tensors
belong, shared by preflight and resume) and ``dist`` (process-group helpers that also work without
a process group). Imports ``core`` and ``config``."""
