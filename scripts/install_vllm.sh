#!/usr/bin/env bash
# vLLM 0.33.0 without its dependencies, plus only what its scheduler and connector interface
# import. Our vLLM adapter tests drive vLLM's real Scheduler on the CPU; no model weights.
# Everything goes in with --no-deps so no install ever replaces the CPU torch (vLLM pins a CUDA one).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/venv_install.sh
. scripts/venv_install.sh
if ! .venv/bin/python -c "import importlib.metadata as m; assert m.version('vllm') == '0.33.0'" 2>/dev/null; then
    venv_install .venv --no-deps "vllm==0.33.0"
fi
venv_install .venv --no-deps -r scripts/vllm-runtime-requirements.txt
HF_HUB_OFFLINE=1 .venv/bin/python -c "
import torch
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA
assert torch.__version__.endswith('+cpu'), f'torch was replaced: {torch.__version__}'
" 2>/dev/null || { echo "vLLM 0.33.0 does not import: see scripts/vllm-runtime-requirements.txt" >&2; exit 1; }
