#!/usr/bin/env bash
# Create .venv (Python 3.11) and install the connector with everything its tests and demo need.
# Safe to run again: what is already installed is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# shellcheck source=scripts/venv_install.sh
. scripts/venv_install.sh
# torch first, pinned: the CPU wheel of this machine kind. nixl declares a torch dependency and
# would otherwise pull a multi-GB CUDA build.
venv_install .venv "torch==2.13.0"
# Under a lock on pyproject.toml: scripts/test.sh builds .venv-vllm at the same time, and two
# editable installs of one checkout write the same *.egg-info folder.
flock pyproject.toml bash -c '. scripts/venv_install.sh && venv_install .venv -e ".[test]"'
if [ "${WITH_VLLM:-1}" = "1" ]; then
    bash scripts/install_vllm.sh
fi
