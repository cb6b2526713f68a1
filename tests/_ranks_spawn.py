"""Rank targets for test_spawn (spawned processes import them by module name)."""

import os
import time

import torch
import torch.distributed as dist


def all_reduce_rank() -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), int(os.environ["LOCAL_RANK"]), t.item()


def rank1_raises() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 waits for rank 1 forever: the runner must kill it


def sleeps_forever() -> None:
    time.sleep(3600)


def exits_silently() -> None:
    os._exit(0)  # no result reaches the parent


def leaves_a_child(pid_file: str) -> None:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    # written whole, then renamed: the timeout's kill may land between the file's creation and its write
    with open(pid_file + ".tmp", "w") as fh:
        fh.write(str(child.pid))
    os.replace(pid_file + ".tmp", pid_file)
    time.sleep(3600)


def sees_devices() -> dict[str, object]:
    """What a rank can see of the GPUs and which accelerator DeepSpeed would pick."""
    return {
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR"),
        "cuda_devices": torch.cuda.device_count(),
        "backend": dist.get_backend(),
    }


def writes_pid_then_sleeps(pid_dir: str) -> None:
    """Record this rank's pid (and a child's), then block like a rank waiting in a collective."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    # written whole, then renamed: the test reads the file as soon as it exists
    pid_file = os.path.join(pid_dir, f"rank{dist.get_rank()}.pid")
    with open(pid_file + ".tmp", "w") as fh:
        fh.write(f"{os.getpid()} {child.pid}")
    os.replace(pid_file + ".tmp", pid_file)
    time.sleep(3600)


def logs_then_raises(log_dir: str) -> None:
    from shardkit.run.spawn.process import redirect_output

    redirect_output(os.path.join(log_dir, f"rank{dist.get_rank()}.log"))
    print("engine chatter", flush=True)
    raise ValueError("Type fp16 is not supported on your device.")
