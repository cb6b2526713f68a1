"""Turning one tensor into one PlacementRecord: metadata only, never a copy or a sync."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from shardkit.placement.records import PlacementRecord

if TYPE_CHECKING:
    import torch


def tensor_record(rank: int, name: str, kind: str, tensor: "torch.Tensor", expected: str, why: str = "") -> PlacementRecord:
    """A record for ``tensor`` (a DTensor is described by its local shard)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    numel = local.numel()
    nbytes = numel * local.element_size()
    storage, storage_bytes = _storage_identity(local)
    return PlacementRecord(
        rank=rank,
        name=name,
        kind=kind,
        actual=str(local.device),
        expected=expected,
        bytes=nbytes,
        numel=numel,
        why=why,
        storage=storage,
        storage_bytes=storage_bytes,
    )


def _storage_identity(t: "torch.Tensor") -> tuple[str, int]:
    # Views (ZeRO-3 ds_tensors inside one flat buffer, a fp32 partition that *is* the bit16 one)
    # share a storage; the per-device summary counts each storage once.
    try:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr == 0:  # meta tensors and empty storages have no address: count them one by one
            return "", t.numel() * t.element_size()
        return f"{t.device}@{ptr:x}", st.nbytes()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
        return "", t.numel() * t.element_size()


def iter_tensors(value: Any, prefix: str) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Tensors nested in dicts/lists/tuples, with a path to append to the owner's name.

    A dict key always brings its dot (``.num``) and a list index its brackets (``[0]``), so
    ``f"{key}{path}"`` reads ``running_d.num`` / ``running_d[0]`` even from an empty prefix.
    """
    import torch

    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from iter_tensors(v, f"{prefix}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from iter_tensors(v, f"{prefix}[{i}]")
