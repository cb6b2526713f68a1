"""Plain-data placement records: one row per tensor training will touch, and one report per rank.

No torch objects live here, so a report pickles/JSON-encodes in microseconds and one type serves
the CLI table, the ``--json`` output, the cross-rank exchange and the tests.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any

from shardkit.platform.device_rules import same_device

# Record kinds. Names say what the tensor is to training, not how the engine stores it.
PARAM = "param"
BUFFER = "buffer"
GRAD = "grad"
OPTIMIZER_STATE = "optimizer_state"
OPTIMIZER_STEP = "optimizer_step"
PARAM_GROUP = "param_group"
GRAD_SCALER = "grad_scaler"
LR_SCHEDULER = "lr_scheduler"
ZERO_PARAM_SHARD = "zero.param_shard"
ZERO_FP32_PARTITION = "zero.fp32_partition"
ZERO_GRAD_PARTITION = "zero.grad_partition"
ZERO_BIT16_FLAT = "zero.bit16_flat"
ZERO_UNMANAGED = "zero.unmanaged_param"
ZERO_STATE_BUFFER = "zero.buffer"
FSDP_SHARD = "fsdp.shard"


@lru_cache(maxsize=1024)
def devices_match(actual: str, expected: str) -> bool:
    """``shardkit.platform.device_rules.same_device`` on the strings records hold (one rule for preflight and
    resume). ``nvme`` is not a torch device: a ZeRO partition swapped out to disk matches only nvme."""
    if "nvme" in (actual, expected):
        return actual == expected
    import torch

    try:
        return same_device(torch.device(actual), torch.device(expected))
    except RuntimeError:  # not a device string torch knows: never a match
        return False


@dataclass(frozen=True)
class PlacementRecord:
    """Where one tensor is and where the config, the engine and the accelerator say it belongs."""

    rank: int
    """Global rank that holds the tensor."""
    name: str
    """Qualified name: ``module.out_head.weight``, ``optimizer.state[3].exp_avg``, ``zero.fp32_partition[0]``."""
    kind: str
    """What the tensor is to training (one of the constants in this module)."""
    actual: str
    """Device the tensor is on now (``str(tensor.device)``; ``nvme`` for a partition swapped out)."""
    expected: str
    """Device it must be on, derived from config + engine + this rank's accelerator."""
    bytes: int
    """Bytes of this tensor's elements (numel * element size); 0 for a freed ZeRO-3 placeholder."""
    numel: int = 0
    """Element count; under ZeRO-3 the local partition's numel."""
    why: str = ""
    """Why ``expected`` is what it is (``zero_optimization.offload_optimizer.device=cpu``)."""
    storage: str = ""
    """Identity of the underlying storage (device + address) so aliased tensors are counted once."""
    storage_bytes: int = 0
    """Bytes of the whole underlying storage, counted once per ``storage`` in the summary."""

    @property
    def ok(self) -> bool:
        return devices_match(self.actual, self.expected)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RankReport:
    """Everything one rank sends to the others: compact, no tensors."""

    rank: int
    world_size: int
    host: str
    """Hostname, to check that ranks sharing a node use distinct accelerator indices."""
    compute_device: str
    """This rank's accelerator device (``cuda:3``) or ``cpu``."""
    engine: str
    """``deepspeed-zero3``, ``deepspeed-zero2``, ``fsdp2``, ``torch`` ..."""
    versions: dict[str, str]
    """torch / deepspeed / python / shardkit versions seen by this rank."""
    config_digest: str
    """sha256 of the canonical JSON of the config this rank trains with ('' when none)."""
    records: list[PlacementRecord] = field(default_factory=list)
    param_numels: dict[str, int] = field(default_factory=dict)
    """Full (unsharded) numel per trainable parameter name: the parameter set every rank must share."""
    zero3_partitions: dict[str, int] = field(default_factory=dict)
    """Under ZeRO-3: local partition numel per parameter name (``ds_tensor.ds_numel``)."""
    zero3_partition_ranks: int = 0
    """Under ZeRO-3: size of the group a parameter is partitioned over (the world, or a MiCS shard group)."""
    unmanaged: list[str] = field(default_factory=list)
    """Parameters an engine should shard but does not manage (ZeRO-3 params without ``ds_id``)."""
    node_rank: int = -1
    """The launcher agent (node) that started this rank (torchrun's GROUP_RANK); -1 when unknown. Two
    nodes reporting one host name are told apart by it."""
    problems: list[list[str]] = field(default_factory=list)
    """What is wrong on this rank besides where tensors are, as ``[key, message, fix]``: launcher
    variables that disagree (``environment``: RANK, WORLD_SIZE, LOCAL_RANK against each other, the
    visible devices and the process group, ``platform.dist.rank_env_problems``), a model with nothing
    to train (``model``: no parameters, every parameter frozen)."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RankReport":
        recs = [PlacementRecord(**r) for r in d.get("records", [])]
        return cls(**{**d, "records": recs})


@dataclass
class EngineRecords:
    """What one rank's engine contributes to its RankReport."""

    engine: str
    records: list[PlacementRecord] = field(default_factory=list)
    param_numels: dict[str, int] = field(default_factory=dict)
    zero3_partitions: dict[str, int] = field(default_factory=dict)
    zero3_partition_ranks: int = 0
    unmanaged: list[str] = field(default_factory=list)
