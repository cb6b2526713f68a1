"""Environment checks: the known-bad table's environment rows, each forced through an injected probe
(TORCH_CUDA_ARCH_LIST, RLIMIT_MEMLOCK, a CUDA torch without a driver, a CPU without fp16), and
reported by `versions`, `check`, `preflight`, `launch` and `smoke` with the fix."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap

import pytest

from shardkit.checks import check_config
from shardkit.core.findings import Severity
from shardkit.platform.environment import accelerator
from shardkit.platform.environment import facts as env_facts
from shardkit.platform.environment import fp16 as env_fp16
from shardkit.platform.environment.accelerator import CudaProbe
from shardkit.platform.environment.arch_list import deepspeed_arch_list_error, fixed_arch_list
from shardkit.platform.environment.facts import probe_environment, run_has_accelerator
from shardkit.platform.environment.fp16 import fp16_support
from shardkit.platform.environment.memlock import has_cap_ipc_lock
from shardkit.platform.environment.report import EnvironmentCheckError, require_runnable_here
from shardkit.platform.environment.rows import environment_findings

GPU = CudaProbe(build="12.8", available=True, device_count=1)
NO_DRIVER = CudaProbe(
    build="12.8", available=False,
    reason="CUDA initialization: The NVIDIA driver on your system is too old (found version 11040).",
)
CPU_BUILD = CudaProbe(build=None, available=None)
ZERO3 = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {"stage": 3},
}
FP16 = {**ZERO3, "fp16": {"enabled": True}}
NVME_PARAMS = {
    **ZERO3,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme", "pin_memory": True}},
}
PINNED_CPU = {
    **ZERO3,
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
}


def facts(environ=None, *, memlock=None, cuda=GPU, cpu_fp16=True):
    return probe_environment(environ or {}, memlock_bytes=memlock, cuda=cuda, cpu_fp16=cpu_fp16)


def rules(findings):
    return {f.rule.split(":", 1)[1]: f for f in findings}


@pytest.fixture
def clean_env(monkeypatch):
    """No environment variable of this machine leaks into a test that sets its own."""
    for name in ("TORCH_CUDA_ARCH_LIST", "DS_PIN_MEMORY_BACKEND", "DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# --- TORCH_CUDA_ARCH_LIST ------------------------------------------------------------------------

ARCH_LISTS = ["9.0", "9.0a", "8.0;9.0a+PTX", "9.0+PTX", "8.0 9.0", "10.0f", "12.0a", "sm_90", "8.0;", "90", " 8.6 ; 9.0 "]


@pytest.mark.parametrize("value", ARCH_LISTS)
def test_arch_list_rule_is_deepspeeds_own(value):
    """The replay fails exactly where the installed DeepSpeed's FusedAdam JIT builder fails, with its message."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    builder = FusedAdamBuilder()
    builder.jit_mode = True
    builder._jit_arch_list = value.strip() or None
    try:
        builder.compute_capability_args()
        real = None
    except (ValueError, IndexError) as exc:
        real = f"{type(exc).__name__}: {exc}"
    assert deepspeed_arch_list_error(value) == real


@pytest.mark.parametrize(
    "value, fixed", [("9.0a", "9.0"), ("8.0;9.0a+PTX", "8.0;9.0+PTX"), ("10.0f 12.0a", "10.0;12.0"), ("sm_90a", "9.0"), ("hopper", None)]
)
def test_fixed_arch_list_parses(value, fixed):
    assert fixed_arch_list(value) == fixed
    if fixed:
        assert deepspeed_arch_list_error(fixed) is None


def test_hopper_arch_list_is_an_error_with_the_exact_export():
    (f,) = environment_findings(None, facts=facts({"TORCH_CUDA_ARCH_LIST": "9.0a"}), deepspeed_version="0.19.8")
    assert f.rule == "known-bad:ds-7977-arch-list-suffix" and f.severity is Severity.ERROR
    assert f.key == "env:TORCH_CUDA_ARCH_LIST" and f.value == "9.0a"
    assert "invalid literal for int() with base 10: '0a'" in f.message and "PR #7977" in f.message
    assert f.fix.startswith("export TORCH_CUDA_ARCH_LIST=9.0 ")
    (g,) = environment_findings(None, facts=facts({"TORCH_CUDA_ARCH_LIST": "8.0;9.0a+PTX"}), deepspeed_version="0.19.8")
    assert g.fix.startswith('export TORCH_CUDA_ARCH_LIST="8.0;9.0+PTX"')


def test_arch_list_row_follows_the_release_and_the_torch_build():
    hopper = {"TORCH_CUDA_ARCH_LIST": "9.0a"}
    # before PR #7977 (0.19.0) JIT builds asked the GPUs and never parsed the variable
    assert environment_findings(None, facts=facts(hopper), deepspeed_version="0.18.9") == []
    assert environment_findings(None, facts=facts({"TORCH_CUDA_ARCH_LIST": "9.0"}), deepspeed_version="0.19.8") == []
    (f,) = environment_findings(None, facts=facts(hopper, cuda=CPU_BUILD), deepspeed_version="0.19.8")
    assert f.severity is Severity.WARNING and "CPU build of torch" in f.message
    # FSDP2 builds no DeepSpeed op
    assert environment_findings({"fsdp": {}}, facts=facts(hopper), deepspeed_version="0.19.8", engine="fsdp") == []


def test_arch_list_is_no_error_for_a_cpu_run_on_a_cuda_build():
    """A Hopper image (CUDA torch, TORCH_CUDA_ARCH_LIST=9.0a): CPU ranks use DeepSpeed's
    CPU op builders, which never read the variable, so `smoke --device cpu` / `check --no-accelerator`
    run there; a GPU run is refused; an unstated run on a machine without a GPU is warned."""
    hopper = facts({"TORCH_CUDA_ARCH_LIST": "9.0a"})
    assert require_runnable_here({"zero3": ZERO3}, accelerator=False, facts=hopper) == []
    assert environment_findings(ZERO3, facts=hopper, deepspeed_version="0.19.8", accelerator=False) == []
    with pytest.raises(EnvironmentCheckError, match=r"zero3: this machine cannot run it: env:TORCH_CUDA_ARCH_LIST='9\.0a'.*"
                       r"Fix: export TORCH_CUDA_ARCH_LIST=9\.0 "):
        require_runnable_here({"zero3": ZERO3}, accelerator=True, facts=hopper)
    no_gpu = facts({"TORCH_CUDA_ARCH_LIST": "9.0a"}, cuda=CudaProbe(build="12.8", available=False, reason="no GPU"))
    (f,) = [f for f in environment_findings(ZERO3, facts=no_gpu, deepspeed_version="0.19.8") if f.key.endswith("ARCH_LIST")]
    assert f.severity is Severity.WARNING and "harmless for a CPU run" in f.message and "--accelerator" in f.message
    assert f.fix.startswith("export TORCH_CUDA_ARCH_LIST=9.0 ")


def test_run_has_accelerator_is_deepspeeds_pick():
    """One answer for config, smoke, preflight: DS_ACCELERATOR=cpu or no CUDA device is a CPU run."""
    assert run_has_accelerator(None, facts()) is True
    assert run_has_accelerator(None, facts({"DS_ACCELERATOR": "cpu"})) is False
    assert run_has_accelerator(None, facts(cuda=CPU_BUILD)) is False
    assert run_has_accelerator(True, facts(cuda=CPU_BUILD)) is True
    assert run_has_accelerator(False, facts()) is False


def test_versions_check_preflight_and_launch_say_so(run_cli, clean_env, tmp_path):
    clean_env.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    clean_env.setattr(env_facts, "probe_cuda", lambda: GPU)
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({**ZERO3, "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}))
    code, out, _ = run_cli("versions", "--json")
    assert code == 1 and "known-bad:ds-7977-arch-list-suffix" in out
    code, out, _ = run_cli("versions", "--config", cfg)
    assert code == 1 and "export TORCH_CUDA_ARCH_LIST=9.0" in out
    code, out, _ = run_cli("check", cfg, "--json")
    (f,) = [f for f in json.loads(out)["findings"] if f["key"] == "env:TORCH_CUDA_ARCH_LIST"]
    assert code == 1 and f["fix"].startswith("export TORCH_CUDA_ARCH_LIST=9.0")
    import shardkit.run.spawn.plan

    clean_env.setattr(shardkit.run.spawn.plan, "visible_gpus", lambda: 1)  # preflight plans GPU ranks from torch.cuda
    code, out, _ = run_cli("preflight", cfg, "--static")
    assert code == 1 and "TORCH_CUDA_ARCH_LIST" in out
    # CPU ranks never build a CUDA op: the same machine runs `preflight --device cpu` and `check --no-accelerator`
    code, out, _ = run_cli("preflight", cfg, "--static", "--device", "cpu")
    assert code == 0 and "TORCH_CUDA_ARCH_LIST" not in out, out
    code, out, _ = run_cli("check", cfg, "--no-accelerator")
    assert code == 0 and "TORCH_CUDA_ARCH_LIST" not in out, out
    script = tmp_path / "train.py"
    script.write_text("print('never started')\n")
    code, out, err = run_cli("launch", "--dry-run", "--launcher", "torchrun", "--standalone", "--nproc_per_node", "1",
                             script, "--deepspeed_config", cfg)
    assert code == 1 and "TORCH_CUDA_ARCH_LIST" in out + err
    # the same commands are clean once the fix is applied
    clean_env.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert run_cli("versions", "--config", cfg)[0] == 0
    assert run_cli("check", cfg)[0] == 0


# --- ulimit -l -----------------------------------------------------------------------------------


def test_nvme_swap_buffers_past_memlock_are_an_error_with_the_size():
    (f,) = environment_findings(NVME_PARAMS, facts=facts(memlock=8 << 20), deepspeed_version="0.19.8")
    assert f.rule == "known-bad:ds-976-nvme-swap-memlock" and f.severity is Severity.ERROR
    assert "8.0 MiB" in f.message and "953.7 MiB" in f.message  # 5 buffers x 1e8 bf16 elements
    assert "ulimit -l unlimited" in f.fix and "--ulimit memlock=-1" in f.fix
    assert environment_findings(NVME_PARAMS, facts=facts(memlock=None), deepspeed_version="0.19.8") == []
    assert environment_findings(NVME_PARAMS, facts=facts(memlock=2 << 30), deepspeed_version="0.19.8") == []


def test_nvme_optimizer_swap_size_is_unknown_so_only_a_limit_below_its_bound_warns():
    """The optimizer's buffers depend on the model (buffer_count x largest sub-group x fp32): below
    the bound a warning that says the size is unknown; a limit above it (1 TiB) is enough."""
    both = json.loads(json.dumps(NVME_PARAMS))
    both["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/nvme", "pin_memory": True}
    (f,) = environment_findings(both, facts=facts(memlock=2 << 30), deepspeed_version="0.19.8")
    assert f.rule == "known-bad:ds-976-nvme-swap-memlock" and f.severity is Severity.WARNING
    assert f.key == "zero_optimization.offload_optimizer.device"
    assert "2.0 GiB" in f.message and "unknown size" in f.message and "up to about 14.9 GiB" in f.message
    assert "a limit of 15.8 GiB is enough" in f.message  # 953.7 MiB params + 4 x 1e9 x 4 bytes
    assert environment_findings(both, facts=facts(memlock=1 << 40), deepspeed_version="0.19.8") == []
    optimizer_only = {**ZERO3, "zero_optimization": {"stage": 3, "sub_group_size": 10_000_000,
                                                     "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}}
    assert environment_findings(optimizer_only, facts=facts(memlock=1 << 30), deepspeed_version="0.19.8") == []
    (g,) = environment_findings(optimizer_only, facts=facts(memlock=64 << 20), deepspeed_version="0.19.8")
    assert g.severity is Severity.WARNING and "up to about 152.6 MiB" in g.message
    # the known parameter part past the limit stays an error
    (h,) = environment_findings(both, facts=facts(memlock=8 << 20), deepspeed_version="0.19.8")
    assert h.severity is Severity.ERROR and h.key == "zero_optimization.offload_param.device"


def test_native_pinning_counts_against_memlock_torch_pinning_does_not():
    native = {"DS_PIN_MEMORY_BACKEND": "native"}
    (f,) = environment_findings(PINNED_CPU, facts=facts(native, memlock=8 << 20), deepspeed_version="0.19.8")
    assert f.rule == "known-bad:ds-8211-native-pinning-memlock"
    assert f.key == "zero_optimization.offload_optimizer.pin_memory" and "unset DS_PIN_MEMORY_BACKEND" in f.fix
    # torch's pinning goes through cudaHostAlloc, which RLIMIT_MEMLOCK does not cap
    assert environment_findings(PINNED_CPU, facts=facts(memlock=8 << 20), deepspeed_version="0.19.8") == []
    unpinned = {**ZERO3, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False}}}
    assert environment_findings(unpinned, facts=facts(native, memlock=8 << 20), deepspeed_version="0.19.8") == []
    # the backend exists from 0.19.6 (PR #8211)
    assert environment_findings(PINNED_CPU, facts=facts(native, memlock=8 << 20), deepspeed_version="0.19.5") == []


def test_memlock_probe_reads_this_process(clean_env):
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    binding = soft != resource.RLIM_INFINITY and not has_cap_ipc_lock()
    assert probe_environment().memlock_bytes == (soft if binding else None)


def test_cap_ipc_lock_lifts_the_limit():
    root = "Name:\tpython\nCapEff:\t000001fffeffffff\n"
    dropped = "Name:\tpython\nCapEff:\t000001fffeffbfff\n"  # setpriv --bounding-set=-ipc_lock
    assert has_cap_ipc_lock(root) and not has_cap_ipc_lock(dropped) and not has_cap_ipc_lock("")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("setpriv") is None or os.geteuid() != 0, reason="needs root and setpriv to drop CAP_IPC_LOCK")
def test_native_pinning_past_memlock_aborts_deepspeed_where_the_real_probe_says(tmp_path):
    """The real path: a process without CAP_IPC_LOCK, an 8 MiB `ulimit -l`, DS_PIN_MEMORY_BACKEND=native.
    The probe of that process reports the row, and DeepSpeed's rank then dies in mlock."""
    code = textwrap.dedent("""
        import json
        from shardkit.platform.environment.rows import environment_findings
        from shardkit.run.spawn.process import run_ranks
        from tests._ranks_zero3 import PINNED_OFFLOAD, pinned_offload_initialize
        found = [f.rule for f in environment_findings(PINNED_OFFLOAD)]
        (r,) = run_ranks(pinned_offload_initialize, 1, args=("small",), timeout=600, raise_on_error=False)
        print(json.dumps({"found": found, "exitcode": r.exitcode, "value": r.value}))
    """)

    def limit_memlock():
        hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
        soft = 8 << 20 if hard == resource.RLIM_INFINITY else min(8 << 20, hard)
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))

    env = {**os.environ, "DS_PIN_MEMORY_BACKEND": "native", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=900, env=env, preexec_fn=limit_memlock, cwd=tmp_path,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["found"] == ["known-bad:ds-8211-native-pinning-memlock"], proc.stderr[-2000:]
    assert result["exitcode"] not in (0, None) and result["value"] is None
    assert "mlock failed to allocate" in proc.stdout + proc.stderr


# --- a CUDA build of torch without a usable driver -----------------------------------------------


def test_cuda_build_without_driver_names_torchs_reason():
    (f,) = environment_findings(None, facts=facts(cuda=NO_DRIVER), deepspeed_version="0.19.8")
    assert f.rule == "known-bad:ds-6810-cuda-build-without-driver" and f.severity is Severity.WARNING
    assert "CUDA 12.8 build" in f.message and "driver on your system is too old" in f.message
    assert "CPU accelerator" in f.message and "driver" in f.fix
    # a run that expects a GPU cannot go ahead; FSDP2 runs and machines without DeepSpeed hear it too
    (g,) = environment_findings(None, facts=facts(cuda=NO_DRIVER), deepspeed_version="0.19.8", accelerator=True)
    assert g.severity is Severity.ERROR
    assert rules(environment_findings({"fsdp": {}}, facts=facts(cuda=NO_DRIVER), engine="fsdp", deepspeed_version="0.19.8"))
    # GPUs hidden on purpose are a CPU run, not a broken driver
    hidden = facts({"CUDA_VISIBLE_DEVICES": ""}, cuda=CudaProbe("12.8", False, 0, "no devices"))
    assert environment_findings(None, facts=hidden, deepspeed_version="0.19.8") == []
    assert environment_findings(None, facts=facts(cuda=GPU), deepspeed_version="0.19.8") == []
    assert environment_findings(None, facts=facts(cuda=CPU_BUILD), deepspeed_version="0.19.8") == []


def test_cuda_build_is_read_without_importing_torch(python_exe):
    import torch

    code = ("import sys; from shardkit.platform.environment.accelerator import _torch_cuda_build_without_import as b; "
            "print(repr(b())); assert 'torch' not in sys.modules")
    out = subprocess.run([python_exe, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr(torch.version.cuda)


@pytest.mark.gpu
def test_cuda_probe_on_a_gpu_machine_reports_it_usable():
    probe = accelerator.probe_cuda()
    assert probe.build and probe.available and probe.device_count >= 1 and probe.reason is None


# --- fp16 on a CPU run ---------------------------------------------------------------------------


def test_fp16_on_a_cpu_without_fp16_is_refused_by_check():
    no_fp16 = facts(cuda=CPU_BUILD, cpu_fp16=False)
    report = check_config(FP16, accelerator=False, environment=no_fp16, deepspeed_version="0.19.8")
    (f,) = [f for f in report.errors if f.rule == "known-bad:ds-7207-cpu-fp16"]
    assert f.key == "fp16.enabled" and "Type fp16 is not supported on your device" in f.message
    assert "_is_mkldnn_fp16_supported() is False" in f.message and "bf16" in f.fix
    # unknown accelerator on a machine without a GPU: a warning that says how to state it
    (w,) = [f for f in check_config(FP16, environment=no_fp16).findings if "cpu-fp16" in f.rule]
    assert w.severity is Severity.WARNING and "--accelerator" in w.message
    assert not [f for f in check_config(FP16, accelerator=True, environment=no_fp16).findings if "cpu-fp16" in f.rule]
    fp16_cpu = facts(cuda=CPU_BUILD, cpu_fp16=True)
    assert not [f for f in check_config(FP16, accelerator=False, environment=fp16_cpu).findings if "cpu-fp16" in f.rule]
    assert not [f for f in check_config(ZERO3, accelerator=False, environment=no_fp16).findings if "cpu-fp16" in f.rule]
    # before 0.16.8 DeepSpeed's CPU accelerator refused fp16 on every CPU
    old = check_config(FP16, accelerator=False, environment=fp16_cpu, deepspeed_version="0.16.0")
    assert [f for f in old.errors if "cpu-fp16" in f.rule and "every CPU" in f.message]


def test_check_no_accelerator_agrees_with_this_machines_probe(run_cli, clean_env, tmp_path):
    cfg = tmp_path / "fp16.json"
    cfg.write_text(json.dumps(FP16))
    code, out, _ = run_cli("check", cfg, "--no-accelerator", "--json")
    refused = [f for f in json.loads(out)["findings"] if f["rule"] == "known-bad:ds-7207-cpu-fp16"]
    assert bool(refused) is (not accelerator.probe_cpu_fp16())
    assert code == (1 if refused else 0)


def test_preflight_on_cpu_ranks_stops_on_fp16_before_spawning(run_cli, clean_env, tmp_path):
    """Ranks used to die with "2 of 2 rank(s) failed"; the static checks now say why first."""
    clean_env.setattr(env_fp16, "probe_cpu_fp16", lambda: False)
    cfg = tmp_path / "fp16.json"
    cfg.write_text(json.dumps(FP16))
    code, out, _ = run_cli("preflight", cfg, "--device", "cpu", "--nproc", "2")
    assert code == 1 and "fp16.enabled" in out and "oneDNN" in out  # the table wraps the message
    assert "static checks failed: fix 1 error(s)" in out and "spawning 2 rank" not in out


def test_fp16_support_is_the_probe_the_suite_skips_by(clean_env):
    clean_env.setattr(env_fp16, "probe_cpu_fp16", lambda: False)
    got = fp16_support(facts(cuda=CPU_BUILD, cpu_fp16=None), "0.19.8")
    assert not got.supported and got.device == "cpu" and "AVX512-FP16" in got.reason
    assert fp16_support(facts(cuda=GPU, cpu_fp16=False), "0.19.8").supported  # DeepSpeed picks cuda there
    assert fp16_support(facts({"DS_ACCELERATOR": "cpu"}, cuda=GPU, cpu_fp16=False), "0.19.8").device == "cpu"


@pytest.mark.slow
def test_deepspeed_refuses_fp16_exactly_where_the_probe_says():
    """The real engine on this machine: deepspeed.initialize with fp16 fails with DeepSpeed's own
    message iff fp16_support says no (on a CPU without fp16 this runs the refusal itself)."""
    from shardkit.run.spawn.process import run_ranks
    from tests import _ranks_zero3 as R

    support = fp16_support(device="cpu")
    (result,) = run_ranks(R.fp16_initialize_error, 1, timeout=300, device="cpu")
    if support.supported:
        assert result.value == ""
    else:
        assert result.value == "ValueError: Type fp16 is not supported on your device."


# --- smoke stops first ---------------------------------------------------------------------------


def test_smoke_stops_before_any_rank_with_one_line(run_cli, clean_env, tmp_path):
    clean_env.setattr(env_facts, "probe_cuda", lambda: CPU_BUILD)
    clean_env.setattr(env_fp16, "probe_cpu_fp16", lambda: False)
    cfg = tmp_path / "fp16.json"
    cfg.write_text(json.dumps(FP16))
    code, out, err = run_cli("smoke", "--engine", "zero3", "--config", cfg, "--world-size", "1", "--steps", "2", "--quiet",
                             "--device", "cpu")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1, err
    assert "this machine cannot run it: fp16.enabled=True" in lines[0] and "Fix: use bf16" in lines[0]
    assert "spawning" not in out


def test_smoke_refuses_an_unparseable_arch_list(clean_env):
    import shardkit.run.spawn.plan
    from shardkit.run.smoke.options import SmokeOptions
    from shardkit.run.smoke.runs import run_smoke

    clean_env.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    clean_env.setattr(env_facts, "probe_cuda", lambda: GPU)
    clean_env.setattr(shardkit.run.spawn.plan, "visible_gpus", lambda: 1)  # the GPU ranks of a Hopper machine
    with pytest.raises(EnvironmentCheckError, match=r"TORCH_CUDA_ARCH_LIST='9\.0a'.*Fix: export TORCH_CUDA_ARCH_LIST=9\.0"):
        run_smoke(SmokeOptions(engines=("zero3",), nproc=1, steps=2), progress=False)


# --- the test suite's own use of the probe -------------------------------------------------------


def test_suite_skips_only_the_fp16_variant_when_the_probe_says_no(clean_env, tmp_path):
    """Forces the no-fp16 path on any machine: the shared checkpoints skip fp16 with the reason and
    spawn nothing for it; the other labels stay available."""
    from tests import _ranks_zero3 as R

    clean_env.setattr(env_facts, "probe_cuda", lambda: CPU_BUILD)
    clean_env.setattr(env_fp16, "probe_cpu_fp16", lambda: False)
    sources = R.Sources(tmp_path)
    assert sources.labels() == ["fp32", "bf16_offload"] and not sources.available("fp16")
    with pytest.raises(pytest.skip.Exception, match=r"fp16 cannot run on this machine's cpu: .*AVX512-FP16"):
        sources["fp16"]
    assert not (tmp_path / "fp16").exists()
    clean_env.setattr(env_fp16, "probe_cpu_fp16", lambda: True)
    assert R.Sources(tmp_path).labels() == list(R.LABELS)


def test_one_failed_variant_fails_only_its_own_tests(tmp_path):
    from tests import _ranks_zero3 as R

    class Broken(R.Sources):
        def _build(self, label):
            if label == "bf16_offload":
                raise ValueError("Type bf16 is not supported on your device.")
            return tmp_path / label, [1.0]

    sources = Broken(tmp_path, reason=lambda label: None)
    with pytest.raises(ValueError, match="bf16 is not supported"):
        sources["bf16_offload"]
    with pytest.raises(RuntimeError, match="building the bf16_offload checkpoint failed earlier") as info:
        sources["bf16_offload"]
    assert isinstance(info.value.__cause__, ValueError)
    assert sources["fp32"] == tmp_path / "fp32" and sources["fp32_losses"] == [1.0]
