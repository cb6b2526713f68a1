"""The hostile sweep of what a round of hardening changed, on the session's real ZeRO-3 save (DeepSpeed's
own, tests/_hostile_sweep.py): random words with --json for every checkpoint command (one JSON object on
stdout, exit 0, 1 or 2); a FIFO, a link leading nowhere, a loop link or a link leading outside put in place
of a random file of the save (exit 1 or 2 naming it, or a run whose output verifies and equals the
unmodified source's; never a hang); random extra files beside the tag (each carried or named in
not_carried); random -o placements (inside the source refused before writing, outside written). The tally
goes to docs/reliability.md (scripts/hostile_sweep_tally.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests import _hostile_sweep as H

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("sweep_tally")]

SWEEP = settings(phases=[Phase.explicit, Phase.generate], max_examples=int(os.environ.get("HOSTILE_SWEEP_EXAMPLES", "40")),
                 deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

KIND = "zero3"
WRITERS = ("reshard", "consolidate", "convert --to fsdp2", "export")


def _state(root: Path) -> dict[str, str]:
    """Every entry under ``root`` -> what it is (a link's target, a file's digest): 'nothing written' is equality."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir" if p.is_dir() else "special"
    return out


# --- one JSON object for every ending -------------------------------------------------------------

WORDS = st.sampled_from(["--world-size", "0", "3", "-1", "x", "--to", "fsdp2", "zero9", "universal", "-o", "--tag",
                         "--dry-run", "--force", "--bogus", "--model-config", "--ds-config", "", "-", "--json"])


@SWEEP
@given(data=st.data())
def test_json_is_one_object_for_any_words(sweep_sources, data, tmp_path_factory):
    """Any words after a checkpoint command with --json: one object on stdout, its exit_code the exit, 0, 1 or 2."""
    command = data.draw(st.sampled_from(["inspect", "verify", "reshard", "consolidate", "convert", "export"]), label="command")
    src = data.draw(st.sampled_from(["source", "missing", "a file", "none"]), label="src")
    words = data.draw(st.lists(WORDS, max_size=5), label="words")
    with H.case_folder(sweep_sources.base / "sweep_round") as case_dir:
        (case_dir / "a.txt").write_text("hi")
        given_src = {"source": [sweep_sources.root(KIND)], "missing": [case_dir / "nope"], "a file": [case_dir / "a.txt"],
                     "none": []}[src]
        words = [case_dir / "out" if w == "-" else w for w in words]
        before = _state(sweep_sources.root(KIND))
        done = H.run_cli([command, *given_src, *words, "--json"])
        assert done.code in (0, 1, 2), f"exit {done.code}: {done.out}{done.err}"
        assert "Traceback" not in done.out + done.err
        obj = json.loads(done.out)  # exactly one object: a second one or any other line fails to parse
        assert isinstance(obj, dict) and obj.get("exit_code", done.code) == done.code, done.out
        assert _state(sweep_sources.root(KIND)) == before, "the source changed"
    H.record(f"--json with random words ({src})", command, f"exit {done.code}: one JSON object")


# --- a non-regular file or a link in place of a file ----------------------------------------------


def _place(src: Path, rel: str, what: str, outside: Path) -> None:
    f = src / rel
    f.unlink()
    if what == "FIFO":
        os.mkfifo(f)
    elif what == "link leading nowhere":
        f.symlink_to(f.with_name(f.name + ".gone"))
    elif what == "loop link":
        f.symlink_to(f.name)
    else:  # a link outside: to a copy of the same bytes, so only the link's place can be judged
        f.symlink_to(outside)


@settings(SWEEP, max_examples=2 * SWEEP.max_examples)
@given(data=st.data())
def test_special_file_in_place_of_a_file(sweep_sources, data):
    rel = data.draw(st.sampled_from(sweep_sources.files(KIND)), label="file")
    what = data.draw(st.sampled_from(["FIFO", "link leading nowhere", "loop link", "link outside"]), label="what")
    command = data.draw(st.sampled_from(("inspect", *H.commands_for(KIND))), label="command")
    with H.case_folder(sweep_sources.base / "sweep_round") as case_dir:
        src = sweep_sources.copy(KIND, case_dir)
        outside = case_dir / "elsewhere" / Path(rel).name
        outside.parent.mkdir()
        outside.write_bytes((src / rel).read_bytes())
        _place(src, rel, what, outside)
        if command == "inspect":
            done = H.run_cli(["inspect", src, "--json"])
            assert done.code in (0, 1) and "Traceback" not in done.out + done.err, done.out + done.err
            if done.code == 0 and what == "link outside" and Path(rel).parent != Path("."):
                # every command refuses a tag folder holding a link that leads out of it: so does inspect's verdict
                assert not any(c["applies"] for c in json.loads(done.out)["commands"]), done.out
            label = f"exit {done.code}"
        else:
            argv, output = sweep_sources.command(command, src, case_dir)
            done = H.run_cli(argv)
            text = done.out + done.err
            assert done.code in (0, 1, 2) and "Traceback" not in text, f"exit {done.code} from {argv}:\n{text}"
            if done.code == 0:  # the file was one no command reads: the per-case rule (output verifies, equal tensors)
                if output is not None:  # judge runs the command again, to the same output
                    shutil.rmtree(output) if output.is_dir() else output.unlink()
                label = H.judge(sweep_sources, KIND, command, case_dir, src, may_differ=False)
            else:
                assert Path(rel).name in text, f"{argv} does not name {rel}:\n{text}"
                assert output is None or not output.exists(), f"{argv} exited {done.code} and wrote {output}"
                label = f"exit {done.code}: {H.message_shape(done.out if done.out.lstrip().startswith('{') else done.err)}"
    where = "the tag folder" if Path(rel).parent != Path(".") else f"the root ({rel})"
    H.record(f"{what} in place of a file in {where}", command, label)


# --- extra files beside the tag ------------------------------------------------------------------

EXTRA = st.sampled_from(["random_states_0.pkl", "random_states_1.pkl", "random_states_7.pkl", "scheduler.bin",
                         "sampler.bin", "custom_checkpoint_0.pkl", "notes.txt", "rng_state_1.pth", "zz folder"])


@SWEEP
@given(extras=st.sets(EXTRA, min_size=1, max_size=4))
def test_extra_files_beside_the_tag_are_carried_or_named(sweep_sources, extras):
    with H.case_folder(sweep_sources.base / "sweep_round") as case_dir:
        src = sweep_sources.copy(KIND, case_dir)
        for name in extras:
            if name.endswith("folder"):
                (src / name).mkdir()
                (src / name / "inside.txt").write_text("x")
            else:
                (src / name).write_bytes(name.encode())
        done = H.run_cli(["reshard", src, "--world-size", "3", "-o", case_dir / "out", "--json"])
        assert done.code == 0, done.out + done.err
        r = json.loads(done.out)
        said = " ".join(r["carried"]) + " " + " ".join(r["not_carried"])
        for name in extras:
            assert name in said, f"{name} beside the tag is neither carried nor named: {r['carried']} {r['not_carried']}"
            carried = name in r["carried"]
            assert (case_dir / "out" / name).exists() == carried or name.startswith(("random_states", "rng_state")), name
    H.record("extra files beside the tag", "reshard", "exit 0: each carried or named in not_carried")


# --- where -o lies ----------------------------------------------------------------------------------

PLACES = ("the source", "inside the source", "the tag folder", "inside the tag folder", "a sibling", "a new folder")


@SWEEP
@given(place=st.sampled_from(PLACES), command=st.sampled_from(WRITERS))
def test_output_placement(sweep_sources, place, command):
    with H.case_folder(sweep_sources.base / "sweep_round") as case_dir:
        src = sweep_sources.copy(KIND, case_dir)
        tag = src / (src / "latest").read_text().strip()
        out = {"the source": src, "inside the source": src / "sub", "the tag folder": tag, "inside the tag folder": tag / "sub",
               "a sibling": case_dir / "sibling", "a new folder": case_dir / "new" / "deeper"}[place]
        if command == "consolidate" and place in ("a sibling", "a new folder"):
            out = out / "model.safetensors"
        argv, _ = sweep_sources.command(command, src, case_dir)
        argv = argv[:argv.index("-o") + 1] + [out] + argv[argv.index("-o") + 2:]
        before = _state(src)
        done = H.run_cli(argv)
        inside = place not in ("a sibling", "a new folder")
        if inside:
            assert done.code == 2 and str(out) in done.err, f"{argv}: {done.code} {done.err}"
            assert _state(src) == before, f"{argv} wrote into the source"
        else:
            assert done.code == 0 and out.exists(), f"{argv}: {done.code} {done.err}"
    H.record(f"-o {place}", command, "exit 2, source unchanged" if inside else "exit 0, written")


def test_inspect_says_no_command_takes_a_tag_folder_with_a_link_leading_out(sweep_sources, tmp_path):
    """inspect's verdicts come from the link check the commands run (storage.links): it said 'yes' to every
    command for a tag folder holding a rank file linked from outside, and each command then refused it."""
    src = sweep_sources.copy(KIND, tmp_path)
    tag = src / (src / "latest").read_text().strip()
    rank_file = next(tag.glob("*optim_states.pt"))
    outside = tmp_path / "elsewhere" / rank_file.name
    outside.parent.mkdir()
    shutil.move(rank_file, outside)
    rank_file.symlink_to(outside)
    done = H.run_cli(["inspect", src, "--json"])
    assert done.code == 0, done.err
    verdicts = json.loads(done.out)["commands"]
    assert [c["command"] for c in verdicts if c["applies"]] == [], verdicts
    assert all(rank_file.name in c["why"] and "leads outside the checkpoint folder" in c["why"] for c in verdicts)
    text = H.run_cli(["inspect", src]).out
    assert f"commands: none takes it today: refusing to read {tag}: {rank_file}: a symlink to" in text, text
    refused = H.run_cli(["reshard", src, "--world-size", "3", "-o", tmp_path / "out"])
    assert refused.code == 1 and f"{rank_file}: a symlink to" in refused.err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("rank_file", ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_verify_names_a_loop_link_in_place_of_rank_0s_file(sweep_sources, tmp_path, rank_file):
    """verify of a plain save whose rank 0 file is ``loop -> loop`` ended with the bare 'Too many levels of
    symbolic links' (a stat before the checked open, in the parse cache): it now reports the file as verify does."""
    src = sweep_sources.copy(KIND, tmp_path)
    f = src / (src / "latest").read_text().strip() / rank_file
    f.unlink()
    f.symlink_to(f.name)
    done = H.run_cli(["verify", src, "--json"])
    obj = json.loads(done.out)
    assert done.code == 1 and obj.get("check") == "structure", done.out
    rules = {x["rule"] for x in obj["findings"] if rank_file in x["message"]}
    assert rules == {"ckpt.link.nowhere", "ckpt.structure.rank_file"}, obj["findings"]  # leads nowhere; so missing
