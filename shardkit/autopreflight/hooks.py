"""The hooks `shardkit launch` puts into every rank: run the placement preflight once, before the
first optimizer step, without touching the user's script.

Nothing is imported at interpreter start-up: a meta-path watcher waits for the script to import
``torch`` (and ``deepspeed``), then installs

- torch's global module forward pre-hook: the first forward in training mode with grad enabled of a
  module that has trainable parameters held by an optimizer (or of a DeepSpeed engine) is the root
  of the trained model; the preflight runs there, *before* that forward touches a tensor on the
  wrong device (a module replaced after ``.to()``). Frozen helpers (a VAE or
  text encoder never put in ``.eval()``) are skipped, so they cannot pass in the model's place;
- torch's global optimizer step pre-hook (``register_optimizer_step_pre_hook``): the fallback when
  no forward was seen before the first step;
- a wrapper around ``torch.optim.Optimizer.__init__`` that remembers optimizers (weakly), so the
  preflight also checks the state of the optimizer that belongs to the model (case 1: a resumed
  optimizer state left on the CPU);
- a wrapper around ``deepspeed.initialize`` that remembers engines, so a DeepSpeed run is checked
  through the engine (ZeRO partitions, fp32 masters, offload) rather than as a plain module, and
  guards each engine's ``load_checkpoint`` (:func:`guard_engine_loads`: a precision mismatch named
  before DeepSpeed reads a file, the CPU Adam kernel state restored after the load); this guard
  stays after the preflight's hooks are gone, since a resume may come at any step;
- a wrapper around ``transformers.Trainer.__init__`` that adds shardkit's PreflightCallback
  (shardkit.integrations.hf, installed beside these by the sitecustomize): it checks the Trainer's config once the "auto" values are filled and
  runs the preflight at ``on_train_begin``, after the Trainer built the engine and optimizer and
  loaded any checkpoint. It claims the one preflight (:func:`claim`), so the torch hooks never run
  it a second time.

All hooks are removed once the preflight has run; later steps pay nothing.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from typing import Any, Callable

from shardkit.autopreflight.rank_env import ENV_CONFIG
from shardkit.autopreflight.run import HookState, claim, run_or_exit


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``callback(module)`` right after ``name`` finishes importing (once)."""

    def __init__(self, callbacks: dict[str, Callable[[Any], None]]) -> None:
        self._callbacks = dict(callbacks)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        # Not popped here: importlib.util.find_spec("deepspeed") (accelerate's and transformers'
        # is_deepspeed_available probe) asks the finders too, then throws the spec away; popping
        # on that probe would leave the real import unwatched. Popped when the module executes.
        callback = self._callbacks.get(fullname)
        if callback is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            if self._callbacks.pop(fullname, None) is None:
                return  # another spec of the same name already ran it
            try:
                callback(module)
            except Exception as exc:  # a hook problem must never break the user's import
                print(f"shardkit autopreflight: hook for {fullname} not installed ({exc})", file=sys.stderr)

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this loader serves only this module
        return spec


def install(more: dict[str, Callable[[Any], None]] | None = None) -> None:
    """Install the import watchers (or the hooks at once for modules already imported).

    ``more`` adds watchers from the layers above this one (the sitecustomize passes the Hugging Face
    Trainer's, ``shardkit.integrations.trainer_hook.wrap_trainer_init``), so this module never imports them."""
    callbacks: dict[str, Callable[[Any], None]] = {
        "torch": _install_torch_hooks,
        "deepspeed": _wrap_deepspeed_initialize,
        **(more or {}),
    }
    for name in list(callbacks):
        if name in sys.modules:
            callbacks.pop(name)(sys.modules[name])
    if callbacks:
        sys.meta_path.insert(0, _AfterImport(callbacks))


def _install_torch_hooks(torch: Any) -> None:
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook

    HookState.handles.append(register_module_forward_pre_hook(_on_forward))
    HookState.handles.append(register_optimizer_step_pre_hook(_on_step))
    original = Optimizer.__init__
    HookState.original_optimizer_init = original

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        HookState.optimizers.add(self)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    Optimizer.__init__ = __init__  # type: ignore[method-assign]


def _wrap_deepspeed_initialize(deepspeed: Any) -> None:
    original = deepspeed.initialize

    def initialize(*args: Any, **kwargs: Any) -> Any:
        try:
            result = original(*args, **kwargs)
        except AssertionError as exc:  # DeepSpeed's bare asserts: name the model's problem where there is one
            model = kwargs.get("model", args[1] if len(args) > 1 else None)
            problem = _untrainable(model)
            if problem is None:
                raise
            from shardkit.core.errors import UsageError

            raise UsageError(f"deepspeed.initialize stopped with a bare AssertionError ({_where(exc)}): {problem}") from exc
        engine = result[0] if isinstance(result, tuple) else result
        HookState.engines.add(engine)
        guard_engine_loads(engine)
        return result

    initialize.__wrapped__ = original  # type: ignore[attr-defined]
    initialize.__doc__ = original.__doc__
    deepspeed.initialize = initialize


def _untrainable(model: Any) -> str | None:
    """Why ``model`` cannot be trained (no parameters, every one frozen), with the fix; None otherwise."""
    if model is None or not hasattr(model, "parameters"):
        return None
    from shardkit.placement.collect import model_problems

    found = model_problems(model)
    return f"{found[0][1]} Fix: {found[0][2]}" if found else None


def _where(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of ``exc`` (where DeepSpeed's assert sits)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "no traceback"
    code = tb.tb_frame.f_code
    return f"{'/'.join(code.co_filename.split('/')[-4:])}:{tb.tb_lineno} in {code.co_name}"


def guard_engine_loads(engine: Any) -> None:
    """Make the script's own ``engine.load_checkpoint(...)`` resume right, with no call by hand
    (``shardkit.checkpoint.ops.resume_zero3.guard_plain_loads``): a checkpoint whose files are named
    for another precision than the config is refused, named, before DeepSpeed's FileNotFoundError;
    after a load, DeepSpeed's CPU Adam kernels get the step state they keep outside the checkpoint,
    so the continuation is bit-exact. Where the guard cannot be put on (an engine without
    ``load_checkpoint``, an import failing), a warning says the resume is not guarded and what to do."""
    if not hasattr(engine, "load_checkpoint"):
        return  # an inference engine: nothing is resumed through it
    try:
        from shardkit.checkpoint.ops.resume_zero3 import guard_plain_loads

        guard_plain_loads(engine)
    except Exception as exc:  # the launch goes on; the user is told what is not done for them
        print(
            f"shardkit autopreflight: warning: engine.load_checkpoint is not guarded ({type(exc).__name__}: {exc}): "
            "a checkpoint of another precision fails inside DeepSpeed, and after a load on CPU call "
            "shardkit.restore_cpu_adam_kernel_state(engine) for a bit-exact continuation",
            file=sys.stderr,
        )


def _on_forward(module: Any, args: Any) -> None:
    if HookState.done:
        return
    import torch

    if not (torch.is_grad_enabled() and module.training):
        return  # evaluation or a frozen helper model: not the training model
    if next(module.parameters(), None) is None:
        return  # a parameter-free module (torchvision transforms are nn.Modules) is not the model
    if torch.utils.data.get_worker_info() is not None:
        return  # a DataLoader worker inherits the environment but never trains
    if module in HookState.engines:
        _run(module)
        return
    if HookState.engines:
        return  # a submodule (or helper) forward of a DeepSpeed run; the engine's own forward comes first
    if not HookState.optimizers:
        return  # no optimizer yet: nothing is being trained (cheap exit for helper forwards before it)
    if not any(p.requires_grad for p in module.parameters()):
        return  # a frozen helper (VAE, text encoder) left in training mode: checking it would hide the model
    if _optimizer_for(module) is None:
        # Not the trained model yet (no optimizer holds its parameters: a helper, or a lazy-module
        # dry run before the optimizer exists); the step pre-hook catches a script that steps first.
        return
    _run(module)


def _on_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if not HookState.done:
        _run(None, optimizer)


def _run(module: Any, optimizer: Any = None) -> None:
    """Run the preflight once; on failure stop this rank with EXIT_CODE (every rank fails alike)."""
    claim()
    kwargs = _preflight_arguments(module, optimizer)
    what = "DeepSpeed engine" if "engine" in kwargs else type(kwargs.get("model")).__name__
    if kwargs.get("optimizer") is not None:
        what += " + optimizer"
    run_or_exit(kwargs, what)


def _preflight_arguments(module: Any, optimizer: Any) -> dict[str, Any]:
    engine = module if module is not None and module in HookState.engines else None
    if engine is None and optimizer is not None:
        engine = next((e for e in HookState.engines if getattr(e, "optimizer", None) is optimizer), None)
    if engine is None and module is None and len(HookState.engines) == 1:
        engine = next(iter(HookState.engines))
    if engine is not None:
        return {"engine": engine}
    if optimizer is None and module is not None:
        optimizer = _optimizer_for(module)
    kwargs: dict[str, Any] = {"model": module, "optimizer": optimizer}
    config = _fsdp_config()
    if config is not None:
        kwargs["config"] = config
    return kwargs


def _optimizer_for(module: Any) -> Any:
    """The newest optimizer holding any of ``module``'s parameters (None when there is none yet)."""
    params = {id(p) for p in module.parameters()}
    found = None
    for opt in list(HookState.optimizers):
        if any(id(p) in params for group in opt.param_groups for p in group["params"]):
            found = opt
    return found


def _fsdp_config() -> dict[str, Any] | None:
    """The launcher's config when it is a shardkit FSDP2 one (it says where offloaded state lives)."""
    path = os.environ.get(ENV_CONFIG)
    if not path:
        return None
    try:
        from shardkit.config.loading import config_kind, load_config

        cfg = load_config(path)
        return cfg if config_kind(cfg) == "fsdp" else None
    except Exception:
        return None


