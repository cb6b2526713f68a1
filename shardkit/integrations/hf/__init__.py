"""shardkit's checks inside the Hugging Face ``Trainer``: one line, ``trainer.add_callback(PreflightCallback())``.

What runs, on every rank:

- **config**: the DeepSpeed config the Trainer hands to ``deepspeed.initialize``, read *after* the
  Trainer filled its ``"auto"`` values (``HfTrainerDeepSpeedConfig``: batch sizes, precision,
  clipping and optimizer values when ``TrainingArguments`` is built; bucket sizes and scheduler
  steps in ``deepspeed_init``), judged by the `shardkit check` rules and this machine's
  environment rows (shardkit.platform.environment): errors stop every rank, warnings are printed once.
  Also: FSDP asked for in ``TrainingArguments`` that Accelerate did not turn on.
- **placement**: shardkit's placement preflight (shardkit.placement.preflight, the function
  `shardkit launch` and ``shardkit.preflight`` use) over the Trainer's DeepSpeed engine, or its
  model, optimizer, scaler and scheduler; a failure prints the same table as `shardkit launch`
  and ends every rank with exit 3 before the first optimizer step.

When: transformers 5.23's ``Trainer._inner_training_loop`` calls ``_prepare_for_training``
(``deepspeed_init`` -> ``accelerator.prepare`` -> ``deepspeed.initialize`` / ``fully_shard``,
then the checkpoint load of a resume) *before* ``callback_handler.on_train_begin`` and the first
forward, so ``on_train_begin`` sees the built engine, the optimizer and resumed state. Should a
Trainer call it earlier (no engine or optimizer yet), the preflight waits for ``on_step_begin``;
when they are still missing there (an optimizer built lazily, a custom engine), rank 0 says once
what is missing and the callback does not run it (under `shardkit launch` the torch hooks do).

Where the engine comes from: callback events receive ``model`` (``trainer.model``: under DeepSpeed
the bare module, not the engine) and Accelerate's optimizer wrapper, never the Trainer. The engine
(``trainer.model_wrapped``) and the filled config hang off the Trainer, whose method is the
caller of the event, so the callback finds it on the call stack (:func:`calling_trainer`).

`shardkit launch` adds this callback to every Trainer a rank builds (shardkit.integrations.trainer_hook
wraps ``Trainer.__init__``), checks the config right there, before ``deepspeed.initialize`` can
refuse it, and the preflight then runs once: through the callback, never again through the torch
hooks.

**resume**: the Trainer resumes with DeepSpeed's plain ``engine.load_checkpoint``; the callback
guards it (``resume_guard``): a checkpoint whose files are named for another precision is refused,
named, before DeepSpeed's ``FileNotFoundError``, and the CPU Adam kernel state is restored after the
load, so the continuation is bit-exact. A callback added with ``trainer.add_callback`` after the
Trainer was built gets no event before the load: it restores the kernel state at ``on_train_begin``
and says the precision check could not come first.

Its modules: ``callback`` (:class:`PreflightCallback`, the events and the stop),
``config_check`` (the filled config), ``trainer_objects`` (the Trainer and what it built) and
``resume_guard`` (the Trainer's DeepSpeed resume).
``from shardkit.integrations.hf import PreflightCallback`` is the documented import; every other
name is imported from the module that defines it.
"""

from shardkit.integrations.hf.callback import PreflightCallback

__all__ = ["PreflightCallback"]
