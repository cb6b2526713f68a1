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
  through the engine (ZeRO partitions, fp32 masters, offload) rather than as a plain module;
- a wrapper around ``transformers.Trainer.__init__`` that adds shardkit's PreflightCallback
  (shardkit.integrations.hf): it checks the Trainer's config once the "auto" values are filled and
  runs the preflight at ``on_train_begin``, after the Trainer built the engine and optimizer and
  loaded any checkpoint. It claims the one preflight (:func:`claim`), so the torch hooks never run
  it a second time.

All hooks are removed once the preflight has run; later steps pay nothing.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import weakref
from typing import Any, Callable, NoReturn

from shardkit.autopreflight.env import DEFAULT_TIMEOUT_S, ENV_CONFIG, ENV_FAILED_DIR, ENV_JSON, ENV_TIMEOUT, EXIT_CODE

LAUNCH_SKIP_HINT = "relaunch with `shardkit launch --no-preflight` to skip the check"
"""How a failure message tells a `shardkit launch` user to skip the check."""


class _State:
    done = False
    handles: list[Any] = []
    optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()
    engines: "weakref.WeakSet[Any]" = weakref.WeakSet()
    original_optimizer_init: Callable[..., Any] | None = None


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


def install() -> None:
    """Install the import watchers (or the hooks at once for modules already imported)."""
    callbacks: dict[str, Callable[[Any], None]] = {
        "torch": _install_torch_hooks,
        "deepspeed": _wrap_deepspeed_initialize,
        "transformers.trainer": _wrap_trainer_init,
    }
    for name in list(callbacks):
        if name in sys.modules:
            callbacks.pop(name)(sys.modules[name])
    if callbacks:
        sys.meta_path.insert(0, _AfterImport(callbacks))


def _install_torch_hooks(torch: Any) -> None:
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook

    _State.handles.append(register_module_forward_pre_hook(_on_forward))
    _State.handles.append(register_optimizer_step_pre_hook(_on_step))
    original = Optimizer.__init__
    _State.original_optimizer_init = original

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _State.optimizers.add(self)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    Optimizer.__init__ = __init__  # type: ignore[method-assign]


def _wrap_deepspeed_initialize(deepspeed: Any) -> None:
    original = deepspeed.initialize

    def initialize(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        engine = result[0] if isinstance(result, tuple) else result
        _State.engines.add(engine)
        return result

    initialize.__wrapped__ = original  # type: ignore[attr-defined]
    initialize.__doc__ = original.__doc__
    deepspeed.initialize = initialize


def _wrap_trainer_init(trainer_module: Any) -> None:
    """Every HF Trainer built in this rank gets shardkit's PreflightCallback (unless the script
    added one): the Trainer builds its DeepSpeed engine / FSDP model inside ``train()``, and the
    callback runs the preflight there with the Trainer's own objects and its filled config."""
    trainer_cls = trainer_module.Trainer
    original = trainer_cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            from shardkit.integrations.hf import inject_preflight_callback

            inject_preflight_callback(self)
        except Exception as exc:  # the torch hooks stay as the fallback
            print(f"shardkit autopreflight: PreflightCallback not added to the Trainer ({type(exc).__name__}: {exc})", file=sys.stderr)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    trainer_cls.__init__ = __init__


def _on_forward(module: Any, args: Any) -> None:
    if _State.done:
        return
    import torch

    if not (torch.is_grad_enabled() and module.training):
        return  # evaluation or a frozen helper model: not the training model
    if next(module.parameters(), None) is None:
        return  # a parameter-free module (torchvision transforms are nn.Modules) is not the model
    if torch.utils.data.get_worker_info() is not None:
        return  # a DataLoader worker inherits the environment but never trains
    if module in _State.engines:
        _run(module)
        return
    if _State.engines:
        return  # a submodule (or helper) forward of a DeepSpeed run; the engine's own forward comes first
    if not _State.optimizers:
        return  # no optimizer yet: nothing is being trained (cheap exit for helper forwards before it)
    if not any(p.requires_grad for p in module.parameters()):
        return  # a frozen helper (VAE, text encoder) left in training mode: checking it would hide the model
    if _optimizer_for(module) is None:
        # Not the trained model yet (no optimizer holds its parameters: a helper, or a lazy-module
        # dry run before the optimizer exists); the step pre-hook catches a script that steps first.
        return
    _run(module)


def _on_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if not _State.done:
        _run(None, optimizer)


def _run(module: Any, optimizer: Any = None) -> None:
    """Run the preflight once; on failure stop this rank with EXIT_CODE (every rank fails alike)."""
    claim()
    kwargs = _preflight_arguments(module, optimizer)
    what = "DeepSpeed engine" if "engine" in kwargs else type(kwargs.get("model")).__name__
    if kwargs.get("optimizer") is not None:
        what += " + optimizer"
    run_or_exit(kwargs, what)


def claim() -> bool:
    """Mark the one automatic preflight of this process as taken and remove the torch hooks.

    False when it was already taken: the HF Trainer's PreflightCallback and the torch hooks then
    never both run it (the callback claims it at ``on_train_begin``, before the first forward)."""
    if _State.done:
        return False
    _State.done = True
    _remove_hooks()
    return True


def run_or_exit(
    kwargs: dict[str, Any],
    what: str,
    when: str = "before the first optimizer step",
    skip_hint: str = LAUNCH_SKIP_HINT,
    timeout: float | None = None,
    json_path: str | None = None,
) -> Any:
    """``shardkit.preflight(**kwargs)`` with the launch's timeout and JSON path; rank 0 prints one
    summary line when it passes. On failure every rank prints why and exits with EXIT_CODE (rank 0
    has printed the table), leaving the marker `shardkit launch` names the failed ranks from."""
    from shardkit.errors import PreflightError

    rank = os.environ.get("RANK", "?")
    try:
        from shardkit.placement.preflight import preflight

        report = preflight(**kwargs, timeout=preflight_timeout(timeout), json_path=json_path or os.environ.get(ENV_JSON))
    except PreflightError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "placement preflight failed"
        where = "the table above" if rank == "0" else "rank 0's output"
        stop_rank(rank, f"placement preflight failed {when}", first, where, skip_hint)
    except ImportError as exc:
        print(f"shardkit autopreflight: rank {rank}: preflight unavailable ({exc}); continuing", file=sys.stderr)
        return None
    if rank in ("0", "?"):
        ranks = getattr(report, "ranks", None) or []
        tensors = sum(len(getattr(r, "records", ())) for r in ranks)
        print(
            f"shardkit autopreflight: placement preflight passed on {len(ranks)} rank(s), {tensors} tensors ({what}) {when}",
            file=sys.stderr,
            flush=True,
        )
    return report


def preflight_timeout(given: float | None = None) -> float:
    """``given``, else SHARDKIT_AUTOPREFLIGHT_TIMEOUT, else the default (ranks arrive at different times)."""
    return float(given if given is not None else os.environ.get(ENV_TIMEOUT, DEFAULT_TIMEOUT_S))


def stop_rank(rank: str, what_failed: str, first_line: str, where: str, skip_hint: str = LAUNCH_SKIP_HINT) -> NoReturn:
    """End this rank with EXIT_CODE after one line saying what failed and why (the same on every
    rank); ``first_line`` (the cause) goes into the marker `shardkit launch` summarizes."""
    print(
        f"shardkit autopreflight: rank {rank}: {what_failed}: {first_line}\n"
        f"shardkit autopreflight: rank {rank}: stopping (exit {EXIT_CODE}); see {where}. "
        f"Fix it, or {skip_hint}.",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    _leave_failure_marker(rank, first_line)
    # os._exit: atexit handlers can block in a collective the other ranks never join.
    os._exit(EXIT_CODE)


def _leave_failure_marker(rank: str, first_line: str) -> None:
    """Tell `shardkit launch` this rank failed the preflight (it prints the summary last)."""
    folder = os.environ.get(ENV_FAILED_DIR)
    if not folder:
        return
    try:
        with open(os.path.join(folder, f"rank{rank}"), "w", encoding="utf-8") as fh:
            fh.write(first_line + "\n")
    except OSError as exc:  # the summary is a convenience; the exit code still says it
        print(f"shardkit autopreflight: rank {rank}: cannot leave a failure marker in {folder} ({exc})", file=sys.stderr)


def _preflight_arguments(module: Any, optimizer: Any) -> dict[str, Any]:
    engine = module if module is not None and module in _State.engines else None
    if engine is None and optimizer is not None:
        engine = next((e for e in _State.engines if getattr(e, "optimizer", None) is optimizer), None)
    if engine is None and module is None and len(_State.engines) == 1:
        engine = next(iter(_State.engines))
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
    for opt in list(_State.optimizers):
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


def _remove_hooks() -> None:
    for handle in _State.handles:
        handle.remove()
    _State.handles.clear()
    if _State.original_optimizer_init is not None:
        from torch.optim.optimizer import Optimizer

        Optimizer.__init__ = _State.original_optimizer_init  # type: ignore[method-assign]
        _State.original_optimizer_init = None
