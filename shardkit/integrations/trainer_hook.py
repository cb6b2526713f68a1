"""The import hook `shardkit launch` puts on ``transformers.Trainer``: every Trainer a rank builds gets
shardkit's PreflightCallback. Light on purpose (no transformers, no torch): the rank's
sitecustomize imports it at start-up and passes :func:`wrap_trainer_init` to
``shardkit.autopreflight.hooks.install``.
"""

from __future__ import annotations

import sys
from typing import Any


def wrap_trainer_init(trainer_module: Any) -> None:
    """Every HF Trainer built in this rank gets shardkit's PreflightCallback (unless the script
    added one): the Trainer builds its DeepSpeed engine / FSDP model inside ``train()``, and the
    callback runs the preflight there with the Trainer's own objects and its filled config.

    The config is checked for every Trainer, evaluation-only ones too: whether ``train()`` will be
    called is not known here, and ``evaluate()``/``predict()`` hand the same config to
    ``deepspeed_init(..., inference=True)`` (transformers 5.23 ``evaluation_loop``); a stop says it
    happened "when the Trainer was built"."""
    trainer_cls = trainer_module.Trainer
    original = trainer_cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            # the lazy boundary: this module is imported at every rank's start-up (sitecustomize);
            # hf imports transformers and torch, so it is imported only once a Trainer exists
            from shardkit.integrations.hf.callback import inject_preflight_callback

            inject_preflight_callback(self)
        except Exception as exc:  # the torch hooks stay as the fallback
            print(f"shardkit autopreflight: PreflightCallback not added to the Trainer ({type(exc).__name__}: {exc})", file=sys.stderr)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    trainer_cls.__init__ = __init__
