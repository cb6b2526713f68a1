"""``torch.load(weights_only=True)`` with an explicit allow-list for what DeepSpeed checkpoints hold.

DeepSpeed itself loads every checkpoint file with ``weights_only=False`` (its
``TorchCheckpointEngine.load``), so a checkpoint downloaded from elsewhere can run arbitrary code
the moment it is resumed. shardkit never does that: every file goes through the restricted
unpickler, which refuses any global that is not allow-listed *before* calling it.

The allow-list is exactly the non-torch globals DeepSpeed's own ZeRO checkpoints contain, found by
listing the GLOBAL opcodes of real 0.19.8 saves (ZeRO-3; bf16, fp16 and fp32; with and without
``offload_optimizer``) and by reading the ZeRO-1/2 ``state_dict`` in ``stage_1_and_2.py``:

- ``deepspeed.runtime.zero.config.ZeroStageEnum``     optim files, ``zero_stage``
- ``deepspeed.runtime.fp16.loss_scaler.LossScaler``    optim files, ``loss_scaler`` (bf16/fp32)
- ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``  the same with fp16
- ``deepspeed.utils.tensor_fragment.fragment_address`` ZeRO-1/2 ``param_slice_mappings``

Everything else in those files (OrderedDict, torch.Size, storages, dtypes, tensor rebuild
functions) is on torch's own default list. Client state that carries other objects (Megatron's
``argparse.Namespace``, say) is refused unless the caller passes it in ``extra_globals``.

By default the DeepSpeed names resolve to *inert stand-ins* (``DeepSpeedObjectStub``) so that
reading a checkpoint never imports DeepSpeed; ``real_deepspeed_objects=True`` resolves them to the
real classes, for code that hands the objects back to a DeepSpeed engine or re-saves them.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import Any, Iterable

from shardkit.core.errors import CheckpointError
from shardkit.core.files import fd_path
from shardkit.storage.checkpoint_file import open_checked
from shardkit.storage.structure_observers import parsed, recall

#: Non-torch globals that DeepSpeed ZeRO checkpoints contain (see module docstring for provenance).
DEEPSPEED_SAFE_GLOBALS: tuple[str, ...] = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)

_UNSUPPORTED_GLOBAL = re.compile(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)")
_WEIGHTS_UNPICKLER_DETAIL = re.compile(r"WeightsUnpickler error:(.*?)(?:Check the documentation|$)", re.S)


class DeepSpeedObjectStub:
    """Inert stand-in for a DeepSpeed object found in a checkpoint: keeps its pickled state, runs nothing.

    ``ZeroStageEnum`` values unpickle as ``stub.args == (3,)``; ``LossScaler`` objects keep their
    attributes (``cur_scale``, ``dynamic``...) as plain attributes.
    """

    deepspeed_name: str = ""
    args: tuple[Any, ...]

    def __new__(cls, *args: Any) -> "DeepSpeedObjectStub":
        obj = object.__new__(cls)
        obj.args = args
        return obj

    def __init__(self, *args: Any) -> None:  # the restricted unpickler calls cls(*args) for REDUCE
        pass

    @property
    def value(self) -> Any:
        """The enum value for enum stand-ins (``ZeroStageEnum`` -> 3)."""
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        state = {k: v for k, v in vars(self).items() if k != "args"}
        return f"<{self.deepspeed_name} {self.args or ''}{state or ''}>"

    def __reduce__(self) -> Any:
        raise TypeError(
            f"{self.deepspeed_name} was read as an inert stand-in and cannot be saved again; "
            "load with real_deepspeed_objects=True to re-save DeepSpeed objects"
        )


_STUBS: dict[str, type[DeepSpeedObjectStub]] = {
    name: type(name.rsplit(".", 1)[1] + "Stub", (DeepSpeedObjectStub,), {"deepspeed_name": name})
    for name in DEEPSPEED_SAFE_GLOBALS
}


def deepspeed_stub(name: str, *args: Any, **state: Any) -> DeepSpeedObjectStub:
    """The stand-in for DeepSpeed's ``name(*args)`` with attributes ``state`` (in that order), which
    ``torch_pickle.StubPickler`` writes as the real object pickles: a writer of DeepSpeed's files
    needs no DeepSpeed import (``ZeroStageEnum`` -> ``deepspeed_stub(ZERO_STAGE, 3)``)."""
    obj = _STUBS[name](*args)
    vars(obj).update(state)
    return obj


def _real_deepspeed_globals() -> list[tuple[Any, str]]:
    import importlib

    out = []
    for name in DEEPSPEED_SAFE_GLOBALS:
        module, attr = name.rsplit(".", 1)
        out.append((getattr(importlib.import_module(module), attr), name))
    return out


def _allow_list(real: bool, extra: Iterable[Any]) -> list[Any]:
    base: list[Any] = _real_deepspeed_globals() if real else [(stub, name) for name, stub in _STUBS.items()]
    return [*base, *extra]


def safe_torch_load(
    path: str | Path,
    *,
    map_location: Any = "cpu",
    mmap: bool = False,
    extra_globals: Iterable[Any] = (),
    real_deepspeed_objects: bool = False,
) -> Any:
    """Load a torch checkpoint file with ``weights_only=True`` and the DeepSpeed allow-list.

    ``mmap=True`` maps the file instead of reading it, so only the tensor bytes a caller touches
    are paged in (what the streaming ZeRO-3 reader relies on). ``extra_globals`` adds callables
    (or ``(callable, "module.Name")`` pairs) the caller trusts.

    Raises CheckpointError naming the file for a missing, empty, truncated or corrupted file, and
    naming the offending global for a pickle that would construct or call anything not allowed
    (that refusal happens before the global is called, so nothing in the file runs).
    """
    import pickle

    import torch

    p = Path(path)
    extra = list(extra_globals)
    with open_checked(p) as fh:
        try:
            with torch.serialization.safe_globals(_allow_list(real_deepspeed_objects, extra)):
                # by name, as before (torch maps a file by name), the name of this very open file
                return torch.load(fd_path(fh, p), map_location=map_location, weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exc:
            raise _unsafe_error(p, exc) from None
        except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile, KeyError, IndexError) as exc:
            raise CheckpointError(
                f"{p}: cannot be read as a torch checkpoint ({type(exc).__name__}: {_first_line(exc)}). "
                "The file is truncated or corrupted (an interrupted save or copy?). Re-copy it, or resume "
                "from the previous checkpoint; `shardkit verify` checks every file against the manifest."
            ) from None


def _unsafe_error(p: Path, exc: Exception) -> CheckpointError:
    text = str(exc)
    m = _UNSUPPORTED_GLOBAL.search(text)
    if m:
        name = m.group(1)
        if "." not in name:  # torch strips "builtins." from the names it reports
            name = f"builtins.{name}"
        return CheckpointError(
            f"{p}: refused to load: the pickle references global {name!r}, which is not on shardkit's "
            "allow-list of what DeepSpeed checkpoints contain (nothing from the file was run). A file "
            "that calls arbitrary globals can execute code when loaded. If you wrote this file yourself "
            f"and trust it, pass extra_globals=[{name}] to safe_torch_load."
        )
    m = _WEIGHTS_UNPICKLER_DETAIL.search(text)
    detail = " ".join(m.group(1).split()) if m else _first_line(exc)
    return CheckpointError(
        f"{p}: refused to load: the restricted unpickler stopped at {detail!r} (nothing from the file "
        "was run). The file is corrupted, or it is not a plain torch/DeepSpeed checkpoint (a raw "
        "pickle, or objects that are not allow-listed). Re-copy it or resume from the previous checkpoint."
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# --- reading a checkpoint's structure without torch ------------------------------------------------

# torch.save's pickle names only these globals for plain CPU tensors; each maps to an inert local
# stand-in, everything else is refused before it is called (Python's "restricting globals" recipe).
STORAGE_DTYPES = {
    "FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16", "DoubleStorage": "float64",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool",
}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1}


class TensorRef:
    """Where a tensor's bytes are in a torch zip file: read structure without importing torch."""

    def __init__(self, key: str, dtype: str, storage_offset: int, shape: tuple[int, ...], stride: tuple[int, ...],
                 requires_grad: bool = False):
        self.key, self.dtype, self.storage_offset = key, dtype, storage_offset
        self.shape, self.stride = tuple(shape), tuple(stride)
        self.requires_grad = requires_grad
        self.parameter = False
        self.py_state: dict[str, Any] | None = None
        """Python attributes the tensor was pickled with (``_rebuild_from_type_v2``'s state)."""
        """Pickled as an ``nn.Parameter`` (``torch._utils._rebuild_parameter``)."""
        self.file_offset: int | None = None  # filled in by read_structure
        self.path: str | None = None
        """The file it was read from (filled in by read_structure)."""
        self.record_offset = 0
        """Where its storage record's bytes start in that file (filled in by read_structure)."""
        self.record_nbytes = 0
        """Its whole storage record's size (a view's storage may be larger than the view)."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    def is_contiguous(self) -> bool:
        expected, acc = [], 1
        for d in reversed(self.shape):
            expected.append(acc)
            acc *= d
        return self.numel <= 1 or tuple(reversed(expected)) == self.stride

    def __repr__(self) -> str:
        return f"TensorRef({self.dtype}{list(self.shape)} @ {self.file_offset})"


class _Storage:
    def __init__(self, key: str, dtype: str):
        self.key, self.dtype = key, dtype


class _UnsupportedTensor(Exception):
    """A tensor ``read_structure`` could not describe faithfully (it would be written back without it)."""


def _rebuild_tensor_v2(storage: _Storage, storage_offset: int, size: Any, stride: Any, requires_grad: bool = False,
                       _hooks: Any = None, metadata: Any = None) -> TensorRef:
    if metadata:
        # conj/neg bits and the like: a TensorRef could not write them back (torch.save of a plain
        # CPU tensor passes no metadata)
        raise _UnsupportedTensor(f"a tensor carries metadata {metadata!r}")
    return TensorRef(storage.key, storage.dtype, storage_offset, tuple(size), tuple(stride), bool(requires_grad))


def _rebuild_parameter(data: TensorRef, requires_grad: bool, _hooks: Any) -> TensorRef:
    data.parameter, data.requires_grad = True, bool(requires_grad)
    return data


class TorchSize(tuple):  # type: ignore[type-arg]
    """A ``torch.Size`` read without torch: a tuple that is written back as ``torch.Size``."""


class _TensorType:
    """``torch.Tensor`` named in a pickle (the type argument of ``_rebuild_from_type_v2``)."""


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    out = func(*args)
    if not state:
        return out
    # Python attributes set on a tensor (DeepSpeed's ``ds_id`` on its flat fp32 groups): kept, so
    # the tensor is written back with them
    if new_type is not _TensorType or not isinstance(out, TensorRef) or not isinstance(state, dict):
        raise _UnsupportedTensor(f"a tensor of type {new_type!r} carries state {state!r}")
    out.py_state = dict(state)
    return out


class Dtype(str):
    """A torch dtype named in a pickle (e.g. a loss scaler's ``dtype``): its name only."""


def structure_globals() -> dict[tuple[str, str], Any]:
    from collections import OrderedDict

    allowed: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch", "Tensor"): _TensorType,
        ("torch", "Size"): TorchSize,
    }
    for name in STORAGE_DTYPES:
        allowed[("torch", name)] = name
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"):
        allowed[("torch", name)] = Dtype(name)
    for full, stub in _STUBS.items():
        module, attr = full.rsplit(".", 1)
        allowed[(module, attr)] = stub
    return allowed


def read_structure(path: str | Path, *, allowed: dict[tuple[str, str], Any] | None = None,
                   what: str = "DeepSpeed checkpoints") -> Any:
    """The object a torch zip checkpoint holds, with every tensor as a ``TensorRef`` (no torch import).

    Uses the same allow-list idea as ``safe_torch_load`` on Python's own unpickler: ``find_class``
    returns inert stand-ins for the few globals ``torch.save`` writes and the DeepSpeed stubs, and
    refuses anything else before it could be called. Tensor bytes are not read; each TensorRef
    gets the file offset of its first element (for ``os.copy_file_range``/``pread``). ``allowed``:
    another allow-list (a reader of other files extends ``structure_globals()``), ``what`` names
    those files in the refusal.
    """
    import io
    import pickle
    import struct

    p = Path(path)
    # parsed a moment ago in a verify (structure_observers.reusing_parses), through the same allow-list
    reused = recall(p) if allowed is None else None
    if reused is not None:
        return reused
    reusable = allowed is None
    storages: dict[str, _Storage] = {}
    # every tensor record as it is rebuilt, wherever it ends up (inside a stand-in iter_leaves cannot
    # walk, such as a ShardedTensor's shards): each gets its file offset below
    refs: list[TensorRef] = []

    def rebuild_tensor(*args: Any) -> TensorRef:
        ref = _rebuild_tensor_v2(*args)
        refs.append(ref)
        return ref

    allowed = {**(structure_globals() if allowed is None else allowed),
               ("torch._utils", "_rebuild_tensor_v2"): rebuild_tensor}

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            try:
                return allowed[(module, name)]
            except KeyError:
                module = {"__builtin__": "builtins"}.get(module, module)  # pickle protocol 2 spelling
                raise CheckpointError(
                    f"{p}: refused to load: the pickle references global '{module}.{name}', which is not on "
                    f"shardkit's allow-list of what {what} contain (nothing from the file was run)."
                ) from None

        def persistent_load(self, pid: Any) -> Any:
            if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
                raise CheckpointError(f"{p}: unexpected persistent id {pid!r}: not a torch.save file")
            storage_type, key = pid[1], str(pid[2])
            if storage_type not in STORAGE_DTYPES:
                raise CheckpointError(f"{p}: storage type {storage_type!r} is not supported")
            return storages.setdefault(key, _Storage(key, STORAGE_DTYPES[storage_type]))

    try:
        with open_checked(p) as fh, zipfile.ZipFile(fh) as z:
            names, records = z.namelist(), z.infolist()
            pkl = next((n for n in names if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if pkl is None:
                raise CheckpointError(f"{p}: no data.pkl record: not a torch.save zip file")
            prefix = pkl[: -len("data.pkl")]
            obj = _Unpickler(io.BytesIO(z.read(pkl))).load()
            offsets: dict[str, tuple[int, int]] = {}
            for key in storages:
                info = z.getinfo(f"{prefix}data/{key}")
                if info.compress_type != zipfile.ZIP_STORED:
                    raise CheckpointError(f"{p}: record data/{key} is compressed; torch.save never does that")
                fh.seek(info.header_offset)
                header = fh.read(30)
                name_len, extra_len = struct.unpack("<HH", header[26:30])
                offsets[key] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
    except CheckpointError:
        raise
    except _UnsupportedTensor as exc:
        raise CheckpointError(f"{p}: {exc}, which shardkit's torch-free reader cannot carry over (torch.save of a "
                              "plain CPU tensor writes neither). Save such objects outside the checkpoint") from None
    except (MemoryError, OverflowError, RecursionError) as exc:
        # a damaged length field makes the unpickler allocate that length before it reads (a byte-flip
        # sweep of real data.pkl records asked for more than exists), a damaged nesting recurses: both
        # are damage, not a shortage (data.pkl is small: no tensor bytes)
        raise CheckpointError(
            f"{p}: data.pkl cannot be parsed ({type(exc).__name__}: a damaged length or nesting field): not a "
            "pickle torch.save writes; the file is corrupted. Re-copy it, or resume from the previous checkpoint."
        ) from None
    except (zipfile.BadZipFile, KeyError, EOFError, OSError, ValueError, IndexError, struct.error,
            pickle.UnpicklingError, AttributeError, TypeError) as exc:
        raise CheckpointError(
            f"{p}: cannot be read as a torch checkpoint ({type(exc).__name__}: {_first_line(exc)}). "
            "The file is truncated or corrupted (an interrupted save or copy?). Re-copy it, or resume "
            "from the previous checkpoint."
        ) from None
    for ref in refs:
        ref.record_offset, ref.record_nbytes = offsets[ref.key]
        ref.file_offset = ref.record_offset + ref.storage_offset * ref.itemsize
        ref.path = str(p)
        if (ref.storage_offset + _extent(ref)) * ref.itemsize > ref.record_nbytes:
            raise CheckpointError(f"{p}: tensor {ref!r} reaches past the end of its storage record data/{ref.key} "
                                  f"({ref.record_nbytes} bytes): the file is corrupted")
    parsed(p, obj, records, reusable)  # verify checks what a reader parses, and its zip records (structure_observers)
    return obj


def _extent(ref: TensorRef) -> int:
    """Elements of its storage a tensor view spans (0 for an empty one)."""
    if ref.numel == 0:
        return 0
    return 1 + sum((d - 1) * s for d, s in zip(ref.shape, ref.stride))


def iter_leaves(obj: Any, kind: type | tuple[type, ...]) -> Iterable[Any]:
    """Every ``kind`` instance inside nested dicts/lists/tuples of a loaded checkpoint."""
    if isinstance(obj, kind):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_leaves(v, kind)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_leaves(v, kind)
