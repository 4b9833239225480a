"""Network I/O shared by both planes: the blocking side-channel client (ZMQ).

Below scheduler/ and worker/, which both call it (heartbeats and releases; handshakes and lease
checks), and beside the contracts it speaks (connector.protocol): I/O, so not a contract.
"""
