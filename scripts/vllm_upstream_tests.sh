#!/usr/bin/env bash
# vLLM 0.33's own connector unit tests, run with NixlPDConnector as the default connector.
#
# Fetches vLLM's source distribution once (pinned by sha256, cached), extracts only the
# connector unit tests, and runs the selection below in .venv with tests/vllm_upstream's
# plugin, which swaps the connector without editing vLLM's files. Tests listed in
# tests/vllm_upstream/EXPECTED_FAILURES run as strict xfails; any other failure fails.
# Extra arguments go to pytest (--upstream-connector=vllm runs vLLM's own connector).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VERSION=0.33.0
SDIST_URL=https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-$VERSION.tar.gz
SDIST_SHA256=f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112
CACHE=${NIXL_PD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/nixl-pd}
SDIST=$CACHE/vllm-$VERSION.tar.gz
TREE=$CACHE/vllm-$VERSION-connector-tests

# vLLM's lifecycle, failure-recovery, invalid-block, error-propagation and cache-pollution
# tests, and the tests of test_nixl_connector.py that run vLLM's Scheduler with the
# configured connector (the rest of that file builds NixlConnector's classes directly).
UNIT=tests/v1/kv_connector/unit
SELECTION=(
    "$UNIT/test_bidirectional_kv_transfer.py"
    "$UNIT/test_remote_prefill_lifecycle.py"
    "$UNIT/test_remote_decode_lifecycle.py"
    "$UNIT/test_kv_load_failure_recovery.py"
    "$UNIT/test_invalid_blocks_correctness.py"
    "$UNIT/test_error_propagation.py"
    "$UNIT/test_cache_pollution_prevention.py"
    "$UNIT/test_nixl_connector.py::test_basic_interface"
    "$UNIT/test_nixl_connector.py::test_prompt_less_than_block_size"
    "$UNIT/test_nixl_connector.py::test_abort_immediately_remote_prefill_enqueues_empty_recv"
    "$UNIT/test_nixl_connector.py::test_prefill_exports_cached_tokens_in_kv_transfer_params"
    "$UNIT/test_nixl_connector.py::test_kv_transfer_handshake"
    "$UNIT/test_nixl_connector.py::test_scheduler_kv_connector_stats_aggregation"
    "$UNIT/test_nixl_connector.py::test_aborted_request_removed_from_worker_in_batch"
)

sha_ok() { echo "$SDIST_SHA256  $1" | sha256sum --check --status; }

if [ ! -f "$SDIST" ] || ! sha_ok "$SDIST"; then
    mkdir -p "$CACHE"
    echo "fetching vLLM $VERSION's source distribution (47 MB, once) into $CACHE" >&2
    curl --fail --silent --show-error --location --retry 3 -o "$SDIST.part" "$SDIST_URL"
    sha_ok "$SDIST.part" || { echo "vllm-$VERSION.tar.gz: sha256 mismatch" >&2; exit 1; }
    mv "$SDIST.part" "$SDIST"
fi
if [ ! -f "$TREE/.extracted" ]; then
    rm -rf "$TREE" && mkdir -p "$TREE"
    # Only the connector unit tests, the package markers above them and the one helper
    # module test_nixl_connector.py imports; not vLLM's top-level conftest (its imports
    # need vLLM's full test dependencies).
    tar -xzf "$SDIST" -C "$TREE" --strip-components=1 \
        "vllm-$VERSION/tests/__init__.py" "vllm-$VERSION/tests/v1/__init__.py" \
        "vllm-$VERSION/tests/v1/kv_connector/__init__.py" "vllm-$VERSION/$UNIT" \
        "vllm-$VERSION/tests/v1/attention/utils.py"
    touch "$TREE/.extracted"
fi

cd "$TREE"
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONWARNINGS=ignore::DeprecationWarning
PYTHONPATH="$ROOT/tests/vllm_upstream${PYTHONPATH:+:$PYTHONPATH}" exec "$ROOT/.venv/bin/python" \
    -m pytest -q -rxX -p no:cacheprovider -p nixl_pd_upstream --rootdir "$TREE" \
    --timeout 120 "${SELECTION[@]}" "$@"
