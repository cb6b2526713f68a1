"""A per-rank FSDP file (accelerate's ``use_dcp=False`` layout) whose pickle calls ``os.system`` is refused by
``inspect`` and every command naming the file and the global the weights-only unpickler refused, and nothing in
it runs. It was described as holding "neither ShardedTensors nor DTensors ... save again with use_dcp=True"."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

REFUSED = re.compile(r"pytorch_model_fsdp_0_rank0\.bin: refused to load: the pickle references global "
                     r"'(posix|nt|os)\.system'")


class _RunsACommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # what the unpickler would call: os.system("touch MARKER")
        return (os.system, (f"touch {self.marker}",))


def _hostile_save(folder: Path, marker: Path) -> Path:
    """accelerate's per-rank file names, each model file a torch.save whose pickle calls os.system."""
    import torch

    folder.mkdir(parents=True)
    for rank in (0, 1):
        torch.save({"model.embed_tokens.weight": _RunsACommand(marker)}, folder / f"pytorch_model_fsdp_0_rank{rank}.bin")
        torch.save({"state": {}, "param_groups": []}, folder / f"optimizer_0_rank{rank}.bin")
    return folder


@pytest.mark.parametrize("wrapped", [False, True], ids=["save_state_folder", "trainer_checkpoint"])
def test_inspect_and_every_command_name_the_file_and_the_refused_global(tmp_path, run_cli, wrapped):
    marker = tmp_path / "ran"
    src = _hostile_save(tmp_path / ("out/checkpoint-2" if wrapped else "state"), marker)
    if wrapped:
        (src / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    code, stdout, err = run_cli("inspect", src, "--json")
    assert code == 0, err
    cells = {c["command"]: c for c in json.loads(stdout)["commands"]}
    for command, cell in cells.items():
        if command != "verify":
            assert not cell["applies"] and REFUSED.search(cell["why"]), (command, cell)
            assert cell["guarded"] is not wrapped, (command, cell)  # a Trainer checkpoint-N: its own check says it
    for argv in (["reshard", src, "--world-size", "1"], ["convert", src, "--to", "zero3", "--world-size", "1"],
                 ["convert", src, "--to", "fsdp2"], ["consolidate", src], ["export", src]):
        out = tmp_path / f"out_{len(list(tmp_path.iterdir()))}"
        code, _, err = run_cli(*argv, "-o", out)
        assert code in (1, 2) and REFUSED.search(err), (argv, err)
        assert "neither FSDP1's ShardedTensors" not in err and not out.exists()
    assert not marker.exists(), "the pickle's os.system ran"
