"""Run a function on N local ranks in fresh processes, with a hard timeout that kills them.

Used by `shardkit preflight`/`smoke` and by the multi-rank tests. Each rank gets the usual torchrun
environment (RANK, WORLD_SIZE, LOCAL_RANK, ...), a process group initialized through a ``file://``
rendezvous in a private directory (no port races), and its return value or traceback is sent back
to the parent. A rank that fails makes the parent stop the others after a short grace period, since
they are probably blocked in a collective waiting for it.

Ranks run on the CPU (gloo, GPUs hidden from them) or one per GPU (nccl); :func:`plan_ranks` picks
that and refuses more ranks than visible GPUs, since nccl cannot put two ranks on one GPU. Ranks
never outlive this process: each dies with its parent (Linux parent-death signal, plus a watchdog
thread), and SIGTERM/SIGINT to the parent are passed on to every rank's process group.

One module per step of a run, in the order a run takes them:

- ``plan``: how many ranks and where they run (:func:`plan_ranks`, :class:`RankPlan`, the CPU ranks'
  environment);
- ``process``: starting the rank processes, waiting for them and stopping them
  (:func:`run_ranks`, the harness API), and the rank's own entry point;
- ``lifetime``: ranks never outliving the parent (parent-death signal, watchdog, signal forwarding);
- ``rendezvous``: the rank's torchrun environment and its ``file://`` process group;
- ``results``: what a rank sends back (:class:`RankResult`), collected and summed up in one line.
- ``silence``: a rank silent for ``SHARDKIT_SILENCE_S`` says where it waits (build lock, rendezvous,
  collective), and the parent names every silent rank in one line.

Import from the module that holds a name (``from shardkit.run.spawn.process import run_ranks``); this
package re-exports nothing.
"""
