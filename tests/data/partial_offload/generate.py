"""Build the partial-offload snapshots beside this file: what DeepSpeed 0.19.8 ZeRO-3 places where on
a GPU with ``offload_optimizer: {device: cpu, ratio: R}``, in the format of the H100 recordings
(``tests/data/gpu_truth/``, written by their ``capture.py``).

    python tests/data/partial_offload/generate.py     # rewrites the *.json files here

No GPU recorded these (none was lent to this project when they were made). Each snapshot is the real
H100 recording ``gpu_truth/z3_offopt.json`` (ZeRO-3, bf16, ``offload_optimizer: cpu``, the small
Llama, one rank, one sub-group) re-laid-out by DeepSpeed 0.19.8's own rules, restated here from its
source rather than taken from shardkit, so the judge is tested against DeepSpeed and not against
itself:

1. Partition size (``partition_parameters.py``): every rank holds ``ceil(numel / world_size)``
   elements of each parameter (``ds_numel`` of its ``ds_tensor``).
2. Sub-groups (``stage3.py:1210-1233``, ``_create_fp16_sub_groups``): parameters, in order, are
   added to the current sub-group until its partition elements reach ``sub_group_size``; the last
   parameter closes the last one; one sub-group when the whole partition is below ``sub_group_size``.
   ``fp16_groups``, ``fp16_partitioned_groups`` (per parameter), ``fp16_partitioned_groups_flat``
   and ``fp32_partitioned_groups_flat`` (per sub-group) follow this grouping.
3. Partial offload (``stage3.py:1100-1108``, ``_create_fp32_partitions``): sub-group ``i`` goes to
   ``cpu`` when ``i >= int((1 - ratio) * n)``, else to ``get_accelerator()._name`` ("cuda", i.e. the
   rank's current device ``cuda:LOCAL_RANK``).
4. The step (``stage3.py:1235-1258``, ``_optimizer_step``; loop at 2910): sub-groups are stepped in
   order; a cpu sub-group by the inner DeepSpeedCPUAdam, an accelerator one by a torch AdamW
   (``backup_optimizer``, ``stage3.py:313-326``) that ``capture.py`` does not walk. So after one
   step ``state[k]`` (the inner optimizer's, in insertion order) is the k-th *cpu* sub-group, with
   ``exp_avg``/``exp_avg_sq`` of its fp32 numel on the CPU; before the step there is no state.
5. Everything else keeps the device the H100 recorded for it (``grad_partitions_flat_buffer`` and
   its views, ``inf_or_nan_tracker``, ``_global_grad_norm`` on cpu: ``self.device`` is cpu whenever
   the optimizer is offloaded, ``stage3.py:333``; bit16 parameters and partitions on the accelerator),
   with ``cuda:0`` read as the rank's own device.

``test_partial_offload.py`` checks that the files here are exactly what this script writes, and that
the layout (names, numels, dtypes; not devices, which on CPU are all ``cpu``) matches a real DeepSpeed
ZeRO-3 engine of the same model built on CPU.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE.parent / "gpu_truth" / "z3_offopt.json"
RATIOS = (0.0, 0.3, 0.5, 0.99, 1.0)
# (world_size, recorded rank, sub_group_size): 12, 10, 16 and 1 sub-group(s) of the small Llama.
LAYOUTS = (
    (1, 0, 100_000),
    (2, 1, 100_000),
    (4, 3, 10_000),
    (8, 5, None),  # DeepSpeed's default sub_group_size (1e9): one sub-group
)
# DeepSpeed's float rounding, kept: (1 - 0.9) * 10 is 0.999..., so ratio 0.9 over 10 sub-groups keeps
# none of them on the accelerator (not one).
EXTRA = ((2, 1, 100_000, 0.9),)
STAGE3 = "_DeepSpeedZeroOptimizer_Stage3"


def sub_groups(partitions: list[int], sub_group_size: int | None) -> list[list[int]]:
    """Parameter indices per sub-group, as ``_create_fp16_sub_groups`` forms them."""
    size = 1_000_000_000 if sub_group_size is None else sub_group_size
    if size >= sum(partitions):
        return [list(range(len(partitions)))]
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, n in enumerate(partitions):
        current.append(i)
        total += n
        if total >= size or i == len(partitions) - 1:
            groups.append(current)
            current, total = [], 0
    return groups


def subgroup_devices(count: int, ratio: float, accelerator: str) -> list[str]:
    """``stage3.py:1104-1108``, written as DeepSpeed writes it."""
    devices = []
    for i in range(count):
        if i >= int((1 - ratio) * count):
            devices.append("cpu")
        else:
            devices.append(accelerator)
    return devices


def _entry(name: str, device: str, dtype: str, numel: int) -> dict[str, Any]:
    return {"name": name, "device": device, "dtype": dtype, "numel": numel}


def _phase(template: list[dict[str, Any]], world_size: int, compute: str, groups: list[list[int]],
           devices: list[str], stepped: bool) -> list[dict[str, Any]]:
    params = [e for e in template if e["name"].startswith("param ")]
    by_name = {e["name"]: e for e in template}
    full = [int(p["ds_numel"]) for p in params]  # the template ran on one rank: partition = whole parameter
    part = [math.ceil(n / world_size) for n in full]
    # what param.data holds in this phase (0 for a released placeholder, whole for a persistent one)
    held = [int(by_name[f"opt.fp16_groups[0][{i}]"]["numel"]) for i in range(len(params))]

    out: list[dict[str, Any]] = []
    for p, n in zip(params, part):
        e = copy.deepcopy(p)
        e.update(device=compute, ds_tensor=compute, ds_numel=n)
        out.append(e)
    for i, n in enumerate(part):  # views into grad_partitions_flat_buffer, keyed by ds_id (= i here)
        out.append(_entry(f"opt.{STAGE3}__param_id_to_grad_partition[{i}]", "cpu", "bfloat16", n))
    if stepped:
        out.append(_entry("opt._global_grad_norm", "cpu", "float32", 1))
    for g, members in enumerate(groups):
        for j, i in enumerate(members):
            out.append(_entry(f"opt.fp16_groups[{g}][{j}]", compute, "bfloat16", held[i]))
    for g, members in enumerate(groups):
        for j, i in enumerate(members):
            out.append(_entry(f"opt.fp16_partitioned_groups[{g}][{j}]", compute, "bfloat16", part[i]))
    sizes = [sum(part[i] for i in members) for members in groups]
    for g, n in enumerate(sizes):
        out.append(_entry(f"opt.fp16_partitioned_groups_flat[{g}]", compute, "bfloat16", n))
    for g, n in enumerate(sizes):
        out.append(_entry(f"opt.fp32_partitioned_groups_flat[{g}]", devices[g], "float32", n))
    out.append(_entry("opt.grad_partitions_flat_buffer", "cpu", "bfloat16", sum(part)))
    out.append(_entry("opt.inf_or_nan_tracker", "cpu", "bool", 1))
    out.append(_entry("opt.lp_param_buffer", compute, "bfloat16", sum(part)))
    for i in range(len(params)):
        out.append(_entry(f"opt.param_dict[{i}]", compute, "bfloat16", held[i]))
    persistent = sorted((e for e in template if e["name"].startswith("opt.persistent_parameters[")),
                        key=lambda e: int(e["name"].split("[")[1].rstrip("]")))
    for e in persistent:
        out.append(_entry(e["name"], compute, e["dtype"], int(e["numel"])))
    if stepped:
        cpu_groups = [g for g in range(len(groups)) if devices[g] == "cpu"]
        for k, g in enumerate(cpu_groups):
            out.append(_entry(f"state[{k}].exp_avg", "cpu", "float32", sizes[g]))
            out.append(_entry(f"state[{k}].exp_avg_sq", "cpu", "float32", sizes[g]))
    return out


def name_for(world_size: int, sub_group_size: int | None, ratio: float) -> str:
    sg = "default" if sub_group_size is None else f"{sub_group_size:.0e}".replace("+0", "")
    return f"z3_ratio{ratio:g}_ws{world_size}_sg{sg}"


def build(template: dict[str, Any], world_size: int, rank: int, sub_group_size: int | None, ratio: float) -> dict[str, Any]:
    """One snapshot: rank ``rank`` of ``world_size`` (its GPU ``cuda:rank``, one node)."""
    compute = f"cuda:{rank}"
    config = copy.deepcopy(template["spec"]["config"])
    zero = config["zero_optimization"]
    zero["offload_optimizer"]["ratio"] = ratio
    if sub_group_size is not None:
        zero["sub_group_size"] = sub_group_size
    params = [e for e in template["after_init"] if e["name"].startswith("param ")]
    part = [math.ceil(int(p["ds_numel"]) / world_size) for p in params]
    groups = sub_groups(part, sub_group_size)
    devices = subgroup_devices(len(groups), ratio, compute)
    snap: dict[str, Any] = {
        "format": 1,
        "name": name_for(world_size, sub_group_size, ratio),
        "spec": {"engine": "deepspeed", "config": config},
        "synthetic": (f"derived from gpu_truth/{TEMPLATE.name} (H100) by tests/data/partial_offload/generate.py "
                      "with DeepSpeed 0.19.8's sub-group and partial-offload rules; not recorded on a GPU"),
        "torch": template["torch"],
        "deepspeed": template["deepspeed"],
        "rank": rank,
        "world_size": world_size,
        "local_rank": rank,
        "compute_device": compute,
        "optimizer": {"class": "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam", "fused": False, "capturable": False},
        "sub_groups": len(groups),
        "first_cpu_sub_group": devices.index("cpu") if "cpu" in devices else len(groups),
    }
    snap["after_init"] = _phase(template["after_init"], world_size, compute, groups, devices, stepped=False)
    snap["after_step"] = _phase(template["after_step"], world_size, compute, groups, devices, stepped=True)
    return snap


def build_all(template_path: Path = TEMPLATE) -> dict[str, dict[str, Any]]:
    """Every snapshot by file name."""
    template = json.loads(template_path.read_text())
    out = {}
    for world_size, rank, sub_group_size in LAYOUTS:
        for ratio in RATIOS:
            snap = build(template, world_size, rank, sub_group_size, ratio)
            out[f"{snap['name']}.json"] = snap
    for world_size, rank, sub_group_size, ratio in EXTRA:
        snap = build(template, world_size, rank, sub_group_size, ratio)
        out[f"{snap['name']}.json"] = snap
    return out


def render(snap: dict[str, Any]) -> str:
    """The exact text a snapshot file holds."""
    return json.dumps(snap, indent=1) + "\n"


def main() -> int:
    snaps = build_all()
    for old in HERE.glob("z3_ratio*.json"):
        if old.name not in snaps:
            old.unlink()
    for name, snap in snaps.items():
        (HERE / name).write_text(render(snap))
        print(f"{name}: {snap['sub_groups']} sub-group(s), first on cpu: {snap['first_cpu_sub_group']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
