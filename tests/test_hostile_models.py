"""Models a careless user hands to the preflight and to DeepSpeed: no parameters, every parameter
frozen, parameters left on the meta device, tied weights, one module held under two names. What a
user would notice: the preflight names the model's problem and the fix (and fails, on every rank
alike), and healthy sharing (tied or shared parameters) is counted once, never reported as missing
or duplicated. Plain torch in one process; DeepSpeed ZeRO-3 for real on 2 gloo ranks and under
`shardkit launch`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import shardkit
from shardkit.core.errors import PreflightError
from shardkit.run.spawn.process import run_ranks
from tests import _ranks_hostile as targets

TIMEOUT_S = 300


def test_a_model_without_parameters_is_named_not_passed():
    with pytest.raises(PreflightError, match=r"\[error\] model: rank 0: the ReLU passed to the preflight has no "
                                             r"parameters: there is nothing to place, check or train") as caught:
        shardkit.preflight(model=nn.ReLU())
    assert "Fix: Pass the module that holds the trained parameters" in str(caught.value)


def test_every_parameter_frozen_is_named_with_the_count_and_the_fix():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # torch accepts it; its step then changes nothing
    with pytest.raises(PreflightError, match=r"every parameter of the Sequential is frozen \(4 tensors, 30 elements "
                                             r"with requires_grad=False\): the optimizer steps nothing") as caught:
        shardkit.preflight(model=model, optimizer=opt)
    assert "Fix: Unfreeze what you mean to train (p.requires_grad_(True)), or add the trainable adapters" in str(caught.value)


def test_a_partly_frozen_model_passes():
    model = nn.Sequential(nn.Linear(4, 4).requires_grad_(False), nn.Linear(4, 2))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    assert shardkit.preflight(model=model, optimizer=opt).ok


def test_parameters_left_on_the_meta_device_are_named_as_meta_with_to_empty_and_a_load():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with torch.device("meta"):
        model[1] = nn.Linear(4, 2)  # a head built under init_empty_weights and never loaded
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(PreflightError) as caught:
        shardkit.preflight(model=model, optimizer=opt)
    text = str(caught.value)
    assert "1.weight  meta    cpu" in text and "1.bias    meta    cpu" in text, text
    assert "0.weight" not in text  # the materialized layer is fine
    assert ("fix (meta): tensors on the meta device hold no data: the model was built under torch.device('meta')"
            in text)
    assert "Call model.to_empty(device=...) and then load the weights" in text


def test_one_parameter_under_two_names_and_tied_weights_are_counted_once():
    shared = targets.Shared()
    tied = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False))
    tied[1].weight = tied[0].weight
    for model in (shared, tied):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, 8) if model is shared else torch.randint(0, 16, (2, 3))).float().pow(2).mean().backward()
        opt.step()
        report = shardkit.preflight(model=model, optimizer=opt)
        assert report.ok, report.render()
        (rank,) = report.ranks
        # encoder.proj and decoder.proj are one Linear: its weight and bias appear once
        expected = ["decoder.proj" not in n for n in rank.param_numels]
        assert all(expected), sorted(rank.param_numels)
        assert len(rank.param_numels) == (4 if model is shared else 1), sorted(rank.param_numels)


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile_models")
    return [r.value for r in run_ranks(targets.zero3_model_cases, 2, args=(str(base / "ckpt"),), timeout=TIMEOUT_S,
                                       backend="gloo")]


@pytest.mark.slow
def test_zero3_a_module_held_under_two_names_is_one_parameter_in_preflight_step_and_resume(zero3):
    for rank, got in enumerate(zero3):
        assert got["shared_names"] == ["encoder.proj.bias", "encoder.proj.weight", "head.bias", "head.weight"]
        assert got["shared_param_names"] == got["shared_names"]
        assert got["shared"]["ok"] and got["shared_after_step"]["ok"], got["shared"].get("text")
        assert "missing" not in got["shared"]["text"] and "lacks" not in got["shared"]["text"]
        resumed = got["shared_resume"]
        assert resumed["equal"] and resumed["preflight"], (rank, resumed)


@pytest.mark.slow
def test_zero3_tied_embeddings_pass_before_and_after_a_step(zero3):
    for got in zero3:
        assert got["tied"] is True
        assert got["tied_report"]["ok"], got["tied_report"].get("text")
        assert got["tied_after_step"]["ok"], got["tied_after_step"].get("text")


@pytest.mark.slow
def test_zero3_with_every_parameter_frozen_is_deepspeeds_bare_assertion(zero3):
    """What DeepSpeed 0.19.8 does with nothing to train under ZeRO-3: ``assert len(set(t.dtype for t
    in tensors)) == 1`` in zero/utils.py ``defragment``, with no message (the next test: `shardkit
    launch` names it)."""
    for got in zero3:
        assert got["frozen_init"] == "AssertionError: ", got["frozen_init"]
        # given only the trainable parameters (none), torch's optimizer refuses the empty list instead
        assert got["frozen_init_trainable_only"] == "ValueError: optimizer got an empty parameter list"


FROZEN_SCRIPT = textwrap.dedent(
    """
    import deepspeed, torch.nn as nn
    deepspeed.init_distributed()
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)).requires_grad_(False)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3}}
    deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    print("initialized", flush=True)
    """
)


@pytest.mark.slow
def test_under_launch_a_frozen_model_is_named_instead_of_deepspeeds_bare_assertion(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(FROZEN_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    proc = subprocess.Popen([sys.executable, "-m", "shardkit", "launch", "--launcher", "torchrun", "--standalone",
                             "--nproc_per_node", "2", str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=tmp_path, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(out)
    assert proc.returncode != 0 and "initialized" not in out
    assert "UsageError: deepspeed.initialize stopped with a bare AssertionError (deepspeed/runtime/zero/utils.py:" in out, out[-4000:]
    assert "every parameter of the Sequential is frozen (4 tensors, 90 elements with requires_grad=False)" in out
    assert "Fix: unfreeze what you mean to train" in out
