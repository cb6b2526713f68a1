"""What to do about a tensor on the wrong device, by what the tensor is to training.

The mismatch table says which tensor, where it is, where it belongs and why; these lines say how a
user puts it right. One fix per record kind (``placement/records.py``), shown once per kind that
has a mismatch, so a table of 400 misplaced Adam moments ends in one line, not 400.
"""

from __future__ import annotations

from shardkit.placement import records as R

_MODEL = ("move the model to its device before building the optimizer, and add or replace modules before "
          "model.to() / deepspeed.initialize / fully_shard (a module created afterwards starts on the CPU)")
_OPTIMIZER = ("build the optimizer after model.to(device) and load its state after that, or re-place the state "
              "after loading: shardkit.replace_optimizer_state(optimizer)")
_ZERO = ("DeepSpeed places these from the config: if the run used another config, judge with that one "
         "(--config / the engine's own); if not, something moved them after deepspeed.initialize (a .to() on "
         "the optimizer's tensors, optimizer state loaded with map_location): resume with "
         "engine.load_checkpoint and leave their placement to DeepSpeed")

FIXES: dict[str, str] = {
    R.PARAM: _MODEL,
    R.BUFFER: _MODEL,
    R.GRAD: "gradients are created where their parameters are: " + _MODEL,
    R.OPTIMIZER_STATE: _OPTIMIZER,
    R.OPTIMIZER_STEP: _OPTIMIZER,
    R.PARAM_GROUP: ("torch's load_state_dict copies param_group tensors verbatim: move them to the parameters' device "
                    "after loading (shardkit.replace_optimizer_state(optimizer) does; under DeepSpeed ZeRO-3 pass it "
                    "engine.optimizer)"),
    R.GRAD_SCALER: "create the GradScaler for the compute device and load its state after the model is there",
    R.LR_SCHEDULER: "create the scheduler after the optimizer is on its device and load its state after that",
    R.ZERO_PARAM_SHARD: _ZERO,
    R.ZERO_FP32_PARTITION: _ZERO,
    R.ZERO_GRAD_PARTITION: _ZERO,
    R.ZERO_BIT16_FLAT: _ZERO,
    R.ZERO_STATE_BUFFER: _ZERO,
    R.ZERO_UNMANAGED: "create every module before deepspeed.initialize (inside deepspeed.zero.Init when you use it)",
    R.FSDP_SHARD: ("apply fully_shard (with the offload policy you mean) to every module before building the "
                   "optimizer, and do not .to() a sharded module afterwards"),
}


# Under a ZeRO engine the optimizer's state is DeepSpeed's to place (its CPU optimizer, its fp32
# partitions), so torch's re-placement advice would be wrong there. Not param_group tensors: a client
# optimizer's (prodigy-plus-schedule-free's running_d_numerator) are copied verbatim by DeepSpeed's
# load as by torch's, and only a re-placement puts them back.
_ZERO_OWNED = frozenset({R.OPTIMIZER_STATE, R.OPTIMIZER_STEP})


def fix_for(kind: str, engine: str = "") -> str:
    """The fix for a misplaced tensor of ``kind`` under ``engine`` (``deepspeed-zero3``, ``fsdp2``,
    ``torch``); a generic one for kinds added later."""
    if engine.startswith("deepspeed") and kind in _ZERO_OWNED:
        return _ZERO
    return FIXES.get(kind, "put the tensor on the expected device before the first step (see 'why expected')")


# (no "from_pretrained" in the text: launch tests look for the word "trained" in a rank's output)
META_FIX = (
    "tensors on the meta device hold no data: the model was built under torch.device('meta') (or accelerate's "
    "init_empty_weights, a checkpoint load that left some weights out) and never materialized, so moving them is "
    "not enough. Call model.to_empty(device=...) and then load the weights (load_state_dict, or "
    "reset_parameters() for a fresh model) before building the optimizer"
)


def meta_fix_line(actual_devices: list[str]) -> list[str]:
    """The meta-device line when any misplaced tensor is on ``meta`` (a move would copy nothing)."""
    return [f"  fix (meta): {META_FIX}"] if "meta" in actual_devices else []


def fix_lines(kinds: list[str], engine: str = "") -> list[str]:
    """One ``fix (kind): ...`` line per distinct kind, in the order the kinds first appear."""
    seen: list[str] = []
    for k in kinds:
        if k not in seen:
            seen.append(k)
    return [f"  fix ({k}): {fix_for(k, engine)}" for k in seen]
