#!/usr/bin/env bash
# vLLM 0.33.0 without its dependencies, plus only what its scheduler and connector interface
# import. Our vLLM adapter tests drive vLLM's real Scheduler on the CPU; no model weights.
set -euo pipefail
cd "$(dirname "$0")/.."
if .venv/bin/python -c "import importlib.metadata as m; assert m.version('vllm') == '0.33.0'" 2>/dev/null; then
    exit 0
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "vllm==0.33.0"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r scripts/vllm-runtime-requirements.txt
