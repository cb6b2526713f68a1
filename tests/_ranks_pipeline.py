"""A real DeepSpeed PipelineModule save (a rank target: spawned processes import it by module name): three
layers (Linear, ReLU, Linear) over as many pipeline stages as ranks, ZeRO-1, one AdamW step on gloo."""

from __future__ import annotations


def save_pipeline(save_dir: str) -> None:
    """``engine.save_checkpoint(save_dir, tag='global_step1')`` of a PipelineModule with one stage per rank."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)]
    net = PipelineModule(layers=layers, num_stages=dist.get_world_size(), loss_fn=torch.nn.MSELoss(),
                         partition_method="uniform")
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
              "steps_per_print": 10_000}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()), config=config)
    engine.train_batch(iter([(torch.randn(1, 8), torch.randn(1, 4)) for _ in range(2)]))
    engine.save_checkpoint(save_dir, tag="global_step1")
