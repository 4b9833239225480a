#!/usr/bin/env bash
# Two vLLM engines (prefill, decode) with NixlPDConnector, and the P/D proxy in front.
# Usage: examples/vllm/launch.sh MODEL [PREFILL_TP] [DECODE_TP]
# Needs vLLM 0.33 on a GPU machine (or a CPU build of vLLM) and this package importable
# (pip install -e . from the repo root); the proxy runs from this source checkout, which is put
# on PYTHONPATH (the installed package leaves `examples` out). Stop everything with Ctrl-C.
set -euo pipefail
MODEL=${1:?usage: launch.sh MODEL [PREFILL_TP] [DECODE_TP]}
PREFILL_TP=${2:-1}
DECODE_TP=${3:-1}
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-all}  # set to e.g. mlx5_0:1 to pin the RDMA NIC

kv_config() {  # $1 = kv_role
    printf '{"kv_connector":"NixlPDConnector","kv_connector_module_path":"connector.vllm",'
    printf '"kv_role":"%s","kv_load_failure_policy":"recompute",' "$1"
    printf '"kv_connector_extra_config":{"kv_lease_duration":30,"heartbeat_interval":5}}'
}

pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' EXIT

# Each engine's scheduler serves handshakes on its own side-channel port.
VLLM_NIXL_SIDE_CHANNEL_PORT=5600 \
    vllm serve "$MODEL" --port 8100 --tensor-parallel-size "$PREFILL_TP" \
    --kv-transfer-config "$(kv_config kv_producer)" &
pids+=($!)
VLLM_NIXL_SIDE_CHANNEL_PORT=5700 \
    vllm serve "$MODEL" --port 8200 --tensor-parallel-size "$DECODE_TP" \
    --kv-transfer-config "$(kv_config kv_consumer)" &
pids+=($!)

REPO_ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" python -m examples.vllm.proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \
    --port 8000 &
pids+=($!)
wait -n
