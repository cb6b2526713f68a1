"""Compare two ZeRO-3 checkpoint tags tensor by tensor; run by verify_deepspeed_release.py with the
Python of the venv under test (its torch and its installed shardkit), never with this checkout's.

    python _release_roundtrip.py compare ORIGINAL_TAG_DIR ROUND_TRIP_TAG_DIR
    python _release_roundtrip.py ds-config TAG_DIR OUT.json

``compare`` prints one JSON line {"ok", "files", "tensors", "first_difference"}: every *.pt file of
the original has a namesake in the round trip, every tensor equal in dtype, shape and bits, every
other entry equal in repr (a list and a tuple of equal items alike) (what tests/test_convert_fsdp_to_zero3.py checks for the round trip).
``ds-config`` writes the DeepSpeed config the checkpoint recorded (what `convert --to zero3` needs
to write the same file layout back).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _leaves(obj: Any, path: str = "") -> dict[str, Any]:
    import torch

    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in _leaves(value, f"{path}.{key}").items()}
    if isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, list, torch.Tensor)) for v in obj):
        return {k: v for i, value in enumerate(obj) for k, v in _leaves(value, f"{path}[{i}]").items()}
    return {path: obj}


def _plain(value: Any) -> str:
    """repr with lists and tuples alike: a JSON config gives Adam's betas as a list, torch's
    optimizers and the converters write a tuple, and an optimizer reads both the same way."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_plain(v) for v in value) + "]"
    return repr(value)


def _first_difference(original: Path, round_trip: Path) -> tuple[str | None, int, int]:
    import torch

    from shardkit.storage.torch_load import safe_torch_load

    names = sorted(p.name for p in original.glob("*.pt"))
    theirs = sorted(p.name for p in round_trip.glob("*.pt"))
    if not names or names != theirs:
        return f"file names differ: {names} vs {theirs}", len(names), 0
    tensors = 0
    for name in names:
        a = _leaves(safe_torch_load(original / name))
        b = _leaves(safe_torch_load(round_trip / name))
        if a.keys() != b.keys():
            return f"{name}: entries differ: {sorted(a.keys() ^ b.keys())[:5]}", len(names), tensors
        for key, va in a.items():
            vb = b[key]
            if isinstance(va, torch.Tensor):
                tensors += 1
                same = isinstance(vb, torch.Tensor) and va.dtype == vb.dtype and va.shape == vb.shape and (
                    torch.equal(va.view(torch.uint8), vb.view(torch.uint8)) if va.numel() else True)
                if not same:
                    return f"{name}{key}: tensor differs", len(names), tensors
            elif _plain(va) != _plain(vb):
                return f"{name}{key}: {va!r} != {vb!r}", len(names), tensors
    return None, len(names), tensors


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "compare":
        diff, files, tensors = _first_difference(Path(argv[1]), Path(argv[2]))
        print(json.dumps({"ok": diff is None, "files": files, "tensors": tensors, "first_difference": diff}))
        return 0 if diff is None else 1
    if len(argv) == 3 and argv[0] == "ds-config":
        from shardkit.storage.torch_load import safe_torch_load

        states = safe_torch_load(Path(argv[1]) / "zero_pp_rank_0_mp_rank_00_model_states.pt")
        Path(argv[2]).write_text(json.dumps(states["ds_config"]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
