"""Building and stepping a DeepSpeed engine inside a rank whose process group already exists."""

from __future__ import annotations

import copy
import os
import traceback
from typing import TYPE_CHECKING, Any, Callable, Mapping

from shardkit.platform.environment.arch_list import arch_list_fix, deepspeed_arch_list_error

if TYPE_CHECKING:
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine


def initialize(model: "torch.nn.Module", config: dict[str, Any], optimizer: Any = None) -> "DeepSpeedEngine":
    """``deepspeed.initialize`` on an existing process group (gloo on CPU, nccl on GPU).

    The config dict is deep-copied because DeepSpeed mutates the one it is given.
    """
    import deepspeed

    deepspeed.init_distributed(dist_backend=None, auto_mpi_discovery=False)
    kwargs: dict[str, Any] = {"model": model, "config": copy.deepcopy(config)}
    if optimizer is not None:
        kwargs["optimizer"] = optimizer
    else:
        kwargs["model_parameters"] = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(**kwargs)
    return engine


def train_step(engine: "DeepSpeedEngine", input_ids: "torch.Tensor") -> float:
    """One causal-LM step (forward, backward, optimizer step); returns the loss as a float."""
    input_ids = input_ids.to(engine.device)
    loss = engine(input_ids=input_ids, labels=input_ids).loss
    engine.backward(loss)
    engine.step()
    return float(loss.detach().float().item())


# Ops DeepSpeed JIT-builds on first use here (CPU accelerator: Adam with and without offload, and
# the shared-memory collective). Building them once up front keeps parallel first users from
# racing on the build lock, and keeps a rank killed at a timeout mid-build from leaving a stale lock.
PREBUILT_OPS = ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder")

# Lines the build subprocess prints for the parent (everything else it prints is build output).
EVENT_PREFIX = "shardkit-op-event "

OpEvent = dict[str, Any]
"""``{"op": name, "stage": "building"}``, then ``{"op", "stage": "ok"|"skipped"|"failed", "seconds", "detail"}``."""


def prebuild_ops(names: tuple[str, ...] = PREBUILT_OPS, on_event: Callable[[OpEvent], None] | None = None) -> dict[str, str]:
    """JIT-build (or load from ~/.cache/torch_extensions) the ops this machine's DeepSpeed uses.

    Returns op name -> "ok" / "skipped: ..." / "failed: TYPE: message (in function)"; never raises,
    so one op that does not build is reported by name instead of ending the others' builds.
    ``on_event`` hears each op start and finish (the smoke prints them: a cold build takes minutes).
    """
    import time

    from deepspeed.accelerator import get_accelerator

    emit = on_event or (lambda event: None)
    acc = get_accelerator()
    status: dict[str, str] = {}
    for name in names:
        emit({"op": name, "stage": "building"})
        start = time.monotonic()
        try:
            builder = acc.create_op_builder(name)
            if builder is None or not builder.is_compatible(verbose=False):
                status[name] = f"skipped: not used by the {acc.device_name()} accelerator"
            else:
                builder.load(verbose=False)
                status[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - see docstring
            status[name] = f"failed: {_exception_line(exc)}"
        stage, _, detail = status[name].partition(": ")
        emit({"op": name, "stage": stage, "seconds": round(time.monotonic() - start, 1), "detail": detail})
    return status


def _exception_line(exc: BaseException) -> str:
    """``TYPE: first line of the message (in innermost_function)``: DeepSpeed's build errors say
    what failed but not where (``invalid literal for int()`` comes from compute_capability_args)."""
    message = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    frames = [f.name for f in traceback.extract_tb(exc.__traceback__) if not f.name.startswith("<")]
    where = f" (in {frames[-1]})" if frames else ""
    return f"{type(exc).__name__}: {message}{where}" if message else f"{type(exc).__name__}{where}"


def prebuild_ops_in_subprocess(
    on_event: Callable[[OpEvent], None] | None = None,
    names: tuple[str, ...] = PREBUILT_OPS,
    timeout: float = 1800.0,
    env: Mapping[str, str] | None = None,
) -> tuple[dict[str, str], str]:
    """:func:`prebuild_ops` in a fresh interpreter (importing deepspeed here would initialize its
    accelerator in the caller); events are passed on as they happen. ``env`` is the interpreter's
    environment (the ranks' one, so the ops their accelerator uses are built). Returns the per-op
    status and everything else the build printed (compiler output, for the log of a failure)."""
    import json
    import subprocess
    import sys
    import threading

    code = (
        "import json\n"
        "from shardkit.engines.deepspeed import EVENT_PREFIX, prebuild_ops\n"
        f"prebuild_ops({tuple(names)!r}, on_event=lambda e: print(EVENT_PREFIX + json.dumps(e), flush=True))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env=dict(env) if env is not None else None,
    )
    timed_out = threading.Event()

    def kill() -> None:  # a hung compiler must not hang the smoke
        timed_out.set()
        proc.kill()

    timer = threading.Timer(timeout, kill)
    timer.start()
    status: dict[str, str] = {}
    output: list[str] = []
    try:
        for line in proc.stdout or ():
            if line.startswith(EVENT_PREFIX):
                event = json.loads(line[len(EVENT_PREFIX):])
                if event["stage"] != "building":
                    status[event["op"]] = event["stage"] + (f": {event['detail']}" if event.get("detail") else "")
                if on_event is not None:
                    on_event(event)
            else:
                output.append(line)
        exit_code = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    last = next((line.strip() for line in reversed(output) if line.strip()), "")
    for name in names:
        if name not in status:  # the build process died before reporting this op
            why = f"killed after {timeout:.0f} s" if timed_out.is_set() else f"build process exited with code {exit_code}"
            status[name] = f"failed: {why}" + (f"; last output: {last}" if last else "")
            if on_event is not None:
                on_event({"op": name, "stage": "failed", "seconds": None, "detail": status[name][len("failed: "):]})
    return status, "".join(output)


def op_failure_line(name: str, status: str, environ: Mapping[str, str] | None = None) -> str:
    """One line for a failed op build: the op, the cause, and the fix when the cause is known."""
    cause = status[len("failed: "):] if status.startswith("failed: ") else status
    line = f"DeepSpeed op {name} failed to build: {cause}"
    env = os.environ if environ is None else environ
    arch = env.get("TORCH_CUDA_ARCH_LIST")
    # DeepSpeed >= 0.19.0 sorts TORCH_CUDA_ARCH_LIST entries with int() (PR #7977): torch's own '9.0a'
    # (many Hopper images) or 'sm_90' fail there. The cause is that only when the build failed with
    # exactly the error shardkit's replay of DeepSpeed's parser predicts; the fix is the same one
    # `shardkit check` gives (environment.arch_list.arch_list_fix: 'sm_90' -> 9.0).
    error = deepspeed_arch_list_error(arch)
    if arch and error and error in cause:
        line += f"; TORCH_CUDA_ARCH_LIST={arch!r} has entries DeepSpeed cannot parse: {arch_list_fix(arch)}"
    return line
