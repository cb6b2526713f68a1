"""`shardkit smoke`: train, save, resume in fresh processes, and prove the loss curve is unchanged.

For each engine (DeepSpeed ZeRO-3, FSDP2) three runs of the tiny Llama on N ranks:

- run A trains K steps without interruption and records every rank's loss per step;
- run B trains the first K//2 steps, saves a checkpoint and exits;
- run C starts in *fresh* processes, resumes that checkpoint, runs the placement preflight, and
  trains the remaining steps.

The smoke passes when B's losses equal A's first half and C's equal A's second half: bit-exact on
CPU at the same world size (data is a pure function of (step, rank), every seed fixed), within a
small tolerance on GPUs (non-deterministic reductions). Everything that can go wrong on resume -
a checkpoint that does not load, state left on the wrong device, an optimizer or scheduler state
that was not restored - shows up as a failed load, a failed preflight or a different loss.

This package is the host side; the ranks run ``shardkit.run.smoke_rank``. Its modules:

- ``options``: what a smoke runs (:class:`SmokeOptions`) and each engine's config (a preset, the
  user's file fitted to the run, or generated);
- ``runs``: running the smoke (:func:`run_smoke`): the DeepSpeed ops built once, then runs A, B
  and C of every engine on spawned ranks, and keeping the checkpoint;
- ``progress``: the progress bar on a terminal, one line per stage elsewhere;
- ``report``: comparing the loss curves, the verdicts (:class:`EngineResult`, :class:`SmokeReport`)
  and the table the command prints.

This package re-exports nothing: import a name from the module that defines it.
"""
