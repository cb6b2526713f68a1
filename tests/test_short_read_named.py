"""A source file that ends early under a copy is named: ``storage.torch_zip.pread_exact`` raises OSError with
the file as its ``filename`` (the CLI's OSError line names it), and a failed ZeRO-1/2 reshard finds the source to
hash by it (``reshard_zero12._suspects``) and refuses naming that file alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_rank_file_truncated_under_a_zero2_reshard_is_the_one_named(sweep_sources, tmp_path, run_cli, monkeypatch):
    """A ZeRO-2 source (``convert --to zero2`` of the FSDP2 save, manifest sealed) whose rank 1 optimizer file
    is cut to half by someone else once the copy has started: the short read names the file (OSError
    ``filename``), the reshard hashes that file alone (``_suspects``) and refuses naming it; nothing is
    published."""
    import json
    import os

    from shardkit.checkpoint.ops import reshard_zero12

    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 2, "zero_optimization": {"stage": 2}}))
    src = tmp_path / "zero2"
    code, _, err = run_cli("convert", sweep_sources.root("fsdp2"), "--to", "zero2", "--world-size", "2",
                           "--ds-config", tmp_path / "ds.json", "-o", src)
    assert code == 0, err
    victim = src / "step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    armed, real_open, real_write = [False], os.open, reshard_zero12.write_parallel

    def write_parallel(*args: Any, **kwargs: Any) -> Any:
        armed[0] = True  # the source was verified (sizes) and read: the copy starts here
        return real_write(*args, **kwargs)

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if armed[0] and Path(os.fsdecode(path)) == victim:
            armed[0] = False
            os.truncate(victim, victim.stat().st_size // 2)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(reshard_zero12, "write_parallel", write_parallel)
    monkeypatch.setattr(os, "open", open_)
    out = tmp_path / "out"
    code, stdout, err = run_cli("reshard", src, "--world-size", "3", "-o", out)
    monkeypatch.undo()
    assert code == 1, (stdout, err)
    assert "Traceback" not in err and f"{victim} fails verification" in err, err
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" not in err, err
    assert not out.exists() or not any(out.rglob("*optim_states.pt"))
