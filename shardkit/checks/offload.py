"""Offload rules: settings DeepSpeed accepts silently and then ignores, misroutes or crashes on
later, and the two offload blocks disagreeing with each other."""

from __future__ import annotations

from shardkit.checks.offload_ratio import offload_ratio_findings
from shardkit.config.view import DeepSpeedView, OffloadView
from shardkit.core.findings import Finding, Severity
from shardkit.platform.versions import pin_memory_default


def offload_findings(
    view: DeepSpeedView, *, deepspeed_version: str | None, accelerator: bool | None
) -> list[Finding]:
    out: list[Finding] = []
    opt, par = view.offload_optimizer, view.offload_param
    out += _stage_rules(view, opt, par)
    out += _nvme_path_rules(opt, par)
    out += _disagreement_rules(view, opt, par)
    out += _pin_memory_rules(view, deepspeed_version, accelerator)
    out += offload_ratio_findings(view)
    return out


def pin_memory_for(accelerator: bool | None) -> bool:
    """The pin_memory a run should use. Pinned host memory only speeds up copies to an accelerator
    (and torch can only pin with one), so: off when the run has none, on otherwise. The one rule
    behind `shardkit config`'s default and the pin-memory-no-accelerator check below, which
    `shardkit check --no-accelerator` and `shardkit preflight` (on a machine without one) apply."""
    return accelerator is not False


def _json(value: object) -> str:
    import json

    return json.dumps(value, default=repr)


def _device_key(o: OffloadView) -> str:
    return o.deprecated_key or f"{o.key}.device"


def _stage_rules(view: DeepSpeedView, opt: OffloadView, par: OffloadView) -> list[Finding]:
    out: list[Finding] = []
    stage = view.stage
    if stage is None:
        return out
    zero = view.raw.get("zero_optimization")
    raw = zero.get("stage") if isinstance(zero, dict) else None
    if raw is not None and (isinstance(raw, bool) or not isinstance(raw, int)):
        # pydantic's lax enum coercion (see view.zero_stage): true is stage 1, not "ZeRO on" or 3
        out.append(
            Finding(
                Severity.ERROR if isinstance(raw, bool) else Severity.WARNING,
                "zero_optimization.stage",
                raw,
                f"the stage is written as {_json(raw)}; DeepSpeed's pydantic model coerces it to "
                f"stage {stage} without a word"
                + (" (true is stage 1, false is stage 0)" if isinstance(raw, bool) else ""),
                'write the stage as an integer 0-3 (e.g. "zero_optimization.stage": 3 for ZeRO-3)'
                if isinstance(raw, bool)
                else f'write "zero_optimization.stage": {stage}',
                "stage-type",
            )
        )
    if par.active and stage < 3:
        out.append(
            Finding(
                Severity.ERROR,
                _device_key(par),
                par.device,
                f"offload_param only exists in ZeRO stage 3; at stage {stage} DeepSpeed ignores it silently "
                "and every rank keeps the full parameters on the accelerator",
                'set "zero_optimization.stage": 3, or remove offload_param (offload_optimizer works at stage 1-2)',
                "offload-param-stage",
            )
        )
    if opt.device == "nvme" and stage < 3:
        out.append(
            Finding(
                Severity.ERROR,
                _device_key(opt),
                "nvme",
                f"offload_optimizer to nvme needs ZeRO stage 3 (ZeRO-Infinity); at stage {stage} DeepSpeed "
                "silently treats it as cpu, so optimizer states fill host RAM instead of the NVMe",
                'set "zero_optimization.stage": 3, or use "device": "cpu" if host RAM suffices',
                "offload-nvme-stage",
            )
        )
    if opt.active and stage == 0:
        out.append(
            Finding(
                Severity.ERROR,
                _device_key(opt),
                opt.device,
                "offload_optimizer without ZeRO (stage 0) is ignored: there are no partitioned optimizer states to offload",
                'set "zero_optimization.stage" to 1, 2 or 3',
                "offload-stage0",
            )
        )
    return out


def _nvme_path_rules(opt: OffloadView, par: OffloadView) -> list[Finding]:
    out: list[Finding] = []
    consequence = {
        "offload_param": "zero.Init fails with an AssertionError",
        "offload_optimizer": "the first optimizer step fails with a TypeError deep inside the swapper",
    }
    for o in (opt, par):
        if o.device == "nvme" and (not isinstance(o.nvme_path, str) or not o.nvme_path.strip()):
            name = o.key.rsplit(".", 1)[-1]
            out.append(
                Finding(
                    Severity.ERROR,
                    f"{o.key}.nvme_path",
                    o.nvme_path,
                    f'{name}.device is "nvme" but nvme_path is not set: DeepSpeed accepts the config and '
                    f"{consequence[name]}",
                    f'set "{o.key}.nvme_path" to a directory on a local NVMe drive (e.g. "/local_nvme")',
                    "nvme-path",
                )
            )
    return out


def _disagreement_rules(view: DeepSpeedView, opt: OffloadView, par: OffloadView) -> list[Finding]:
    out: list[Finding] = []
    if view.stage != 3:
        return out
    if par.active and not opt.active:
        out.append(
            Finding(
                Severity.WARNING,
                _device_key(par),
                par.device,
                "parameters are offloaded but offload_optimizer is off: the fp32 master weights and Adam states "
                "(12-16 bytes/param, the bulk of the memory) stay on the accelerator. Deliberate when host RAM "
                "is short (some presets do this on purpose); otherwise a mismatch",
                f'add "offload_optimizer": {{"device": "{"cpu" if par.device == "cpu" else "nvme"}"}} to offload '
                "the optimizer too, or keep this if it is deliberate",
                "offload-param-without-optimizer",
            )
        )
    if par.device == "nvme" and opt.device in ("cpu", "none"):
        out.append(
            Finding(
                Severity.WARNING,
                _device_key(opt),
                opt.device,
                "parameters go to NVMe but optimizer states (about 6x larger than 16-bit params) stay on "
                f"{'the CPU' if opt.device == 'cpu' else 'the accelerator'}: if params need NVMe, the optimizer "
                "states will not fit where they are",
                f'set "{opt.key}.device": "nvme" with an nvme_path, or offload params to cpu instead',
                "offload-nvme-param-cpu-optimizer",
            )
        )
    return out


def _pin_memory_rules(view: DeepSpeedView, deepspeed_version: str | None, accelerator: bool | None) -> list[Finding]:
    out: list[Finding] = []
    active = view.active_offloads
    if not active:
        return out
    default = pin_memory_default(deepspeed_version)
    explicit = [o for o in active if o.pin_memory is not None]
    if len(explicit) == 2 and explicit[0].pin_memory != explicit[1].pin_memory:
        out.append(
            Finding(
                Severity.WARNING,
                f"{view.offload_param.key}.pin_memory",
                view.offload_param.pin_memory,
                f"pin_memory differs between offload_optimizer ({view.offload_optimizer.pin_memory}) and "
                f"offload_param ({view.offload_param.pin_memory}): transfers of one side are synchronous and the "
                "host-memory budget is hard to reason about",
                "set the same pin_memory in both offload blocks",
                "pin-memory-mismatch",
            )
        )
    for o in active:
        if o.pin_memory is None:
            when = (
                f"deepspeed {deepspeed_version} uses {str(default).lower()}"
                if default is not None
                else "the value depends on the DeepSpeed release"
            )
            out.append(
                Finding(
                    Severity.WARNING,
                    f"{o.key}.pin_memory",
                    None,
                    "pin_memory is not set: its default flipped from false to true in DeepSpeed 0.19.5 (PR #8207), "
                    f"so this config pins host memory on some releases and not others ({when})",
                    f'set "{o.key}.pin_memory" explicitly: true on GPU hosts with spare RAM, false otherwise',
                    "pin-memory-unset",
                )
            )
    if accelerator is False:
        for o in active:
            pinned = o.pin_memory if o.pin_memory is not None else default
            if pinned and not pin_memory_for(accelerator):
                out.append(
                    Finding(
                        Severity.WARNING,
                        f"{o.key}.pin_memory",
                        o.pin_memory,
                        "pinned (page-locked) host memory only helps copies to an accelerator and this run has none: "
                        "torch cannot pin without one and DeepSpeed's CPU accelerator skips it, so the setting "
                        "does nothing here and breaks code that pins through torch",
                        f'set "{o.key}.pin_memory": false for CPU-only runs',
                        "pin-memory-no-accelerator",
                    )
                )
    return out
