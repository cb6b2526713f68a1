"""Describe a DeepSpeed tag folder from its file names and pickled structures (``read_structure``: no
torch, no tensor bytes): ZeRO-0, -1, -2 or -3, precision, offload, world sizes, parameters, the
optimizer; a universal checkpoint (``ds_to_universal`` output); and the markers of layouts nothing
converts correctly, each a ``Refusal``.

What DeepSpeed 0.19.8 writes (``runtime/engine.py``):

- ZeRO-3: ``zero_pp_rank_{r}_mp_rank_{m}_model_states.pt`` per data-parallel rank, and
  ``[bf16_]zero_pp_rank_{r}_mp_rank_{m}_optim_states.pt`` with ``fp32_flat_groups``.
- ZeRO-1/2: one ``mp_rank_{m}_model_states.pt`` (the whole 16-bit module, ``param_shapes``) and
  ``[bf16_]zero_pp_rank_{r}_mp_rank_{m}_optim_states.pt`` with ``single_partition_of_fp32_groups``,
  ``param_slice_mappings`` and ``base_optimizer_state``. ZeRO-0: the model states file alone.
- Tensor parallelism: ``mp_rank_01``... files, ``mp_world_size`` > 1 in the model states.
- Pipeline engines: ``layer_{XX}-model_{..}-model_states.pt`` per layer (``PipelineModule.ckpt_layer_path``).
- Native MoE: ``expp_rank_{e}_mp_rank_{m}_optim_states.pt`` and
  ``layer_{l}_expert_{e}_mp_rank_{m}_model_states.pt`` (``_get_expert_ckpt_name``).
- AutoEP with ZeRO-3: plain ZeRO-3 file names, ``ds_autoep_layers`` in the model states; the experts
  are partitioned over expert groups, and DeepSpeed's own consolidation refuses them
  (``_raise_if_autoep_zero3_consolidated_export``: "would produce incomplete expert tensors").
- NVMe optimizer offload: swapped sub-groups are saved as empty ``fp32_flat_groups`` tensors
  (``stage3.py``: ``torch.empty(0)`` for a swappable sub-group) and their masters and moments are
  copied from the swap folder to ``<tag>/offloaded_tensors/rank{r}/``.
- Universal (``ds_to_universal``): ``mp_rank_00_model_states.pt`` beside ``zero/<param>/fp32.pt``,
  ``exp_avg.pt``, ``exp_avg_sq.pt``, ``step.pt``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shardkit.checkpoint.layout.description import CheckpointDescription, Refusal
from shardkit.checkpoint.zero3.files import RANK_FILE
from shardkit.checkpoint.zero12.files import MODEL_FILE as ZERO12_MODEL_FILE
from shardkit.core.errors import CheckpointError
from shardkit.storage.listing import list_folder
from shardkit.storage.torch_load import TensorRef, read_structure

_MP_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_EXPERT_OPTIM = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_EXPERT_MODEL = re.compile(r"^(?:layer_(\d+)_)?expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_PIPE_LAYER = re.compile(r"^layer_(\d+)-.*model_states\.pt$")
#: The folder ds_to_universal writes beside the model states, and the file every parameter has there.
UNIVERSAL_FOLDER = "zero"
UNIVERSAL_FP32 = "fp32.pt"
#: Where DeepSpeed copies the NVMe swap folder at save time (engine.save_checkpoint).
NVME_FOLDER = "offloaded_tensors"
AUTOEP_KEY = "ds_autoep_layers"

_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def is_deepspeed_folder(folder: Path) -> bool:
    """True when ``folder`` holds DeepSpeed rank files (or a universal checkpoint's ``zero/``)."""
    listed = list_folder(folder)  # the command's one listing of it (storage.listing)
    if (folder / UNIVERSAL_FOLDER).is_dir() and any(_MP_MODEL.match(name) for name in listed.names):
        return True
    return any(name.endswith(("_model_states.pt", "_optim_states.pt")) for name in listed.files)


def mixed_stages(tag_dir: Path, names: Iterable[str]) -> Refusal | None:
    """ZeRO-3 per-rank model files beside a ZeRO-1/2 save's ``mp_rank_00_model_states.pt``: two saves of
    different stages copied into one folder, or None. From the names alone; ``inspect`` lists it as a marker
    (so every command is refused by ``support.refuse_unsupported``) and the ZeRO-1/2 reader raises it, the
    same words either way."""
    names = list(names)
    zero3 = sorted(n for n in names if (m := RANK_FILE.match(n)) and m.group(4) == "model")  # ZeRO-3's per-rank ones
    # ds_to_universal of a ZeRO-3 save keeps both kinds of model file beside its zero/ atoms folder and no
    # optimizer file: one conversion's output, not two saves
    if ZERO12_MODEL_FILE not in names or not zero3 or UNIVERSAL_FOLDER in names:
        return None
    shown = ", ".join(zero3[:3]) + (" ..." if len(zero3) > 3 else "")
    return Refusal(
        f"{shown} beside the ZeRO-1/2 files ({ZERO12_MODEL_FILE})", str(tag_dir),
        "ZeRO-3 rank files and ZeRO-1/2 files mixed in one folder (two saves of different stages): a ZeRO-1/2 save "
        f"writes one {ZERO12_MODEL_FILE}, a ZeRO-3 save one zero_pp_rank_R_mp_rank_00_model_states.pt per rank, and "
        "reading either way would mix the partitions of two runs",
        "Pass a folder one save wrote (re-copy the tag folder from the run that saved it)")


def _value(stub: Any) -> Any:
    return getattr(stub, "value", stub)


def _dict(value: Any) -> dict[str, Any]:
    """``value`` when it is a dict, else an empty one (a hostile or older file's odd entry reads as absent)."""
    return value if isinstance(value, dict) else {}


def _int(value: Any) -> int | None:
    value = _value(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _dtype(t: Any) -> str | None:
    return t.dtype if isinstance(t, TensorRef) else None


def _numel(shape: Any) -> int:
    dims = list(shape) if isinstance(shape, (list, tuple)) else None
    if dims is None or not all(isinstance(d, int) and d >= 0 for d in dims):
        raise CheckpointError(f"param_shapes holds {shape!r} where a parameter's shape belongs: not a DeepSpeed "
                              "model-states file shardkit knows")
    return math.prod(dims)


def _refusals(tag_dir: Path, names: list[str], model_state: dict[str, Any], model_file: str,
              optim: dict[str, Any], optim_file: str) -> list[Refusal]:
    """The markers of layouts that no command converts correctly, as found in this folder."""
    mixed = mixed_stages(tag_dir, names)
    out: list[Refusal] = [mixed] if mixed is not None else []
    mp_ranks = sorted({int(m.group(3)) for n in names if (m := RANK_FILE.match(n))}
                      | {int(m.group(1)) for n in names if (m := _MP_MODEL.match(n))})
    mp_world = int(model_state.get("mp_world_size") or 1)
    # a PipelineEngine counts its stages as model-parallel ranks (mp_rank_01... one per stage): with pipeline
    # layer files and tp_degree 1 recorded, mp_rank_01 is the second stage, not a tensor-parallel slice
    tp_degree = _int(_dict(model_state.get("checkpoint_parallel_dimensions")).get("tp_degree"))
    stages_only = tp_degree == 1 and any(_PIPE_LAYER.match(n) for n in names)
    if not stages_only and (mp_world > 1 or any(r > 0 for r in mp_ranks)):
        shown = [n for n in names if "mp_rank_01" in n][:2] or [model_file]
        out.append(Refusal(
            f"tensor/model-parallel ranks (mp_world_size {mp_world}, files {', '.join(shown)})", str(tag_dir),
            "each parameter is split across tensor-parallel ranks as well as data-parallel ones, and shardkit reads "
            "data-parallel partitions only: the slices would be written as whole tensors",
            "Resume with the same tensor-parallel size, or convert with DeepSpeed's ds_to_universal (it merges the "
            "slices where the model records universal_checkpoint_info) and load with checkpoint.load_universal"))
    pipe = [n for n in names if _PIPE_LAYER.match(n)]
    if pipe:
        out.append(Refusal(
            f"pipeline-parallel layer files ({', '.join(pipe[:2])}{' ...' if len(pipe) > 2 else ''})", str(tag_dir),
            "a PipelineEngine saves each stage's layers in their own files, which shardkit's readers do not assemble",
            "Resume with the same pipeline topology, or use DeepSpeed's ds_to_universal and checkpoint.load_universal"))
    experts = [n for n in names if _EXPERT_OPTIM.match(n) or _EXPERT_MODEL.match(n)]
    if experts:
        out.append(Refusal(
            f"native DeepSpeed MoE expert files ({', '.join(experts[:2])}{' ...' if len(experts) > 2 else ''})",
            str(tag_dir),
            "expert weights and their optimizer state live in per-expert and per-expert-parallel-rank files that "
            "shardkit does not read: a conversion would drop or mis-assemble the experts",
            "Resume with the same expert-parallel size with DeepSpeed's own load_checkpoint"))
    if model_state.get(AUTOEP_KEY):
        out.append(Refusal(
            f"'{AUTOEP_KEY}' in the model states (DeepSpeed AutoEP)", f"{tag_dir / model_file}",
            "the experts are partitioned over expert groups, not over the data-parallel ranks these files look "
            "partitioned by, so a ZeRO-3 reading would produce incomplete expert tensors (DeepSpeed's own "
            "zero_to_fp32 refuses them for the same reason)",
            "Use DeepSpeed's ds_to_universal.py (expert-aware) and resume with checkpoint.load_universal"))
    offload = _offload(model_state)
    flats = optim.get("fp32_flat_groups") or optim.get("single_partition_of_fp32_groups") or []
    empty = [i for i, t in enumerate(flats) if isinstance(t, TensorRef) and t.numel == 0]
    if (tag_dir / NVME_FOLDER).is_dir() or offload == "nvme" or empty:
        marker = (f"{NVME_FOLDER}/ (the NVMe swap folder DeepSpeed copies into the checkpoint)"
                  if (tag_dir / NVME_FOLDER).is_dir() else "zero_optimization.offload_optimizer.device 'nvme'")
        if empty:
            marker += f"; fp32 sub-group(s) {empty[:4]} saved empty in {optim_file}"
        out.append(Refusal(
            marker, str(tag_dir),
            "the optimizer state was swapped to NVMe: the rank files hold empty fp32 partitions for the swapped "
            "sub-groups and their masters and moments are in DeepSpeed's own swap files, which shardkit does not read",
            "Resume with the same world size and NVMe offload (DeepSpeed restores the swap files itself), or resume "
            "once with offload_optimizer.device 'cpu' and save again"))
    return out


def _offload(model_state: dict[str, Any]) -> str | None:
    zero = _dict(_dict(model_state.get("ds_config")).get("zero_optimization"))
    device = _dict(zero.get("offload_optimizer")).get("device")
    return str(device) if device not in (None, "none") else None


def _pipeline_heading(desc: CheckpointDescription, names: list[str], model_state: dict[str, Any]) -> None:
    """A PipelineModule save headed as one: stages and layer files, every rank counted in the world size. Its
    model-states file is stage 0's, listing stage 0's parameters only, so no parameter count is given."""
    layers = sorted({int(m.group(1)) for n in names if (m := _PIPE_LAYER.match(n))})
    if not layers:
        return
    degrees = _dict(model_state.get("checkpoint_parallel_dimensions"))
    stages, tp = _int(degrees.get("pp_degree")), _int(degrees.get("tp_degree")) or 1
    shown = "? stages" if stages is None else f"{stages} stage{'s' if stages != 1 else ''}"
    desc.layout = (f"DeepSpeed pipeline-parallel checkpoint (PipelineModule): {shown}, {len(layers)} layers "
                   f"(layer_{layers[0]:02d}..layer_{layers[-1]:02d} files), ZeRO-{desc.stage} optimizer files")
    dp = _int(model_state.get("dp_world_size"))
    desc.world_size = dp * stages * tp if dp is not None and stages is not None else None
    desc.parameters = desc.elements = None
    desc.notes.append(f"the weights are in the per-layer files (layer_XX-*model_states.pt, {len(layers)} layers); "
                      "each stage's model states list only that stage's parameters, so none are counted here"
                      + (f"; {dp} data-parallel rank(s) per stage" if dp is not None else ""))


def describe_deepspeed(tag_dir: Path, given: str) -> CheckpointDescription:
    """Describe the DeepSpeed tag folder ``tag_dir`` (ZeRO-0..3 or universal) from its small files.

    Reads rank 0's model states and optimizer-states pickles with ``read_structure`` (tensors are
    offsets, never read); raises CheckpointError (from the reader) when they are not readable.
    """
    names = list(list_folder(tag_dir).names)  # sorted
    zero3_models = sorted(n for n in names if (m := RANK_FILE.match(n)) and m.group(4) == "model")
    optims = sorted((int(m.group(2)), n) for n in names if (m := RANK_FILE.match(n)) and m.group(4) == "optim"
                    and m.group(3) == "00")
    mp_models = sorted(n for n in names if _MP_MODEL.match(n))
    # ds_to_universal copies mp_rank_00_model_states.pt from ZeRO-1/2, every zero_pp_rank model file from ZeRO-3
    universal = (tag_dir / UNIVERSAL_FOLDER).is_dir() and bool(mp_models or zero3_models)
    model_file = next((n for n in zero3_models if n.startswith("zero_pp_rank_0_")), None) or next(iter(mp_models), None)
    model_state = _dict(read_structure(tag_dir / model_file)) if model_file is not None else {}
    optim_file = optims[0][1] if optims else ""
    osd = _dict(_dict(read_structure(tag_dir / optim_file)).get("optimizer_state_dict")) if optim_file else {}
    cfg = _dict(model_state.get("ds_config"))
    stage, stage_source = _int(osd.get("zero_stage")), f"zero_stage in {optim_file}"
    if stage is None:
        stage, stage_source = _int(_dict(cfg.get("zero_optimization")).get("stage")), f"ds_config in {model_file}"
    if stage is None:
        stage, stage_source = (3, "per-rank model-states files") if zero3_models else (0, "no optimizer files")
    precision = ("bf16" if any(n.startswith("bf16_") for n in names) or _dict(cfg.get("bf16")).get("enabled")
                 else "fp16" if _dict(cfg.get("fp16")).get("enabled") else "fp32")
    shapes = [g for g in model_state.get("param_shapes") or [] if isinstance(g, dict)]
    frozen = model_state.get("frozen_param_shapes") or {}
    all_shapes = [s for g in shapes for s in g.values()] + (list(frozen.values()) if isinstance(frozen, dict) else [])
    desc = CheckpointDescription(
        path=given, folder=str(tag_dir), format="deepspeed-universal" if universal else "deepspeed",
        layout="DeepSpeed universal checkpoint (ds_to_universal)" if universal else f"DeepSpeed ZeRO-{stage}",
        stage=None if universal else stage, stage_source=None if universal else stage_source, precision=precision, offload=_offload(model_state),
        world_size=_int(model_state.get("dp_world_size")) or len(optims) or 1,
        parameters=len(all_shapes) if model_state else None,
        elements=sum(_numel(s) for s in all_shapes) if model_state else None,
        step=_int(model_state.get("global_steps")),
    )
    desc.dtypes["weights"] = _TORCH_DTYPES[precision]
    opt_cfg = _dict(cfg.get("optimizer"))
    desc.optimizer = str(opt_cfg["type"]) if opt_cfg.get("type") else ("client optimizer" if osd else None)
    if osd:
        flats = osd.get("fp32_flat_groups") or osd.get("single_partition_of_fp32_groups") or []
        if flats and _dtype(flats[0]):
            desc.dtypes["fp32 masters"] = str(_dtype(flats[0]))
        state = _dict(osd.get("optimizer_state_dict") or osd.get("base_optimizer_state")).get("state")
        if isinstance(state, dict) and state:
            first = next(iter(state.values()))
            desc.optimizer_state_keys = sorted(first) if isinstance(first, dict) else []
            moment = next((v for v in (first or {}).values() if isinstance(v, TensorRef) and v.numel > 1), None)
            if moment is not None:
                desc.dtypes["optimizer state"] = moment.dtype
    if universal:
        params = sorted(d for d in (tag_dir / UNIVERSAL_FOLDER).iterdir() if (d / UNIVERSAL_FP32).is_file())
        # ZeRO-1/2's conversion gives tied aliases and buffers an fp32.pt too; ZeRO-3's none to frozen parameters
        skipped = {*_dict(model_state.get("shared_params")), *(model_state.get("buffer_names") or [])}
        frozen_names = set(frozen) if isinstance(frozen, dict) else set()
        desc.parameters = len(({d.name for d in params} - skipped) | frozen_names)
        desc.world_size = None
        # beside fp32.pt, the optimizer's own atoms (exp_avg.pt, exp_avg_sq.pt, step.pt), one file each per trainable
        # parameter (frozen ones, aliases and buffers have fp32.pt alone)
        atoms = {f.stem for d in params for f in d.iterdir() if f.suffix == ".pt"}
        desc.optimizer_state_keys = sorted(atoms - {Path(UNIVERSAL_FP32).stem})
        desc.dtypes = {"fp32 masters": "float32"}  # the 16-bit weights are not part of a universal checkpoint
        desc.notes.append(f"a universal checkpoint loads at any world size with checkpoint.load_universal; it was "
                          f"converted from a DeepSpeed run at {int(model_state.get('dp_world_size') or 0)} rank(s)")
    desc.refusals = _refusals(tag_dir, names, model_state, model_file or "", osd, optim_file)
    _pipeline_heading(desc, names, model_state)
    if mixed_stages(tag_dir, names) is not None:  # rank 0's optimizer file tells one of the two saves' stage
        desc.layout = f"DeepSpeed, ZeRO-1/2 and ZeRO-3 files mixed (rank 0's optimizer file: ZeRO-{stage})"
    return desc
