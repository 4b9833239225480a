"""Running NixlPDConnector under `vllm serve`: launch recipe and a stdlib P/D proxy."""
