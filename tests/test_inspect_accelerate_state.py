"""A plain ``Accelerator.save_state`` folder (``model.safetensors`` + ``optimizer.bin`` + ``random_states_0.pkl``,
no ``config.json``) is inspected as what it is: an Accelerate save_state folder with its optimizer saved. It was
called a ``save_pretrained`` folder with "optimizer none saved", and export refused it saying from_pretrained
loads it as it is, which it cannot without a config.json. Export now writes a from_pretrained folder from it
with ``--model-config``. A real save (tests/_accelerate_state.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._accelerate_state import save_state_folder

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="session")
def state(tmp_path_factory) -> Path:
    return save_state_folder(tmp_path_factory.mktemp("accelerate_state") / "state")


@pytest.fixture(scope="session")
def model_config(tmp_path_factory) -> Path:
    from shardkit.engines.model_factory import tiny_llama

    folder = tmp_path_factory.mktemp("tiny_config")
    tiny_llama("tiny", seed=0).config.save_pretrained(folder)
    return folder


def test_inspect_says_it_is_a_save_state_folder_with_its_optimizer(state, run_cli, tiny_counts):
    assert sorted(p.name for p in state.iterdir()) == ["model.safetensors", "optimizer.bin", "random_states_0.pkl"]
    code, stdout, err = run_cli("inspect", state, "--json")
    assert code == 0, err
    d = json.loads(stdout)
    assert d["format"] == "accelerate-state"
    assert d["layout"] == "Accelerate save_state folder (model.safetensors, optimizer.bin, random_states_0.pkl)"
    assert d["optimizer"] == "saved" and d["optimizer_state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    assert (d["parameters"], d["elements"]) == tiny_counts
    cells = {c["command"]: c for c in d["commands"]}
    assert cells["export"]["applies"] and "cannot load it as it is: pass --model-config DIR" in cells["export"]["why"]
    code, text, _ = run_cli("inspect", state)
    assert "save_pretrained" not in text and "none saved" not in text and "loads it as it is" not in text
    assert "note: no config.json: from_pretrained cannot load this folder as it is" in text


@pytest.fixture(scope="session")
def tiny_counts() -> tuple[int, int]:
    from shardkit.engines.model_factory import tiny_llama

    params = list(tiny_llama("tiny", seed=0).parameters())
    return len(params), sum(p.numel() for p in params)


def test_export_needs_the_model_config_and_then_writes_what_from_pretrained_loads(state, model_config, tmp_path,
                                                                                  run_cli):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    code, _, err = run_cli("export", state, "-o", tmp_path / "no_config")
    assert code == 2 and "no config.json found" in err and "--model-config DIR" in err, err
    assert "loads it as it is" not in err and not (tmp_path / "no_config").exists()
    code, _, err = run_cli("export", state, "-o", tmp_path / "hf", "--model-config", model_config)
    assert code == 0, err
    saved = load_file(state / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert saved and all(torch.equal(loaded[name], t) for name, t in saved.items())


def test_convert_and_reshard_refuse_it_saying_why(state, tmp_path, run_cli):
    code, _, err = run_cli("convert", state, "--to", "fsdp2", "-o", tmp_path / "c")
    assert code == 1 and "optimizer.bin is torch's optimizer.state_dict(), keyed by parameter position" in err, err
    code, _, err = run_cli("reshard", state, "--world-size", "2", "-o", tmp_path / "r")
    assert code == 1 and "which Accelerator.load_state resumes at any number of processes" in err, err
    assert not (tmp_path / "c").exists() and not (tmp_path / "r").exists()
