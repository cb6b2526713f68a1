"""What this machine can run: environment facts that make DeepSpeed fail before (or instead of)
the first step whatever the config says, probed once, and the known-bad table's "environment"
rows evaluated against them (shardkit/data/deepspeed_known_bad.json).

One module per thing probed, then the modules that judge the facts (bottom to top):

- ``accelerator``: what torch says about CUDA (``probe_cuda``) and oneDNN fp16 (``probe_cpu_fp16``).
- ``memlock``: the locked-memory limit (``probe_memlock``, CAP_IPC_LOCK) and the bytes a config
  asks DeepSpeed to mlock (NVMe swap buffers).
- ``arch_list``: TORCH_CUDA_ARCH_LIST as DeepSpeed's JIT builder parses it, and its fix.
- ``facts``: ``EnvironmentFacts``, ``probe_environment`` (every probe once, each replaceable) and
  ``run_has_accelerator``.
- ``fp16``: ``fp16_support``, whether DeepSpeed accepts fp16 on the accelerator a run here uses.
- ``rows``: the table's environment rows evaluated against the facts -> Findings.
- ``ext_lock``: op build locks left in the torch extensions cache by a killed build, and whether
  their builder is alive (``inspect_locks``).
- ``interfaces``: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME naming an interface this host lacks; a
  rendezvous across nodes on this machine's loopback.
- ``report``: what commands do with those findings (``require_runnable_here``,
  ``require_no_hang_traps``, ``version_report``).

This package re-exports nothing: import (and monkeypatch) a name from the module that defines it.
Nothing here imports torch unless a fact needs it (the CUDA probe only for a CUDA build of torch,
the fp16 probe only for an fp16 config on a CPU run).
"""
