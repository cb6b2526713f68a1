"""What a PEFT adapter folder holds, asked of peft itself: the base model is built on the meta device
(``model_spec.meta_model``), wrapped by ``peft.get_peft_model`` with the saved
``adapter_config.json``, and ``peft.get_peft_model_state_dict`` (what ``PeftModel.save_pretrained``
writes) is called on its state dict: its keys are the adapter file's names, and each value is the
very tensor object of the module name it came from, so the renaming (adapter name removed,
``modules_to_save`` copies, embedding layers) is peft's own, never re-implemented here.

The source checkpoint (a ZeRO-3 or DCP save of the ``PeftModel``) records module names
(``base_model.model.<...>.lora_A.default.weight``); the adapter file uses the saved names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shardkit.checkpoint.ops.export.model_spec import meta_model
from shardkit.core.errors import UsageError
from shardkit.core.files import read_regular_text

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass
class AdapterSpec:
    """The adapter file's tensors, by saved name, and where each comes from in the module."""

    peft_type: str
    source_names: dict[str, str]
    """``{name in adapter_model.safetensors: module (checkpoint) name}``."""
    shapes: dict[str, tuple[int, ...]]
    total_parameters: int


def adapter_spec(config_dir: Path, adapter_dir: Path) -> AdapterSpec:
    """The adapter described by ``adapter_dir/adapter_config.json`` on the base model of ``config_dir``."""
    try:
        import peft
    except ImportError:
        raise UsageError("the checkpoint holds a PEFT adapter and exporting it needs peft, which is not installed: "
                         "pip install peft") from None
    path = adapter_dir / ADAPTER_CONFIG
    try:
        peft_type = json.loads(read_regular_text(path))["peft_type"]
        config = peft.PEFT_TYPE_TO_CONFIG_MAPPING[peft_type].from_pretrained(str(adapter_dir))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{path}: not a peft adapter config peft {peft.__version__} reads ({type(exc).__name__}: "
                         f"{exc}); pass --model-config DIR holding the adapter_config.json the adapter was trained "
                         "with") from None
    import torch

    with torch.device("meta"):
        model = peft.get_peft_model(meta_model(config_dir), config)
    state = model.state_dict()
    names = {id(t): n for n, t in state.items()}
    saved = peft.get_peft_model_state_dict(model, state_dict=dict(state))
    return AdapterSpec(
        peft_type=str(peft_type),
        source_names={k: names[id(t)] for k, t in saved.items()},
        shapes={k: tuple(t.shape) for k, t in saved.items()},
        total_parameters=sum(t.numel() for t in saved.values()),
    )
