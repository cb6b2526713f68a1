"""TORCH_CUDA_ARCH_LIST as DeepSpeed's JIT op builder parses it: whether it parses
(``deepspeed_arch_list_error``, a replay of DeepSpeed's own rule), the same architectures in the
form it accepts (``fixed_arch_list``) and the one fix shardkit prints for it (``arch_list_fix``),
shared by `shardkit check` and a failed op build.
"""

from __future__ import annotations

import re


def deepspeed_arch_list_error(value: str | None) -> str | None:
    """The exception DeepSpeed >= 0.19.0's JIT builder raises for this TORCH_CUDA_ARCH_LIST, or None
    when it parses. A replay of ``CUDAOpBuilder.compute_capability_args`` (jit_mode): entries split
    on ';' and whitespace, sorted by ``int()`` of every '.'-part (before any '+'), the last one
    given '+PTX', then ``int(major)`` and ``int(minor.split('+')[0])``. So torch's own '9.0a',
    '10.0f' or 'sm_90' fail with ValueError (DeepSpeed PR #7977 made JIT builds read the variable;
    PR #8619, open, would accept the suffixes)."""
    if value is None or not value.strip():
        return None  # unset or blank: DeepSpeed asks the visible GPUs instead
    ccs = [cc.strip() for cc in value.strip().replace(" ", ";").split(";") if cc.strip()]
    try:
        ccs = sorted(ccs, key=lambda cc: tuple(int(part.split("+")[0]) for part in cc.split(".")))
        if not any("+PTX" in cc for cc in ccs):
            ccs[-1] += "+PTX"
        for parts in (cc.split(".") for cc in ccs):
            int(parts[0])
            int(parts[1].split("+")[0])
    except (ValueError, IndexError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


_ARCH_DOTTED = re.compile(r"^(\d+)\.(\d+)[A-Za-z]*(\+PTX)?$")
_ARCH_SM = re.compile(r"^(?:sm_|compute_)(\d+)(\d)[A-Za-z]*$")


def fixed_arch_list(value: str) -> str | None:
    """The same architectures in the plain 'X.Y[+PTX]' form DeepSpeed parses ('9.0a' -> '9.0',
    '8.0;9.0a+PTX' -> '8.0;9.0+PTX'); None when an entry is not recognisable as an architecture."""
    out: list[str] = []
    for cc in (c.strip() for c in value.strip().replace(" ", ";").split(";")):
        if not cc:
            continue
        m = _ARCH_DOTTED.match(cc)
        if m:
            token = f"{int(m.group(1))}.{int(m.group(2))}{m.group(3) or ''}"
        else:
            m = _ARCH_SM.match(cc)
            if not m:
                return None
            token = f"{int(m.group(1))}.{int(m.group(2))}"
        if token not in out:
            out.append(token)
    return ";".join(out) or None


def _export(value: str) -> str:
    return f'export TORCH_CUDA_ARCH_LIST="{value}"' if ";" in value else f"export TORCH_CUDA_ARCH_LIST={value}"


def arch_list_fix(value: str | None) -> str:
    """The one fix shardkit gives for a TORCH_CUDA_ARCH_LIST DeepSpeed cannot parse (the `check`
    finding and a failed op build both say it): the same architectures exported in 'X.Y[+PTX]'
    form ('sm_90' -> 9.0), or, when an entry is not an architecture, what to put there."""
    fixed = fixed_arch_list(value or "")
    fix = _export(fixed) if fixed else "export TORCH_CUDA_ARCH_LIST=<major.minor of your GPU, e.g. 9.0 for H100>"
    return fix + " (or unset it: DeepSpeed then builds for the visible GPUs)"
