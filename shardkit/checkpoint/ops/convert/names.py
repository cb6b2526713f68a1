"""Parameter names between DeepSpeed ZeRO-3 and FSDP2/DCP, and what a conversion cannot carry.

Names. ZeRO-3 records each parameter under its name in ``engine.module.named_parameters()``
(``param_shapes``, ``frozen_param_shapes``); DCP keys are the FQNs ``get_state_dict`` produces
(``model.<fqn>``, ``optim.state.<fqn>.<key>``, ``optim.param_groups.<i>.<key>``). They differ in:

- DeepSpeed's ``module.`` prefix: a model wrapped before ``deepspeed.initialize`` (DDP-style
  wrappers, some Trainer setups) is saved with every name under ``module.``; FSDP FQNs never have
  it. Stripped only when *every* name has it (a model whose top-level submodule really is called
  ``module`` keeps its names), and the result says so.
- tied weights: ``named_parameters`` yields a shared parameter once, so ZeRO-3 stores it under its
  first name and lists the others in ``shared_params`` (``{"lm_head.weight":
  "model.embed_tokens.weight"}`` for a Llama with ``tie_word_embeddings``). FSDP's model state
  dict holds *both* keys (DCP load needs both), its optimizer state only the first.
- torch wrapper segments (``_orig_mod.`` from ``torch.compile``, ``_checkpoint_wrapped_module.``
  from activation checkpointing, ``_fsdp_wrapped_module.`` from FSDP1), which ``get_state_dict``
  removes from its FQNs and which may appear in names a ZeRO-3 run recorded.

Frozen parameters have no optimizer state on either side (ZeRO-3: ``frozen_param_shapes``; FSDP:
not in the optimizer), and each param group carries its own hyperparameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from shardkit.core.errors import CheckpointError

DEEPSPEED_PREFIX = "module."
"""What DeepSpeed's names carry when the model was wrapped before ``deepspeed.initialize``."""

TORCH_WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
"""Dotted components ``torch.distributed.checkpoint.state_dict`` drops from FQNs (``_get_fqns``)."""

ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")
"""Per-element optimizer state both engines' Adam/AdamW keep (``step`` is per parameter in torch)."""

ADAM_TYPES = frozenset({"adam", "adamw"})
"""``ds_config["optimizer"]["type"]`` values (lower-cased, as DeepSpeed compares them) that convert."""


def strip_wrapper_segments(name: str) -> str:
    """``_orig_mod.layer.weight`` -> ``layer.weight``: the FQN ``get_state_dict`` would use.

    Only whole dotted components equal to a wrapper name go (as ``_get_fqns`` skips whole module
    names): ``my_orig_mod.weight`` is a user's module and stays as it is."""
    return ".".join(part for part in name.split(".") if part not in TORCH_WRAPPER_SEGMENTS)


@dataclass(frozen=True)
class NameMap:
    """ZeRO-3 names <-> FSDP FQNs for one checkpoint."""

    to_fsdp: dict[str, str]
    """ZeRO-3 name of every stored parameter (trainable and frozen) -> its FSDP FQN."""
    aliases: dict[str, str] = field(default_factory=dict)
    """FSDP FQN of a tied name that holds no data of its own -> the FQN that holds it."""
    prefix: str = ""
    """The prefix removed from every ZeRO-3 name ('' or ``module.``)."""

    def fsdp_name(self, zero3_name: str) -> str:
        return self.to_fsdp[zero3_name]

    def zero3_name(self, fsdp_fqn: str) -> str:
        """The inverse: the name a ZeRO-3 engine over the same (unwrapped) model records."""
        for ds, fsdp in self.to_fsdp.items():
            if fsdp == fsdp_fqn:
                return ds
        raise KeyError(fsdp_fqn)

    def model_keys(self) -> list[str]:
        """Every FQN the FSDP model state dict holds for these parameters (aliases included)."""
        return [*self.to_fsdp.values(), *self.aliases]

    def notes(self) -> list[str]:
        out = []
        if self.prefix:
            out.append(f"every ZeRO-3 parameter name starts with {self.prefix!r} (the model was wrapped before "
                       f"deepspeed.initialize); FSDP names have it removed")
        for alias, owner in sorted(self.aliases.items()):
            out.append(f"tied weight {alias} is {owner} (shared_params): written under both names in the model "
                       f"state, optimizer state under {owner} only, as get_state_dict keys it")
        return out


def build_name_map(zero3_names: Iterable[str], shared_params: Mapping[str, str] | None = None) -> NameMap:
    """The map for a ZeRO-3 checkpoint whose stored parameters are ``zero3_names`` (``param_shapes``
    names then ``frozen_param_shapes`` names) and whose ``shared_params`` lists tied aliases.

    Raises CheckpointError when two names would become the same FQN, or an alias points at a
    parameter the checkpoint does not hold.
    """
    names = list(zero3_names)
    prefix = DEEPSPEED_PREFIX if names and all(n.startswith(DEEPSPEED_PREFIX) for n in names) else ""

    def convert(name: str) -> str:
        return strip_wrapper_segments(name[len(prefix):] if prefix and name.startswith(prefix) else name)

    to_fsdp: dict[str, str] = {}
    seen: dict[str, str] = {}
    for n in names:
        fqn = convert(n)
        if fqn in seen:
            raise CheckpointError(
                f"parameters {seen[fqn]!r} and {n!r} both map to the FSDP name {fqn!r} (after removing "
                f"{prefix or 'no prefix'} and torch wrapper segments {list(TORCH_WRAPPER_SEGMENTS)}): the converted "
                "checkpoint could not keep both. The checkpoint comes from a model with wrapper names in odd places; "
                "save it again from the unwrapped model"
            )
        seen[fqn] = n
        to_fsdp[n] = fqn
    aliases: dict[str, str] = {}
    for alias, owner in (shared_params or {}).items():
        if owner not in to_fsdp:
            raise CheckpointError(
                f"shared_params says {alias!r} is tied to {owner!r}, but {owner!r} is not among the checkpoint's "
                f"parameters ({len(to_fsdp)} in param_shapes/frozen_param_shapes): the model-states file is damaged "
                "or comes from another save"
            )
        aliases[convert(alias)] = to_fsdp[owner]
    return NameMap(to_fsdp=to_fsdp, aliases=aliases, prefix=prefix)


# --- what cannot be carried -----------------------------------------------------------------------


@dataclass(frozen=True)
class Uncarried:
    """One thing the source holds that the target engine's checkpoint cannot hold as it is."""

    name: str
    """What it is, by name: ``loss_scaler``, ``lr_scheduler``, ``optimizer.type``, ``moe.experts``,
    ``mp_world_size``, ``client_state.<key>``, ``param_groups[<i>].<key>``."""
    value: str
    """The value seen (short)."""
    why: str
    fix: str
    refused: bool
    """True: the conversion stops (the result would train differently); False: reported in
    ``ConvertResult.not_carried`` and the conversion goes on."""

    def line(self) -> str:
        return f"{self.name} ({self.value}): {self.why}"


#: The catalogue: what no conversion between ZeRO-3 and FSDP2 carries, and why (README "Convert").
CANNOT_CARRY: dict[str, str] = {
    "optimizer.type": "only Adam/AdamW state (exp_avg, exp_avg_sq, step) has the same meaning in both engines",
    "mp_world_size": "tensor/model-parallel partitions are split along model dimensions, not flat data-parallel ranks",
    "moe.experts": "expert-parallel parameters are saved per expert in files outside the ZeRO-3 partitions",
    "loss_scaler": "FSDP2 training keeps no loss scaler in shardkit's checkpoint (torch.amp.GradScaler is the script's)",
    "lr_scheduler": "shardkit's FSDP2 checkpoint holds model and optimizer only; the scheduler is the script's",
    "client_state": "only JSON values (numbers, strings, lists, dicts) fit the manifest's extra.user",
}


def refuse_if_any(items: Iterable[Uncarried], source: object, target: str) -> None:
    """Raise one CheckpointError naming every refused item (what, value, why, fix); no-op otherwise."""
    refused = [i for i in items if i.refused]
    if not refused:
        return
    lines = "; ".join(f"{i.line()}. Fix: {i.fix}" for i in refused)
    raise CheckpointError(f"{source}: cannot convert to {target}: {lines}")


def not_carried_lines(items: Iterable[Uncarried]) -> list[str]:
    """The reported (not refused) items as ``ConvertResult.not_carried`` lines."""
    return [f"{i.line()}; {i.fix}" for i in items if not i.refused]
