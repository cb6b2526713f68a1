"""Fuzzing `shardkit check`: random and mutated configs never crash or hang it, and every finding
names a key."""

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit.checks import check_config, check_file
from shardkit.core.errors import ConfigError
from shardkit.core.findings import Severity
from tests.conftest import DS_CONFIGS

PRESETS = [json.loads(p.read_text()) for p in sorted(DS_CONFIGS.glob("*.json"))]
KNOWN_KEYS = sorted(
    {"fsdp", "train", "wrap", "cpu_offload", "pin_memory", "forward_prefetch", "auto", "enabled", "device",
     "nvme_path", "ratio", "type", "params", "lr", "bfloat16", "fp16", "bf16", "zero_force_ds_cpu_optimizer",
     "fsdp_config", "fsdp_version", "distributed_type", "compute_environment"}
    | {k for cfg in PRESETS for k in cfg}
    | {k for cfg in PRESETS for v in cfg.values() if isinstance(v, dict) for k in v}
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["auto", "cpu", "nvme", "none", "gpu", "AdamW", "bf16", "", "0.14.1"]),
    st.text(max_size=8),
)
keys = st.one_of(st.sampled_from(KNOWN_KEYS), st.text(max_size=12))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=5)),
    max_leaves=25,
)
configs = st.dictionaries(keys, values, max_size=8)


def _paths(cfg, prefix=()):
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))


@st.composite
def mutated_presets(draw):
    cfg = copy.deepcopy(draw(st.sampled_from(PRESETS)))
    for _ in range(draw(st.integers(1, 4))):
        paths = list(_paths(cfg))
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = cfg
        for part in path[:-1]:
            parent = parent[part]
        action = draw(st.sampled_from(["replace", "delete", "insert"]))
        if action == "replace":
            parent[path[-1]] = draw(values)
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(keys)] = draw(values)
    return cfg


def _assert_sane(report):
    for f in report.findings:
        assert isinstance(f.key, str) and f.key.strip(), f
        assert isinstance(f.severity, Severity) and f.message and f.rule
    json.dumps(report.to_dict())  # --json never fails


COMMON = dict(
    deadline=5000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    derandomize=True,
)


@pytest.mark.slow
@settings(max_examples=150, **COMMON)
@given(cfg=configs, world=st.one_of(st.none(), st.integers(1, 64)), accel=st.sampled_from([None, True, False]),
       ds=st.sampled_from([None, "0.14.1", "0.18.0", "0.19.8"]), hf=st.booleans())
def test_random_configs_never_crash(cfg, world, accel, ds, hf):
    _assert_sane(check_config(cfg, world_size=world, accelerator=accel, deepspeed_version=ds, expect_hf_auto=hf))


@pytest.mark.slow
@settings(max_examples=150, **COMMON)
@given(cfg=mutated_presets(), world=st.one_of(st.none(), st.integers(1, 64)), accel=st.sampled_from([None, False]))
def test_mutated_presets_never_crash(cfg, world, accel):
    _assert_sane(check_config(cfg, world_size=world, accelerator=accel, model=["LlamaForCausalLM", "LlamaDecoderLayer"]))


def _one_line_or_sane(p):
    """check_file on a hostile file: a ConfigError of one line naming the file, or a sane report."""
    try:
        report = check_file(p)
    except ConfigError as exc:
        assert str(exc).startswith(str(p)) and "\n" not in str(exc)
        return None
    _assert_sane(report)
    return report


@settings(max_examples=60, **COMMON)
@given(raw=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)))
def test_arbitrary_file_bytes_give_a_config_error_or_a_report(tmp_path_factory, raw):
    p = tmp_path_factory.mktemp("fuzz") / "cfg.json"
    p.write_bytes(raw)
    _one_line_or_sane(p)


def test_deeply_nested_config_does_not_blow_the_stack():
    cfg = {"zero_optimization": {}}
    node = cfg["zero_optimization"]
    for _ in range(5000):
        node["x"] = {}
        node = node["x"]
    _assert_sane(check_config(cfg))


# --- hostile files: alias bombs, deep nesting, duplicate keys, NaN literals -------------------------


@st.composite
def hostile_texts(draw):
    kind = draw(st.sampled_from(["alias-bomb", "alias-cycle", "deep-json", "deep-yaml", "duplicates", "nan"]))
    if kind == "alias-bomb":
        width, depth = draw(st.integers(2, 12)), draw(st.integers(1, 12))
        lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
        lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, depth)]
        return "cfg.yaml", "\n".join(lines) + "\n"
    if kind == "alias-cycle":
        return "cfg.yaml", draw(st.sampled_from(["a: &a [*a]\n", "a: &a {b: *a}\n", "a: &a {b: [1, {c: *a}]}\n"]))
    if kind in ("deep-json", "deep-yaml"):
        depth = draw(st.integers(1, 3000))
        opener, closer = draw(st.sampled_from([('{"a":', "}"), ("[", "]")]))
        body = opener * depth + "1" + closer * depth
        return ("cfg.json", '{"x": ' + body + "}") if kind == "deep-json" else ("cfg.yaml", "x: " + body + "\n")
    if kind == "duplicates":
        key = draw(st.sampled_from(["stage", "device", "zero_optimization", "lr"]))
        a, b = draw(st.integers(0, 3)), draw(st.integers(0, 3))
        return "cfg.json", f'{{"zero_optimization": {{"{key}": {a}, "{key}": {b}}}, "{key}": {a}, "{key}": {b}}}'
    literal = draw(st.sampled_from(["NaN", "Infinity", "-Infinity"]))
    return "cfg.json", f'{{"train_micro_batch_size_per_gpu": 1, "gradient_clipping": {literal}}}'


@pytest.mark.slow
@settings(max_examples=80, **COMMON)
@given(case=hostile_texts())
def test_hostile_files_give_one_line_or_a_sane_report(tmp_path_factory, case):
    name, text = case
    p = tmp_path_factory.mktemp("hostile") / name
    p.write_text(text)
    report = _one_line_or_sane(p)
    if report is not None and ("NaN" in text or "Infinity" in text):
        assert any(f.rule == "non-finite-number" for f in report.errors)


ACCELERATE_KEYS = ["zero_stage", "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path",
                   "offload_param_nvme_path", "zero3_save_16bit_model", "zero3_init_flag", "gradient_clipping",
                   "gradient_accumulation_steps", "deepspeed_config_file"]


@pytest.mark.slow
@settings(max_examples=80, **COMMON)
@given(section=st.dictionaries(st.sampled_from(ACCELERATE_KEYS), values, max_size=6),
       precision=st.sampled_from([None, "bf16", "fp16", "no", 3]))
def test_accelerate_deepspeed_sections_never_crash(section, precision):
    cfg = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "deepspeed_config": section}
    if precision is not None:
        cfg["mixed_precision"] = precision
    _assert_sane(check_config(cfg))
