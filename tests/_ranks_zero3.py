"""Rank targets for the ZeRO-3 checkpoint tests (spawned processes import them by module name).

Every run sees the same *global* batch per step whatever its world size: GLOBAL_BATCH rows are
split evenly over the ranks, so runs at 1, 2 and 3 ranks follow the same trajectory up to float
reduction order, and a run resumed at a new world size can be compared with an uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

GLOBAL_BATCH = 6
SEQ_LEN = 16
MODEL_SIZE = "tiny"


def ds_config(dtype: str, offload: bool, world_size: int, sub_group_size: int | None = None) -> dict[str, Any]:
    """A ZeRO-3 AdamW config whose global batch is GLOBAL_BATCH at any world size in {1, 2, 3, 6}."""
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if sub_group_size is not None:
        zero["sub_group_size"] = sub_group_size
    cfg: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "gradient_clipping": 1.0,
        "steps_per_print": 10_000,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 100}
    return cfg


def _build(dtype: str, offload: bool, sub_group_size: int | None = None):
    from shardkit.engines.deepspeed import initialize
    from shardkit.engines.model_factory import tiny_llama

    world = dist.get_world_size()
    return initialize(tiny_llama(MODEL_SIZE, seed=0), ds_config(dtype, offload, world, sub_group_size))


def _global_step(engine, step: int) -> float:
    """One step on this rank's slice of the global batch; returns the global mean loss."""
    from shardkit.engines.deepspeed import train_step
    from shardkit.engines.model_factory import synthetic_batch

    world, rank = dist.get_world_size(), dist.get_rank()
    vocab = engine.module.config.vocab_size
    rows = synthetic_batch(vocab, GLOBAL_BATCH, SEQ_LEN, step, rank=0)
    per = GLOBAL_BATCH // world
    t = torch.tensor([train_step(engine, rows[rank * per : (rank + 1) * per])], dtype=torch.float32)
    dist.all_reduce(t)
    return float(t.item()) / world


def train_and_save(save_dir: str, dtype: str, offload: bool, steps: int, sub_group_size: int | None = None) -> list[float]:
    """Train ``steps`` steps from scratch, save a checkpoint, return the loss curve."""
    engine = _build(dtype, offload, sub_group_size)
    losses = [_global_step(engine, s) for s in range(steps)]
    engine.save_checkpoint(save_dir, tag=f"global_step{steps}")
    return losses


def _local_fp32_state(engine) -> dict[str, Any]:
    """This rank's fp32 partitions and Adam moments, as plain CPU tensors (for bit-exact checks)."""
    opt = engine.optimizer
    out: dict[str, Any] = {"fp32": [], "exp_avg": [], "exp_avg_sq": [], "step": []}
    for flat in opt.fp32_partitioned_groups_flat:
        st = opt.optimizer.state[flat]
        out["fp32"].append(flat.detach().cpu().clone())
        out["exp_avg"].append(st["exp_avg"].detach().cpu().clone())
        out["exp_avg_sq"].append(st["exp_avg_sq"].detach().cpu().clone())
        step = st.get("step")
        out["step"].append(float(step) if step is not None else None)
    out["devices"] = sorted({str(f.device) for f in opt.fp32_partitioned_groups_flat})
    return out


def uninterrupted(dtype: str, offload: bool, steps: int) -> list[float]:
    """The reference: ``steps`` steps from scratch at this world size."""
    engine = _build(dtype, offload)
    return [_global_step(engine, s) for s in range(steps)]


def resume(ckpt: str, mode: str, dtype: str, offload: bool, start: int, steps: int, save_to: str | None = None) -> dict[str, Any]:
    """Resume from ``ckpt`` at this world size and train steps ``start .. start+steps-1``.

    mode "plain": DeepSpeed's own ``engine.load_checkpoint`` (the checkpoint must match this world
    size, e.g. one written by ``shardkit reshard``); mode "shardkit": ``load_checkpoint_resharded``.
    Returns the fp32 state right after loading and the loss curve after it.
    """
    engine = _build(dtype, offload)
    if mode == "plain":
        path, _ = engine.load_checkpoint(ckpt)
        if path is None:
            raise RuntimeError(f"engine.load_checkpoint({ckpt!r}) loaded nothing")
    else:
        from shardkit.checkpoint.ops.resume_zero3 import load_checkpoint_resharded

        result = load_checkpoint_resharded(engine, ckpt)
    state = _local_fp32_state(engine)
    if mode != "plain":
        state["placement_checked"] = result.placement_checked
        state["saved_world_size"] = result.saved_world_size
    state["global_steps"] = engine.global_steps
    state["optimizer"] = type(engine.optimizer.optimizer).__name__
    state["losses"] = [_global_step(engine, s) for s in range(start, start + steps)]
    if save_to:
        engine.save_checkpoint(save_to, tag=f"global_step{start + steps}")
    return state


def resume_many(plans: list[dict[str, Any]], start: int, steps: int) -> dict[str, Any]:
    """Several runs in one spawn (engines built one after another) to keep the spawn count low.

    Each plan: ``label``, ``mode`` ("reference": ``start + steps`` uninterrupted steps; "refuse":
    DeepSpeed's own load of a checkpoint from another world size; "plain"/"shardkit": see
    ``resume``), ``dtype``, ``offload``, and ``ckpt``/``save_to`` where they apply.
    """
    import gc

    out: dict[str, Any] = {}
    for plan in plans:
        mode, dtype, offload = plan["mode"], plan["dtype"], plan["offload"]
        if mode == "reference":
            out[plan["label"]] = {"losses": uninterrupted(dtype, offload, start + steps)}
        elif mode == "refuse":
            out[plan["label"]] = refuses_other_world_size(plan["ckpt"], dtype)
        else:
            out[plan["label"]] = resume(plan["ckpt"], mode, dtype, offload, start, steps, plan.get("save_to"))
        gc.collect()
    return out


def refuses_other_world_size(ckpt: str, dtype: str) -> str:
    """DeepSpeed's own load at a different world size: return its error message."""
    engine = _build(dtype, False)
    try:
        engine.load_checkpoint(ckpt)
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return ""


def fp16_initialize_error() -> str:
    """``deepspeed.initialize`` of an fp16 ZeRO-3 config on this rank's accelerator: DeepSpeed's
    refusal ("" when it accepts), to check shardkit.platform.environment.fp16.fp16_support against the engine."""
    try:
        _build("fp16", False)
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


PINNED_OFFLOAD = {
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}},
}


def pinned_offload_initialize(size: str) -> str:
    """``deepspeed.initialize`` of ZeRO-3 with both offloads pinned, on a Llama of ``size``: "" when
    it succeeds (with DS_PIN_MEMORY_BACKEND=native past `ulimit -l` the process aborts instead)."""
    from shardkit.engines.deepspeed import initialize
    from shardkit.engines.model_factory import tiny_llama

    initialize(tiny_llama(size, seed=0), PINNED_OFFLOAD)
    return ""


# --- building the shared checkpoints (called from the tests' session fixtures) -----------------

SAVE_STEPS = 2
RESUME_STEPS = 3
# label -> (dtype, offload_optimizer, sub_group_size): one checkpoint of 1 step each
VARIANTS = {"bf16_offload": ("bf16", True, 30_000), "fp16": ("fp16", False, None)}
LABELS = ("fp32", *VARIANTS)
_BUILT: dict[str, Any] = {}


def unsupported_reason(label: str) -> str | None:
    """Why this machine cannot build ``label`` (None: it can). One probe, shared with `shardkit
    check`: DeepSpeed's CPU accelerator refuses fp16 on CPUs without oneDNN fp16."""
    if VARIANTS.get(label, ("fp32",))[0] != "fp16":
        return None
    from shardkit.platform.environment.fp16 import fp16_support

    support = fp16_support(device="cpu")  # the checkpoints are built on CPU ranks (device="cpu")
    return None if support.supported else f"fp16 cannot run on this machine's {support.device}: {support.reason}"


class Sources:
    """The shared 2-rank ZeRO-3 checkpoints, each built on first use in its own spawn.

    ``sources[label]`` is the checkpoint root; ``sources["fp32_losses"]`` the fp32 loss curve. A
    variant this machine cannot run skips the test that asks for it (with the reason), and a
    variant whose build failed fails only the tests that use it: one refusal never errors the
    tests of the other variants.
    """

    def __init__(self, base: Path, reason: Any = None) -> None:
        self.base = base
        self._reason = reason or unsupported_reason
        self._failed: dict[str, BaseException] = {}

    def available(self, label: str) -> bool:
        return self._reason(label) is None

    def labels(self) -> list[str]:
        """The labels this machine can build."""
        return [label for label in LABELS if self.available(label)]

    def __getitem__(self, key: str) -> Any:
        label = "fp32" if key == "fp32_losses" else key
        if label not in LABELS:
            raise KeyError(key)
        reason = self._reason(label)
        if reason is not None:
            import pytest

            pytest.skip(reason)
        if label in self._failed:
            raise RuntimeError(f"building the {label} checkpoint failed earlier in this session") from self._failed[label]
        try:
            # asked every time: built_once checks, at each handout, that no test changed the files
            root, losses = self._build(label)
        except BaseException as exc:
            self._failed[label] = exc
            raise
        return losses if key == "fp32_losses" else root

    def _build(self, label: str) -> tuple[Path, list[float] | None]:
        """The checkpoint of ``label`` and its loss curve, saved once per test run (both xdist workers
        read the same folder: tests/_fixtures_shared.py)."""
        from tests._fixtures_shared import built_once

        def save(root: Path) -> list[float] | None:
            from shardkit.run.spawn.process import run_ranks

            if label == "fp32":
                args: tuple[Any, ...] = (str(root), "fp32", False, SAVE_STEPS)
            else:
                dtype, offload, sub_group_size = VARIANTS[label]
                args = (str(root), dtype, offload, 1, sub_group_size)
            return run_ranks(train_and_save, 2, args=args, timeout=300, device="cpu")[0].value

        root = self.base / label
        return root, built_once(root, save)


def build_sources(base: Path) -> Sources:
    """The session's shared checkpoints under ``base`` (built lazily, per label), which moves out of an
    xdist worker's own folder into the one both workers share: each label is saved once per run."""
    from tests._fixtures_shared import across_workers

    base = across_workers(base)
    key = f"sources:{base}"
    if key not in _BUILT:
        _BUILT[key] = Sources(base)
    return _BUILT[key]


RESUMED_WORLDS = (3, 1)


class Resumed:
    """The resumed runs on other world sizes, each spawn built on first use and cached, failures too.

    ``resumed[world]`` (3 or 1): the fp32 checkpoint resharded to ``world`` ranks, then one spawn
    that runs the uninterrupted reference, DeepSpeed's refusal, the plain load of the resharded
    checkpoint and shardkit's in-process loader (offload toggled), each continuing RESUME_STEPS
    steps: ``{"resharded", "ranks", "saved"}``. ``resumed["bf16_offload_off"]``: per-rank results
    of the bf16 offload checkpoint resumed at 3 ranks without offload, in its own spawn, so a bf16
    variant that cannot be built (or is skipped here) never errors the fp32 tests.
    ``resumed["sources"]``: the shared :class:`Sources`. A build that failed is raised again, not
    repeated, for every later test that asks for it (as in ``Sources``).
    """

    def __init__(self, base: Path, sources: Sources | None = None) -> None:
        self.base = base
        self.sources = sources if sources is not None else build_sources(base)
        self._built: dict[Any, Any] = {}
        self._failed: dict[Any, BaseException] = {}

    def __getitem__(self, key: Any) -> Any:
        import pytest

        if key == "sources":
            return self.sources
        if key not in (*RESUMED_WORLDS, "bf16_offload_off"):
            raise KeyError(key)
        if key in self._failed:
            raise RuntimeError(f"building the resumed run {key!r} failed earlier in this session") from self._failed[key]
        if key not in self._built:
            try:
                self._built[key] = self._build_bf16() if key == "bf16_offload_off" else self._build_fp32(key)
            except pytest.skip.Exception:
                raise  # a variant this machine cannot run: skipped again each time, never a failure
            except BaseException as exc:
                self._failed[key] = exc
                raise
        return self._built[key]

    def _build_fp32(self, world: int) -> dict[str, Any]:
        from shardkit.checkpoint.ops.reshard import reshard_checkpoint
        from shardkit.run.spawn.process import run_ranks

        src = self.sources
        resharded = self.base / f"fp32_ws{world}"
        reshard_checkpoint(src["fp32"], resharded, world)
        plans = [
            {"label": "reference", "mode": "reference", "dtype": "fp32", "offload": False},
            {"label": "refuse", "mode": "refuse", "dtype": "fp32", "offload": False, "ckpt": str(src["fp32"])},
            # plain DeepSpeed load of the resharded files; offload switched on at 1 rank
            {"label": "plain", "mode": "plain", "dtype": "fp32", "offload": world == 1, "ckpt": str(resharded),
             "save_to": str(self.base / f"saved_at_ws{world}")},
            # shardkit's loader straight from the 2-rank checkpoint; offload switched on at 3 ranks
            {"label": "shardkit", "mode": "shardkit", "dtype": "fp32", "offload": world == 3,
             "ckpt": str(src["fp32"])},
        ]
        results = run_ranks(resume_many, world, args=(plans, SAVE_STEPS, RESUME_STEPS), timeout=420, device="cpu")
        return {"resharded": resharded, "ranks": [r.value for r in results], "saved": self.base / f"saved_at_ws{world}"}

    def _build_bf16(self) -> list[dict[str, Any]]:
        from shardkit.run.spawn.process import run_ranks

        # saved with offload_optimizer, resumed without it, bf16, several sub-groups; skips (with
        # the reason) where this machine cannot build the bf16 checkpoint
        ckpt = self.sources["bf16_offload"]
        plans = [{"label": "bf16_offload_off", "mode": "shardkit", "dtype": "bf16", "offload": False, "ckpt": str(ckpt)}]
        results = run_ranks(resume_many, 3, args=(plans, SAVE_STEPS, RESUME_STEPS), timeout=420, device="cpu")
        return [r.value["bf16_offload_off"] for r in results]


def build_resumed(base: Path) -> Resumed:
    """The session's resumed runs under ``base`` (built lazily, per world size / variant)."""
    key = f"resumed:{base}"
    if key not in _BUILT:
        _BUILT[key] = Resumed(base)
    return _BUILT[key]


def load_refused(ckpt: str, dtype: str) -> str:
    """``load_checkpoint_resharded`` of a checkpoint that should be refused: this rank's error message."""
    from shardkit.checkpoint.ops.resume_zero3 import load_checkpoint_resharded
    from shardkit.core.errors import CheckpointError

    engine = _build(dtype, False)
    try:
        load_checkpoint_resharded(engine, ckpt)
    except CheckpointError as exc:
        return f"CheckpointError: {exc}"
    return "loaded"


def load_listing(ckpt: str, tag_dir: str) -> dict[str, Any]:
    """``load_checkpoint_resharded`` of ``ckpt`` (fp32, no manifest check) with the listings of ``tag_dir`` counted."""
    from shardkit.checkpoint.ops.resume_zero3 import load_checkpoint_resharded
    from tests._listings import listings_of

    engine = _build("fp32", False)
    with listings_of(tag_dir) as listed:
        load_checkpoint_resharded(engine, ckpt, verify=False, preflight=False)
    return {"listed": listed, "global_steps": engine.global_steps}
