"""A checkpoint whose own index does not cover a tensor is refused by every command that would write it,
with one message (``model.tensors.refuse_uncovered``) naming the folder, the tensor, its dtype and shape
and the first region missing or stored twice, and nothing is written.

The way in is a real 2-rank FSDP2 save (the hostile sweep's ``fsdp2`` source) whose ``.metadata`` loses
the second dim-0 chunk of one tensor (or has it overlap the first), its manifest sealed again so the
digests match: what a save whose rank 1 stopped part-way, or a copy that mixed two saves' ``.metadata``,
leaves. The chunks are then no longer dim-0 slabs covering the tensor, so the byte-range reader falls
back to torch's ``dcp.load``, which would leave the missing rows as ``torch.empty`` left them: before
this check, ``consolidate`` and ``export`` wrote those rows silently.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest

from shardkit.checkpoint.model.tensors import Piece, SourceTensor

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TENSOR = "model.layers.0.mlp.down_proj.weight"
"""float32 [64, 128], stored as two dim-0 chunks of 32 rows, one per rank."""


def _damaged(sweep_sources: Any, dst: Path, overlap: bool = False) -> Path:
    """A copy of the FSDP2 save whose .metadata drops the second chunk of TENSOR (or stretches it over the
    first's last 8 rows), with its manifest's sizes and digests recomputed."""
    from shardkit.storage.manifest import describe_files, read_manifest, write_manifest

    shutil.copytree(sweep_sources.root("fsdp2"), dst, symlinks=True)
    tag = dst / "step2"
    md = pickle.loads((tag / ".metadata").read_bytes())
    chunks = md.state_dict_metadata[f"model.{TENSOR}"].chunks
    assert [tuple(c.offsets) for c in chunks] == [(0, 0), (32, 0)]
    if overlap:
        chunks[1] = type(chunks[1])(offsets=(24, 0), sizes=(40, 128))
    else:
        chunks.pop()
    (tag / ".metadata").write_bytes(pickle.dumps(md))
    manifest = read_manifest(tag)
    manifest.files = describe_files(tag, [e.path for e in manifest.files])
    write_manifest(tag, manifest)
    return dst


def _argv(sweep_sources: Any, command: str, src: Path, out: Path) -> list[Any]:
    if command == "consolidate":
        return ["consolidate", src, "-o", out / "model.safetensors"]
    if command == "export":
        return ["export", src, "-o", out, "--model-config", sweep_sources.root("model_config")]
    if command == "convert --to zero3":
        return ["convert", src, "--to", "zero3", "--world-size", "2", "--ds-config", sweep_sources.root("ds_config"),
                "-o", out]
    if command == "convert --to universal":
        return ["convert", src, "--to", "universal", "-o", out]
    return ["convert", src, "--to", "zero2", "--world-size", "2", "-o", out]


@pytest.mark.parametrize("command", ["consolidate", "export", "convert --to zero3", "convert --to zero2",
                                     "convert --to universal"])
def test_a_tensor_its_index_does_not_cover_is_refused_naming_it_and_nothing_is_written(
        sweep_sources, tmp_path, run_cli, command):
    src = _damaged(sweep_sources, tmp_path / "src")
    parent = tmp_path / "outputs"
    parent.mkdir()
    (parent / "kept.txt").write_text("a user's file beside the output")
    out = parent / "out"
    code, stdout, err = run_cli(*_argv(sweep_sources, command, src, out))
    assert code == 1, (stdout, err)
    assert "Traceback" not in err
    assert (f"{src / 'step2'}: tensor {TENSOR!r} (float32[64, 128]) is not fully stored: of the chunks .metadata "
            "lists, [32:64, 0:128] is in no stored chunk.") in err, err
    assert "Nothing was written; pass a complete checkpoint" in err
    assert sorted(p.name for p in parent.iterdir()) == ["kept.txt"]  # no output, no staging or temporary left


def test_a_chunk_stored_twice_is_refused_naming_the_rows(sweep_sources, tmp_path, run_cli):
    src = _damaged(sweep_sources, tmp_path / "src", overlap=True)
    out = tmp_path / "out" / "model.safetensors"
    code, _, err = run_cli("consolidate", src, "-o", out)
    assert code == 1 and "Traceback" not in err
    assert f"tensor {TENSOR!r} (float32[64, 128]) is not fully stored: of the chunks .metadata lists, [24:32, 0:128] " \
           "is stored in 2 chunks" in err, err
    assert not out.exists()


def test_pieces_name_their_first_gap_overlap_or_excess(tmp_path):
    """The byte-range form of the same check (the readers whose pieces are lists: ZeRO-1/2, FSDP1, universal)."""
    f, g = tmp_path / "rank0.pt", tmp_path / "rank1.pt"

    def fault(*pieces: Piece) -> str | None:
        return SourceTensor("w", "float32", (4, 4), list(pieces)).coverage_fault()

    assert fault(Piece(f, 0, 0, 8), Piece(g, 0, 8, 8)) is None
    assert fault(Piece(g, 0, 12, 4), Piece(f, 0, 0, 8)) == \
        "elements 8..11 of 16 are in no stored piece (the pieces around them are in rank0.pt and rank1.pt)"
    assert fault(Piece(f, 0, 0, 8)) == "elements 8..15 of 16 are in no stored piece"
    assert fault(Piece(f, 0, 0, 10), Piece(g, 0, 8, 8)) == "elements 8..9 are stored twice, in rank0.pt and in rank1.pt"
    assert fault(Piece(f, 0, 0, 16), Piece(g, 0, 16, 2)) == "its pieces hold 18 elements where the tensor has 16"


def test_a_chunk_with_fewer_sizes_than_dims_is_named_not_an_index_error():
    """A damaged .metadata can give a chunk one size for a 2-D tensor (the hostile field sweep drew one): the
    coverage check names the chunk and the shape instead of raising IndexError out of the command."""
    from shardkit.checkpoint.model.tensors import box_fault

    assert box_fault((4, 4), [((0, 0), (4,))]) == "a chunk at offsets [0, 0] with sizes [4] lies outside the shape [4, 4]"
    assert box_fault((4, 4), [((0, 0), (4, -1))]) == \
        "a chunk at offsets [0, 0] with sizes [4, -1] lies outside the shape [4, 4]"
    assert box_fault((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4))]) is None
