#!/usr/bin/env bash
# The real-GPU telemetry check (see real_gpu_telemetry.py): on a machine with an NVIDIA GPU,
# python3 with pynvml and torch, and a `sluice` binary built for it.
#   tests/gpu/run.sh [path/to/sluice]     (results in $OUT, default /tmp/sluice-gpu)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
sluice=${1:-$here/../../target/release/sluice}
nvidia-smi -L
exec timeout 120 python3 "$here/real_gpu_telemetry.py" "$sluice"
