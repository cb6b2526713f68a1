"""`shardkit estimate` and `shardkit config ... --fit` take any number a user or a config.json can give:
random counts, sizes with units, layers, widths, world sizes and batches end in exit 0, 1 or 2 with a
message naming what was refused, never a traceback, each case in seconds (a 1e9-layer typo once ran for
minutes; --params 1e30 ended in an OverflowError)."""

from __future__ import annotations

import contextlib
import io
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit.cli import main
from shardkit.estimate.bounds import MODEL_KEYS

SMALL = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
         "vocab_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64}
CASE_SECONDS = 20  # each case, measured on a loaded 2-core machine; a hang or a per-layer build would be minutes


@pytest.fixture(scope="module", autouse=True)
def _imports_paid_before_any_clock(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A worker's first case would pay for importing torch and transformers (15 s of CASE_SECONDS on a
    loaded 2-core box): one untimed run of the --model, --fit and --params paths first."""
    path = tmp_path_factory.mktemp("warm") / "config.json"
    path.write_text(json.dumps(SMALL))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        for argv in (["config", "zero3", "--fit", "80GiB,512GiB", "--model", str(path), "--world-size", "8",
                      "--no-accelerator"],
                     ["estimate", "--engine", "zero3", "--model", str(path), "--world-size", "8", "--json"],
                     ["estimate", "--engine", "zero3", "--params", "7B", "--world-size", "8"]):
            try:
                main(argv)
            except SystemExit:
                pass


def _run(capsys, argv: list[str]) -> tuple[int, str, str, float]:
    start = time.monotonic()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: an int flag that is not an int
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err, time.monotonic() - start


def _judge(code: int, out: str, err: str, seconds: float, argv: list[str]) -> None:
    assert code in (0, 1, 2), (argv, code, err)
    assert "Traceback" not in out + err, (argv, err)
    assert seconds < CASE_SECONDS, (argv, seconds)
    if code == 2 or (code == 1 and "does not fit" not in err and "no zero3 config fits" not in err):
        assert "error:" in err, (argv, err)  # a refusal says what, the value and the fix


_SUFFIX = st.sampled_from(["", "K", "M", "B", "G", "T", "e3", "e15", "e30", "e400", "GiB", "GB", "TiB", "B ", "x"])
_NUMBER = st.one_of(st.integers(-5, 10**20).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr),
                    st.sampled_from(["0", "0.4", "1", "1e15", "1000000000000001", "9" * 400, "nan", "-1", ""]))
_COUNT_TEXT = st.builds(lambda n, s: n + s, _NUMBER, _SUFFIX)
_INT_TEXT = st.one_of(st.integers(-3, 2**21).map(str), st.sampled_from(["0", "1048576", "1048577", "1e3", "x", "9" * 30]))


@pytest.mark.timeout(600)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=_COUNT_TEXT, largest=st.one_of(st.none(), _COUNT_TEXT), world=_INT_TEXT, gpus=st.one_of(st.none(), _INT_TEXT),
       micro=st.one_of(st.none(), _INT_TEXT), seq=st.one_of(st.none(), _INT_TEXT), gpu_mem=st.one_of(st.none(), _COUNT_TEXT),
       engine=st.sampled_from(["zero3", "zero2", "fsdp"]))
@pytest.mark.slow
def test_estimate_takes_any_number_on_the_command_line(capsys, params, largest, world, gpus, micro, seq, gpu_mem, engine):
    argv = ["estimate", "--engine", engine, "--params", params, "--world-size", world]
    for flag, value in (("--largest-layer", largest), ("--gpus-per-node", gpus), ("--micro-batch", micro),
                        ("--seq-len", seq), ("--gpu-memory", gpu_mem)):
        if value is not None:
            argv += [flag, value]
    _judge(*_run(capsys, argv), argv)


_FIELD = st.one_of(
    st.integers(1, 300), st.sampled_from([0, -1, 2**16, 2**16 + 1, 2**20, 2**24 + 1, 2**30, 10**9, 10**40]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6), st.booleans(), st.none(),
)


@pytest.mark.timeout(900)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.dictionaries(st.sampled_from(sorted(MODEL_KEYS)), _FIELD, max_size=4),
       world=st.sampled_from(["1", "8", "1048576"]), fit=st.booleans())
def test_estimate_and_fit_take_any_number_in_a_config_json(capsys, tmp_path_factory, fields, world, fit):
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps({**SMALL, **fields}))
    if fit:
        argv = ["config", "zero3", "--fit", "80GiB,512GiB", "--model", str(path), "--world-size", world,
                "--no-accelerator"]
    else:
        argv = ["estimate", "--engine", "zero3", "--model", str(path), "--world-size", world, "--json"]
    _judge(*_run(capsys, argv), argv)


def test_the_reported_cases_are_refused_at_once_naming_the_value_and_the_range(capsys, tmp_path):
    code, _, err, seconds = _run(capsys, ["estimate", "--engine", "zero3", "--params", "1e30", "--world-size", "8"])
    assert code == 2 and "--params '1e30': more than 1e+15 parameters" in err and "Traceback" not in err
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SMALL, "num_hidden_layers": 1_000_000_000}))
    code, _, err, seconds = _run(capsys, ["estimate", "--engine", "zero3", "--model", str(path)])
    assert code == 1 and seconds < CASE_SECONDS
    assert "num_hidden_layers=1000000000: out of range; accepted 1 to 65,536" in err and str(path) in err
    code, _, err, _ = _run(capsys, ["estimate", "--engine", "zero3", "--params", "7B", "--world-size", "2000000"])
    assert code == 2 and "--world-size 2000000: out of range; accepted 1 to 1,048,576" in err
    code, _, err, _ = _run(capsys, ["estimate", "--params", "7B", "--gpu-memory", "2PiB"])
    assert code == 2 and "--gpu-memory '2PiB'" in err
    code, _, err, _ = _run(capsys, ["estimate", "--params", "7B", "--gpu-memory", "9000TiB"])
    assert code == 2 and "more than 1024.00 TiB" in err
    code, _, err, _ = _run(capsys, ["config", "zero3", "--fit", "80GiB", "--params", "7B", "--world-size", "0",
                                    "--no-accelerator"])
    assert code == 2 and "--world-size 0: out of range" in err
    code, _, err, _ = _run(capsys, ["config", "zero3", "--fit", ",512GiB", "--params", "7B", "--no-accelerator"])
    assert code == 2 and "--fit ',512GiB': no GPU memory before the comma" in err  # was: no GPU limit at all
    code, _, err, _ = _run(capsys, ["config", "zero3", "--fit", "80GiB,2PB", "--params", "7B", "--no-accelerator"])
    assert code == 2 and "--fit HOST_MEM '2PB'" in err
    code, _, err, _ = _run(capsys, ["estimate", "--params", "7B", "--largest-layer", "8B"])
    assert code == 2 and "--largest-layer 8B is more than --params 7B" in err
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"zero_optimization": {"stage": 3, "sub_group_size": 1, "reduce_bucket_size": Infinity}}')
    code, _, err, _ = _run(capsys, ["estimate", str(cfg), "--params", "7B"])
    assert code == 1 and "zero_optimization.reduce_bucket_size=inf: not a whole number" in err


@pytest.mark.parametrize("cfg, period", [
    ({**SMALL, "num_hidden_layers": 200}, 1),
    # MoE every second layer: the sample repeats every 2 layers, and so do the counted ones
    ({"model_type": "qwen3_moe", "num_hidden_layers": 150, "hidden_size": 64, "intermediate_size": 128,
      "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 2,
      "mlp_only_layers": [], "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 100}, 2),
], ids=["llama", "moe-every-2nd-layer"])
def test_a_deep_config_is_counted_not_built_and_equals_the_built_model(monkeypatch, cfg, period):
    import shardkit.estimate.meta_model as meta_model
    from shardkit.estimate.meta_model import shape_from_config_dict

    layers = cfg["num_hidden_layers"]
    counted = shape_from_config_dict(cfg, "deep")
    assert any(f"layers 64-{layers - 1} counted, not built" in n and f"repeat every {period} layer(s)" in n
               for n in counted.notes), counted.notes
    monkeypatch.setattr(meta_model, "FULL_BUILD_LAYERS", 10**6)  # the same model built layer by layer
    built = shape_from_config_dict(cfg, "deep")
    assert built.params == counted.params and built.total_params == counted.total_params
    assert counted.num_layers == layers and counted.largest_layer_params == built.largest_layer_params


def test_a_model_too_deep_to_describe_tensor_by_tensor_is_refused_naming_the_layers():
    from shardkit.core.errors import ConfigError
    from shardkit.estimate.meta_model import shape_from_config_dict

    with pytest.raises(ConfigError, match=r"num_hidden_layers=60,000 gives 540,0\d\d parameter tensors, more than 262,144"):
        shape_from_config_dict({**SMALL, "num_hidden_layers": 60_000}, "deep")
