"""``shardkit inspect`` heads a DeepSpeed PipelineModule checkpoint as one (stages, layer files, every rank in
the world size) above its refusal, where it was headed "DeepSpeed ZeRO-1, world size 1, 2 tensors" (stage 0's
model states) and its second stage's mp_rank_01 files were called tensor-parallel ranks. A real 2-stage save."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import _ranks_pipeline as P

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="session")
def pipeline_save(tmp_path_factory) -> Path:
    from shardkit.run.spawn.process import run_ranks

    root = tmp_path_factory.getbasetemp() / "pipeline_2_stages"
    run_ranks(P.save_pipeline, 2, args=(str(root),), timeout=300, device="cpu")
    return root


def test_a_pipeline_checkpoint_is_headed_with_its_stages_and_layers(pipeline_save, run_cli):
    code, stdout, err = run_cli("inspect", pipeline_save, "--json")
    assert code == 0, err
    d = json.loads(stdout)
    assert d["layout"].startswith("DeepSpeed pipeline-parallel checkpoint (PipelineModule): 2 stages, 3 layers")
    assert d["world_size"] == 2 and d["parameters"] is None
    assert [r["marker"].split(" (")[0] for r in d["refusals"]] == ["pipeline-parallel layer files"]
    assert not any(c["applies"] for c in d["commands"] if c["command"] != "verify")
    code, stdout, _ = run_cli("inspect", pipeline_save)
    assert "layout      DeepSpeed pipeline-parallel checkpoint (PipelineModule): 2 stages" in stdout
    assert "DeepSpeed ZeRO-1," not in stdout and "tensor/model-parallel" not in stdout


def test_every_command_refuses_it_naming_the_layer_files(pipeline_save, tmp_path, run_cli):
    for argv in (["reshard", pipeline_save, "--world-size", "1"], ["convert", pipeline_save, "--to", "fsdp2"],
                 ["consolidate", pipeline_save], ["export", pipeline_save]):
        out = tmp_path / argv[0]
        code, _, err = run_cli(*argv, "-o", out)
        assert code == 1 and "pipeline-parallel layer files (layer_00-model_states.pt" in err, (argv, err)
        assert not out.exists()
