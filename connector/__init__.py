"""nixl-pd-connector: KV-cache transfer for prefill/decode disaggregated serving over NIXL."""

__version__ = "0.1.0"
