"""fp16: one answer for the product and the test suite. ``fp16_support`` says whether
``deepspeed.initialize`` accepts an fp16 config on the accelerator a run here would use, and why not
(DeepSpeed's CPU accelerator needs oneDNN fp16, ``accelerator.probe_cpu_fp16``).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardkit.platform.environment.accelerator import probe_cpu_fp16
from shardkit.platform.environment.facts import EnvironmentFacts, probe_environment
from shardkit.platform.versions import installed_versions, parse_version

# DeepSpeed's CPU accelerator only allows fp16 when oneDNN can run it (PR #7207, 0.16.8); before
# that it always refused fp16 (the engine's check is PR #4843, 0.13.0).
CPU_FP16_PROBE_SINCE = "0.16.8"


@dataclass(frozen=True)
class Fp16Support:
    """Whether DeepSpeed accepts fp16 on the accelerator a run here would use, and why not."""

    supported: bool
    device: str
    reason: str = ""


def fp16_support(
    facts: EnvironmentFacts | None = None, deepspeed_version: str | None = None, device: str | None = None
) -> Fp16Support:
    """Will ``deepspeed.initialize`` accept an fp16 config on this machine? The same test its
    engine applies (``_do_sanity_check``: "Type fp16 is not supported on your device").

    Used by ``shardkit check`` and by the test suite, which skips exactly the fp16 variants here.
    ``device``: "cpu" or "cuda" (default: the accelerator DeepSpeed picks on this machine).
    """
    from packaging.version import Version

    facts = facts or probe_environment()
    device = device or facts.deepspeed_accelerator
    if device != "cpu":
        # CUDA accepts fp16 from compute capability 7.0 (6.x with DS_ALLOW_DEPRECATED_FP16); every
        # GPU a current torch supports is 7.0+, so the CUDA case is not probed further.
        return Fp16Support(True, device)
    ds = deepspeed_version or installed_versions().get("deepspeed")
    if ds is not None and parse_version(ds, "deepspeed version") < Version(CPU_FP16_PROBE_SINCE):
        return Fp16Support(
            False, "cpu",
            f"deepspeed {ds}'s CPU accelerator refuses fp16 on every CPU (oneDNN fp16 is used from "
            f"{CPU_FP16_PROBE_SINCE}, DeepSpeed PR #7207)",
        )
    ok = facts.cpu_fp16 if facts.cpu_fp16 is not None else probe_cpu_fp16()
    if ok:
        return Fp16Support(True, "cpu")
    return Fp16Support(
        False, "cpu",
        "this CPU has no fp16 support in oneDNN (torch.ops.mkldnn._is_mkldnn_fp16_supported() is False: "
        "it needs AVX512-FP16 or AMX-FP16), so DeepSpeed's CPU accelerator refuses fp16",
    )
