"""The vLLM adapter: the only package that imports vllm.

``kv_connector_module_path: "connector.vllm"`` loads NixlPDConnector from here. The rooms:
facade (the KVConnectorBase_V1 class vLLM instantiates), scheduler and worker (its two
halves; scheduler also mirrors vLLM's rules for what a remote prefill computes and defines
what travels inside vLLM's connector metadata), layout (vLLM's cache config and tensors -> our
KVCacheSpec and regions), backends (attention backend -> block format) and metrics (the
per-interval stats and vLLM's /metrics).
"""

from connector.vllm.facade import NixlPDConnector

__all__ = ["NixlPDConnector"]
