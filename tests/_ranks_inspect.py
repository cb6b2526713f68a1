"""The accelerate FSDP saves the command-table test (tests/test_inspect_table.py) runs every command on:
the tiny Llama the DeepSpeed layouts train (tests/_ranks_layouts.py), one AdamW step on 2 gloo ranks,
saved by accelerate's own ``save_fsdp_model``/``save_fsdp_optimizer`` in every layout the Trainer
and Accelerate write, each with the model's config.json beside it as the Trainer saves it. A rank
target: spawned processes import it by module name."""

from __future__ import annotations

import functools
import os
from pathlib import Path

#: label -> (FSDP version, fsdp_state_dict_type, use_dcp)
ACCELERATE_SAVES = {
    "fsdp1_sharded": (1, "SHARDED_STATE_DICT", True),
    "fsdp1_bins": (1, "SHARDED_STATE_DICT", False),
    "fsdp2_full": (2, "FULL_STATE_DICT", True),
    "fsdp1_local": (1, "LOCAL_STATE_DICT", True),
    "fsdp2_bins": (2, "SHARDED_STATE_DICT", False),
}


def save_accelerate_layouts(base: str) -> None:
    """Each ACCELERATE_SAVES label into ``base/<label>/checkpoint-2``."""
    import torch
    import torch.distributed as dist
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin, save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from shardkit.engines.model_factory import synthetic_batch, tiny_llama

    rank = dist.get_rank()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(dist.get_world_size()),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(dist.get_world_size()))
    state = PartialState(cpu=True)
    for label, (version, kind, use_dcp) in ACCELERATE_SAVES.items():
        plugin = FullyShardedDataParallelPlugin(fsdp_version=version, state_dict_type=kind,
                                                cpu_ram_efficient_loading=False)
        model = tiny_llama("tiny", seed=0)
        config = model.config
        if version == 1:
            policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
            model = FullyShardedDataParallel(model, use_orig_params=True, auto_wrap_policy=policy,
                                             device_id=torch.device("cpu"))
        else:
            fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        ids = synthetic_batch(config.vocab_size, 2, 8, 0, rank)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        folder = Path(base) / label / "checkpoint-2"
        save_fsdp_model(plugin, state, model, str(folder), use_dcp=use_dcp)
        save_fsdp_optimizer(plugin, state, opt, model, str(folder), use_dcp=use_dcp)
        if rank == 0:
            config.save_pretrained(folder)
        dist.barrier()
