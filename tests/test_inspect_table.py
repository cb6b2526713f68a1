"""The command table ``shardkit inspect`` prints (``checkpoint.layout.support.TABLE``) says the truth:
for a real save of every layout, every command inspect says applies is run and succeeds, and every
command it says does not apply is run and refuses (exit 1 or 2) with inspect's reason in its message
(the reason's first sentence, the words the command itself refuses with). A layout added to the table
without a source here, or a command changed without its cell, fails this test.

Sources: DeepSpeed ZeRO-1/2/3 and universal saves, the refusal markers and a Trainer checkpoint-N
(tests/_ranks_layouts.py); accelerate's FSDP saves of the same tiny Llama in each layout
(tests/_ranks_inspect.py), two of them without optimizer state, one outside a Trainer checkpoint-N; shardkit's FSDP2 save, a resharded ZeRO-3 with a manifest and a converted
DCP folder (the hostile sweep's sources); a from_pretrained folder, and the same weights as a Trainer
checkpoint-N saved without DeepSpeed or sharded FSDP.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests import _ranks_inspect as I
from tests import _ranks_layouts as L
from tests._accelerate_state import save_state_folder

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DEEPSPEED = ("zero1", "zero2_bf16", "zero2_offload", "zero3", "universal", "trainer_zero2",
             "autoep", "tensor_parallel", "pipeline", "moe", "nvme", "mixed_stages")
SWEEP = ("fsdp2", "zero3_sealed", "fsdp2_converted")
WEIGHTS_ONLY = ("fsdp1_bins_weights_only", "fsdp2_full_plain_weights_only", "dcp_model_folder")
KINDS = (*DEEPSPEED, *I.ACCELERATE_SAVES, *WEIGHTS_ONLY, *SWEEP, "hf", "trainer_weights", "accelerate_state")


@pytest.fixture(scope="session")
def sources(tmp_path_factory, sweep_sources) -> dict[str, Path]:
    from shardkit.engines.model_factory import tiny_llama
    from shardkit.run.spawn.process import run_ranks

    base = tmp_path_factory.getbasetemp()
    out: dict[str, Path] = dict(L.build_layouts(base / "layouts"))
    run_ranks(I.save_accelerate_layouts, 2, args=(str(base / "accelerate"),), timeout=400, device="cpu")
    out.update({label: base / "accelerate" / label / "checkpoint-2" for label in I.ACCELERATE_SAVES})
    out.update({kind: sweep_sources.root(kind) for kind in SWEEP})
    tiny_llama("tiny", seed=0).save_pretrained(base / "hf_model")
    out["hf"] = base / "hf_model"
    out["accelerate_state"] = save_state_folder(base / "accelerate_state")  # Accelerator.save_state, one process
    # a Trainer checkpoint-N saved without DeepSpeed or sharded FSDP: the weights and the Trainer's state
    out["trainer_weights"] = base / "trainer_weights" / "checkpoint-3"
    shutil.copytree(out["hf"], out["trainer_weights"])
    (out["trainer_weights"] / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    # saved without optimizer state (save_only_model, or accelerate's save_fsdp_model alone): inside a Trainer
    # checkpoint-N, and as a plain folder (accelerate's save_state outside the Trainer)
    out["fsdp1_bins_weights_only"] = base / "weights_only" / "checkpoint-2"
    shutil.copytree(out["fsdp1_bins"], out["fsdp1_bins_weights_only"], ignore=shutil.ignore_patterns("optimizer_*"))
    out["fsdp2_full_plain_weights_only"] = base / "weights_only" / "accelerate_state"
    shutil.copytree(out["fsdp2_full"], out["fsdp2_full_plain_weights_only"], ignore=shutil.ignore_patterns("optimizer*"))
    out["dcp_model_folder"] = out["fsdp1_sharded"] / "pytorch_model_fsdp_0"  # a DCP folder of the weights alone
    configs = base / "ds_configs"
    configs.mkdir(exist_ok=True)
    for stage in (1, 2, 3):
        (configs / f"zero{stage}.json").write_text(json.dumps(L.ds_config(stage, "bf16", False, 1)))
    out["ds_configs"], out["model_config"] = configs, sweep_sources.root("model_config")
    return out


def _argv(command: str, src: Path, out: Path, sources: dict[str, Path]) -> list[Any]:
    """The command line a user would type for ``command`` on ``src``, writing under ``out``."""
    if command == "reshard":
        return ["reshard", src, "--world-size", "1", "-o", out]
    if command.startswith("convert --to zero"):
        target = command.split()[-1]
        return ["convert", src, "--to", target, "--world-size", "1", "--ds-config",
                sources["ds_configs"] / f"{target}.json", "-o", out]
    if command.startswith("convert --to "):
        return ["convert", src, "--to", command.split()[-1], "-o", out]
    if command == "consolidate":
        return ["consolidate", src, "-o", out / "model.safetensors"]
    if command == "export":
        return ["export", src, "-o", out, "--model-config", sources["model_config"]]
    assert command == "verify", command
    return ["verify", src, "--json"]


def _texts(value: Any) -> str:
    """Every string in a --json report, one per line (verify's findings are in its JSON, not stderr)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return "\n".join(_texts(v) for v in value.values())
    if isinstance(value, list):
        return "\n".join(_texts(v) for v in value)
    return ""


def _reason(why: str) -> str:
    """The part of a refusal inspect shows that the command's own message must contain."""
    return why.split(". ")[0]


@pytest.mark.parametrize("kind", KINDS)
def test_every_cell_is_what_the_command_does(sources, tmp_path, run_cli, kind):
    from shardkit.checkpoint.layout.support import COMMANDS

    src = sources[kind]
    code, stdout, err = run_cli("inspect", src, "--json")
    assert code == 0, err
    cells = {c["command"]: c for c in json.loads(stdout)["commands"]}
    assert tuple(cells) == COMMANDS
    wrong = []
    for n, command in enumerate(COMMANDS):
        out = tmp_path / f"out{n}"
        code, stdout, err = run_cli(*_argv(command, src, out, sources))
        said = err + (_texts(json.loads(stdout)) if command == "verify" and stdout.lstrip().startswith("{") else "")
        cell = cells[command]
        if cell["applies"] and code != 0:
            wrong.append(f"{command}: inspect says it applies ({cell['why']}) but it exits {code}: {said[-600:]}")
        elif not cell["applies"] and (code not in (1, 2) or _reason(cell["why"]) not in said):
            wrong.append(f"{command}: inspect says {cell['why']!r}, the command exits {code}: {said[-600:]}")
        elif not cell["applies"] and command != "verify":
            assert not out.exists(), f"{command} refused {src} but wrote {out}"
    assert not wrong, f"{kind} ({src}):\n" + "\n".join(wrong)


_SUGGESTED_CONVERT = re.compile(r"convert --to (zero[123]|fsdp2|universal)(?: \(or ([\w/]+)\))?")
_SUGGESTED_COMMAND = re.compile(r"shardkit (reshard|export|consolidate)(?: or (export|consolidate))?")


def _suggested(why: str) -> set[str]:
    """The shardkit commands a refusal sends the user to ("For DeepSpeed: convert --to zero3 (or zero2/zero1)",
    "shardkit export or consolidate"), as ``COMMANDS`` names them."""
    out = set()
    for m in _SUGGESTED_CONVERT.finditer(why):
        out |= {f"convert --to {t}" for t in [m[1], *(m[2].split("/") if m[2] else [])]}
    for m in _SUGGESTED_COMMAND.finditer(why):
        out |= {c for c in m.groups() if c}
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_a_refusal_sends_the_user_only_to_commands_that_take_the_folder(sources, run_cli, kind):
    """A refusal's way out must work: every other command it names is one inspect says takes that folder (which
    test_every_cell_is_what_the_command_does holds to what the command does). The DCP reshard refusal sent a
    weights-only folder to convert --to zero3, which refuses it."""
    code, stdout, err = run_cli("inspect", sources[kind], "--json")
    assert code == 0, err
    cells = {c["command"]: c for c in json.loads(stdout)["commands"]}
    dead_ends = [f"{c['command']}: {c['why']!r} names {sorted(named)}, which inspect says do not take it"
                 for c in cells.values() if not c["applies"]
                 for named in [{n for n in _suggested(c["why"]) - {c["command"]} if not cells[n]["applies"]}] if named]
    assert not dead_ends, f"{kind} ({sources[kind]}):\n" + "\n".join(dead_ends)


def test_every_row_has_a_cell_for_every_command():
    """A new layout or command is one row or one column: no row may leave a command out."""
    from shardkit.checkpoint.layout.support import COMMANDS, TABLE

    for key, row in TABLE.items():
        missing = [c for c in COMMANDS if c != "verify" and c not in row]
        assert not missing, f"row {key} has no cell for {missing}"


def test_reshard_refusals_of_dcp_with_and_without_optimizer_state_share_their_first_sentence():
    """The weights-only refusal is the full one's first sentence (the reason test_every_cell_is_what_the_command_does
    looks for in reshard's own message) and then where the weights go; pinned word for word, as inspect prints it."""
    from shardkit.checkpoint.layout.description import CheckpointDescription
    from shardkit.checkpoint.layout.support import verdicts

    def reshard_why(**kw: Any) -> str:
        desc = CheckpointDescription(path="/x/ckpt", folder="/x/ckpt", format="dcp", layout="DCP", **kw)
        return next(v.why for v in verdicts(desc) if v.command == "reshard")

    first = "a DCP checkpoint needs no reshard: FSDP2 loads it at any world size (DCP reshards while loading)"
    assert reshard_why(parameters=3, optimizer="Adam") == (
        f"{first}. For DeepSpeed: convert --to zero3 (or zero2/zero1) --world-size N")
    assert reshard_why(parameters=3, optimizer=None) == (
        f"{first}. It holds no optimizer state, so no convert takes it (convert writes training state to resume). "
        "For the weights alone: shardkit export or consolidate")
