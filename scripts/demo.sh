#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv, then run the P/D demo over real NIXL.
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE  # the venv has no .pyc (scripts/test.sh says why)
WITH_VLLM=0 bash scripts/setup.sh
export UCX_NET_DEVICES=lo
exec .venv/bin/nixl-pd demo "$@"
