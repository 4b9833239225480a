"""nixl-pd-connector: KV-cache transfer for prefill/decode disaggregated serving over NIXL.

This package's root holds the contracts every layer imports (config, params, protocol, layout,
errors ...); its subpackages are observability, net (the side-channel client), vllm (the
adapter) and tools (nixl-pd, doctor). Who may import whom: docs/architecture.md, "Layers".
"""

__version__ = "0.1.0"
