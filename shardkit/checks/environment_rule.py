"""Environment rule: what this machine does to a config that is itself fine (a TORCH_CUDA_ARCH_LIST
DeepSpeed cannot parse, fp16 on a CPU without fp16, NVMe/native pinning past `ulimit -l`, a CUDA
torch without a driver). The facts and the table rows live in shardkit.platform.environment (``facts``,
``rows``); this rule only decides which release and run they are judged for."""

from __future__ import annotations

from typing import Any

from shardkit.core.findings import Finding
from shardkit.platform.environment.facts import EnvironmentFacts
from shardkit.platform.environment.rows import environment_findings


def environment_rule_findings(
    cfg: dict[str, Any],
    *,
    facts: EnvironmentFacts | None,
    deepspeed_version: str | None,
    accelerator: bool | None,
    engine: str,
) -> list[Finding]:
    """The known-bad table's environment rows for ``cfg`` on ``facts`` (None: nothing to judge, the
    caller chose a check of the config alone), at the release the config is checked against."""
    if facts is None:
        return []
    return environment_findings(
        cfg, facts=facts, deepspeed_version=deepspeed_version, accelerator=accelerator, engine=engine
    )
