#!/usr/bin/env bash
# GPU smoke run (issue 9): real vLLM prefill/decode on CUDA in direct (VRAM) and host-staged
# modes against a single engine; prints a pass/fail line per mode with transfer GB/s.
# On a machine without a CUDA GPU it says so and exits 0 without claiming a pass.
#   bash scripts/gpu_smoke.sh [--python PATH] [--model DIR_OR_HF_NAME] [--modes direct,staged]
# --python: the interpreter of an environment with CUDA vLLM 0.33 and this package
# (pip install vllm==0.33.0 && pip install -e .); default $NIXL_PD_GPU_PYTHON or python3.
set -euo pipefail
cd "$(dirname "$0")/.."
DRIVER_PYTHON="${NIXL_PD_DRIVER_PYTHON:-}"
if [[ -z "$DRIVER_PYTHON" ]]; then
  if [[ -x .venv/bin/python ]]; then DRIVER_PYTHON=.venv/bin/python; else DRIVER_PYTHON=python3; fi
fi
exec "$DRIVER_PYTHON" scripts/gpu_smoke.py "$@"
