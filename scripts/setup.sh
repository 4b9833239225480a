#!/usr/bin/env bash
# Create .venv (Python 3.11) and install the connector with everything its tests and demo need.
# Safe to run again: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
pip_install() { .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@"; }
# torch first, pinned: the CPU wheel of this machine kind. nixl declares a torch dependency and
# would otherwise pull a multi-GB CUDA build.
pip_install "torch==2.13.0"
# Under a lock on pyproject.toml: scripts/test.sh builds .venv-vllm at the same time, and two
# editable installs of one checkout write the same *.egg-info folder.
flock pyproject.toml .venv/bin/python -m pip install --quiet --disable-pip-version-check \
    -e ".[test]"
if [ "${WITH_VLLM:-1}" = "1" ]; then
    bash scripts/install_vllm.sh
fi
