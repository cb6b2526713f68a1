"""Manifest: streamed checksums, canonical config digest, round trip, clear errors."""

import hashlib
import json

import pytest

from shardkit.config.loading import config_digest
from shardkit.core.errors import CheckpointError
from shardkit.storage.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    file_digest,
    read_manifest,
    seal,
)


def test_digests_stream_in_chunks(tmp_path):
    import blake3

    data = bytes(range(256)) * 1000
    (tmp_path / "f").write_bytes(data)
    assert file_digest(tmp_path / "f", "sha256", chunk=1000) == hashlib.sha256(data).hexdigest()
    assert file_digest(tmp_path / "f", "blake3", chunk=1000) == blake3.blake3(data).hexdigest()


def test_new_manifests_use_blake3_and_sha256_ones_still_verify(tmp_path, monkeypatch):
    """blake3 by default (format_version 2, each file naming its algorithm); SHARDKIT_HASH=sha256
    writes what shardkit wrote before (format_version 1, readable by older releases); both verify,
    and a changed byte fails either with the algorithm named."""
    from shardkit.storage.verify import verify_checkpoint

    for algorithm, version in (("blake3", 2), ("sha256", 1)):
        tag = tmp_path / algorithm / "step1"
        tag.mkdir(parents=True)
        (tag / "model.pt").write_bytes(b"weights")
        monkeypatch.setenv("SHARDKIT_HASH", algorithm)
        seal(tag, engine="torch")
        raw = json.loads((tag / MANIFEST_NAME).read_text())
        assert raw["format_version"] == version and set(raw["files"][0]) == {"path", "size", algorithm}
        entry = read_manifest(tag).files[0]
        assert entry.algorithm == algorithm and entry.digest == file_digest(tag / "model.pt", algorithm)
        assert verify_checkpoint(tag).ok
        (tag / "model.pt").write_bytes(b"weightz")
        assert [(f.key, f.value) for f in verify_checkpoint(tag).errors] == [("model.pt", f"{algorithm} mismatch")]
    monkeypatch.delenv("SHARDKIT_HASH")
    tag = tmp_path / "default"
    tag.mkdir()
    (tag / "a.pt").write_bytes(b"x")
    assert seal(tag, engine="torch").files[0].algorithm == "blake3"


def test_an_unknown_shardkit_hash_at_a_library_seal_is_warned_naming_the_choices_and_the_default_used(
        tmp_path, monkeypatch, capsys):
    # a library save runs mid-training: refusing would lose the run (the CLI refuses at start instead)
    (tmp_path / "a.pt").write_bytes(b"x")
    monkeypatch.setenv("SHARDKIT_HASH", "md4")
    assert seal(tmp_path, engine="torch").files[0].algorithm == "blake3"
    err = capsys.readouterr().err
    assert "SHARDKIT_HASH='md4' is not one of blake3, sha256: expected blake3 or sha256" in err, err
    assert "using blake3 for this run" in err, err


@pytest.mark.parametrize("entry, match", [
    ({"path": "a.pt", "size": 1}, r"field files\[0\] is \{'blake3': None, 'sha256': None\}: must have exactly one digest"),
    ({"path": "a.pt", "size": 1, "sha256": "a" * 64, "blake3": "b" * 64}, r"must have exactly one digest, sha256 or blake3"),
    ({"path": "a.pt", "size": 1, "blake3": "B" * 64}, r"field files\[0\]\.blake3 is 'BBBB.*must be 64 lowercase hex"),
])
def test_a_file_entry_without_exactly_one_valid_digest_is_refused(tmp_path, entry, match):
    body = {**Manifest("torch", "t", 1).to_dict(), "files": [entry]}
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match=match):
        read_manifest(tmp_path)
    assert FileEntry.of("a.pt", 1, "blake3", "c" * 64).to_dict() == {"path": "a.pt", "size": 1, "blake3": "c" * 64}


def test_config_digest_ignores_key_order_not_values():
    a = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": True}}
    b = {"bf16": {"enabled": True}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}, "stage": 3}}
    assert config_digest(a) == config_digest(b)
    b["zero_optimization"]["stage"] = 2
    assert config_digest(a) != config_digest(b)
    assert config_digest(None) is None


def test_seal_lists_every_file_and_round_trips(tmp_path):
    tag = tmp_path / "step3"
    (tag / "sub").mkdir(parents=True)
    (tag / "model.pt").write_bytes(b"abc")
    (tag / "sub" / "rank0.pt").write_bytes(b"defg")
    m = seal(tag, engine="torch", step=3, dtype="bf16", config_digest=config_digest({"lr": 1}))
    back = read_manifest(tag)
    assert [(f.path, f.size) for f in back.files] == [("model.pt", 3), ("sub/rank0.pt", 4)]
    assert back.tag == "step3" and back.step == 3 and back.engine == "torch" and back.world_size == 1
    assert {"torch", "shardkit"} <= set(back.versions)
    assert back.to_dict() == m.to_dict()


def test_missing_or_malformed_manifest_names_the_file(tmp_path):
    with pytest.raises(CheckpointError, match=rf"{MANIFEST_NAME}.*incomplete"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"{MANIFEST_NAME}: manifest is not valid JSON"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({**Manifest("torch", "t", 1).to_dict(), "format_version": 99}))
    with pytest.raises(CheckpointError, match="format_version 99 is newer"):
        read_manifest(tmp_path)


@pytest.mark.parametrize("field, value, match", [
    ("world_size", "2", r"field world_size must be an int, got '2' \(str\)"),
    ("world_size", True, r"field world_size must be an int, got True \(bool\)"),
    ("step", 1.5, r"field step must be an int or null, got 1\.5"),
    ("engine", 3, r"field engine must be a string, got 3"),
    ("files", [{"path": "a.pt", "size": "10", "sha256": "x"}], r"field files\[0\]\.size must be an int, got '10'"),
])
def test_manifest_fields_of_the_wrong_type_are_named(tmp_path, field, value, match):
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({**Manifest("torch", "t", 1).to_dict(), field: value}))
    with pytest.raises(CheckpointError, match=rf"{MANIFEST_NAME}: {match}"):
        read_manifest(tmp_path)


def _write(tmp_path, **fields):
    data = {**seal_dict(), **fields}
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))
    return tmp_path / MANIFEST_NAME


def seal_dict():
    """A valid manifest's fields: one deepspeed rank pair at world size 1."""
    files = [{"path": "zero_pp_rank_0_mp_rank_00_model_states.pt", "size": 3, "sha256": "a" * 64},
             {"path": "zero_pp_rank_0_mp_rank_00_optim_states.pt", "size": 4, "sha256": "b" * 64}]
    return {**Manifest("deepspeed", "global_step2", 1, zero_stage=3).to_dict(), "files": files}


@pytest.mark.parametrize("field, value, match", [
    ("world_size", 10**12, r"field world_size is 1000000000000: must be between 1 and 1,048,576 ranks"),
    ("world_size", -1, r"field world_size is -1: must be between 1"),
    ("world_size", 0, r"field world_size is 0: must be between 1"),
    ("step", -5, r"field step is -5: must be a step count >= 0"),
    ("zero_stage", 7, r"field zero_stage is 7: ZeRO stages are 0, 1, 2 and 3"),
    ("engine", "megatron", r"field engine is 'megatron': must be one of \['deepspeed', 'fsdp2', 'torch'\]"),
    ("tag", "../../etc", r"field tag is '\.\./\.\./etc': a tag is one folder name"),
    ("tag", ".shardkit-tmp-x", r"field tag is '\.shardkit-tmp-x': names starting with '\.shardkit-tmp-' are staging"),
    ("config_digest", "abc", r"field config_digest is 'abc': must be 64 lowercase hex digits"),
    ("format_version", 0, r"field format_version is 0: format versions start at 1"),
    ("dtype", "x" * 1000, r"field dtype is 'xxx.*\.\.\. \(1002 characters\): must be a short printable name"),
    ("files", [{"path": "../../etc/passwd", "size": 1, "sha256": "a" * 64}],
     r"field files\[0\]\.path is '\.\./\.\./etc/passwd': contains '\.\.': files must be inside the checkpoint folder"),
    ("files", [{"path": "/etc/passwd", "size": 1, "sha256": "a" * 64}],
     r"field files\[0\]\.path is '/etc/passwd': an absolute path"),
    ("files", [{"path": "a.pt", "size": -1, "sha256": "a" * 64}], r"field files\[0\]\.size is -1: must be a byte count"),
    ("files", [{"path": "a.pt", "size": 1, "sha256": "nothex"}], r"field files\[0\]\.sha256 is 'nothex': must be 64"),
    ("files", [{"path": "a.pt", "size": 1, "sha256": "a" * 64}] * 2, r"field files\[1\]\.path is 'a\.pt': listed twice"),
])
def test_manifest_values_out_of_range_name_the_field_the_value_and_why(tmp_path, field, value, match):
    _write(tmp_path, **{field: value})
    with pytest.raises(CheckpointError, match=rf"{MANIFEST_NAME}: {match}"):
        read_manifest(tmp_path)


def test_non_finite_time_and_missing_required_field_are_refused(tmp_path):
    text = json.dumps(seal_dict()).replace('"created_unix": ', '"created_unix": NaN, "x": ')
    (tmp_path / MANIFEST_NAME).write_text(text)  # json.loads accepts NaN
    with pytest.raises(CheckpointError, match=r"field created_unix is nan: must be a finite time"):
        read_manifest(tmp_path)
    data = seal_dict()
    del data["world_size"]
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"field world_size is missing"):
        read_manifest(tmp_path)


def test_deeply_nested_manifest_is_a_clean_error_not_a_recursion_error(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=r"manifest JSON is nested too deeply to parse"):
        read_manifest(tmp_path)
    # deep enough to be suspicious, shallow enough for json to parse: refused by the depth check
    _write(tmp_path, extra={"a": json.loads("[" * 200 + "]" * 200)})
    with pytest.raises(CheckpointError, match=r"nested more than 64 levels deep"):
        read_manifest(tmp_path)


def test_huge_manifest_and_huge_number_are_refused_without_reading_them_whole(tmp_path):
    with open(tmp_path / MANIFEST_NAME, "wb") as fh:
        fh.truncate((64 << 20) + 1)  # sparse: no disk used
    with pytest.raises(CheckpointError, match=r"larger than 64 MiB, far more than a manifest"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text('{"world_size": ' + "9" * 5000 + "}")
    with pytest.raises(CheckpointError, match=r"manifest is not valid JSON \(.*digits"):
        read_manifest(tmp_path)


def test_manifest_that_is_not_a_regular_file_is_named(tmp_path):
    import os

    os.mkfifo(tmp_path / MANIFEST_NAME)  # reading a fifo would block forever
    with pytest.raises(CheckpointError, match=rf"{MANIFEST_NAME}: is a FIFO \(named pipe\), not a regular file.*Re-save"):
        read_manifest(tmp_path)


def test_what_shardkit_writes_passes_the_checks(tmp_path):
    tag = tmp_path / "global_step2"
    tag.mkdir()
    (tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"abc")
    m = seal(tag, engine="deepspeed", world_size=1, zero_stage=3, step=2, dtype="bf16", offload_optimizer="cpu",
             offload_param="none", config_digest=config_digest({"a": 1}), extra={"resharded_from": {"path": "/x"}})
    assert read_manifest(tag).to_dict() == m.to_dict()


def test_a_fifo_swapped_in_after_the_check_never_blocks_read_manifest(tmp_path, monkeypatch):
    from tests._corrupt import call_without_blocking, fifo_swapped_in_after_a_check

    (tmp_path / "f").write_bytes(b"x")
    seal(tmp_path, engine="torch")
    fifo_swapped_in_after_a_check(monkeypatch, tmp_path / MANIFEST_NAME)
    m = call_without_blocking(lambda: read_manifest(tmp_path), tmp_path / MANIFEST_NAME)
    assert [f.path for f in m.files] == ["f"]
