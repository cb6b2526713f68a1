#!/usr/bin/env bash
# Install shardkit (editable) into the active Python environment.
#   ./install.sh          the package and the CLI
#   ./install.sh test     plus the test tools
# torch: an existing install (e.g. your CUDA build) is kept, whatever its version.
# Without one:
#   - a machine with an NVIDIA driver gets what pip picks from PyPI (on Linux: a CUDA build);
#   - a Linux machine without one gets the CPU build from PyTorch's CPU index. On Linux the PyPI
#     wheel of every torch version is the multi-GB CUDA build; only that index has CPU wheels.
#   - where that index cannot be reached (an offline mirror), `torch==2.13.0` from the default
#     index: the release the test suite runs on, and the one a local CPU wheel is kept for.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python}
extras=${1:-}
CPU_INDEX=https://download.pytorch.org/whl/cpu

has_nvidia_driver() {
  command -v nvidia-smi >/dev/null 2>&1 || [ -e /proc/driver/nvidia ]
}

cpu_index_reachable() {
  # A short probe first: pip treats an unreachable --index-url as a warning and would go on to
  # whatever extra index its configuration names, which may hold a CUDA build.
  "$PY" - "$CPU_INDEX/torch/" <<'EOF' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=10).close()
EOF
}

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if [ "$(uname -s)" != Linux ] || has_nvidia_driver; then
    : # pip install -e . below installs torch from the default index
  elif cpu_index_reachable && "$PY" -m pip install -q torch --index-url "$CPU_INDEX"; then
    echo "install.sh: no NVIDIA driver found: installed torch's CPU build from $CPU_INDEX" >&2
  else
    echo "install.sh: no NVIDIA driver found and $CPU_INDEX is out of reach:" \
      "installing torch==2.13.0 from the default index (a CUDA build, unless it holds a CPU wheel)" >&2
    "$PY" -m pip install -q "torch==2.13.0"
  fi
fi
if [ -n "$extras" ]; then
  "$PY" -m pip install -q -e ".[$extras]"
else
  "$PY" -m pip install -q -e .
fi
