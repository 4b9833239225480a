"""`nixl-pd serve`: one example engine as a long-running process on a loopback request socket.

The socket is a ZMQ ROUTER (``examples.request_socket``): clients (``examples.engine_client``, a
DEALER; or a REQ socket) send one JSON command per message (``examples.engine_loop``: Submit,
GetStats, GetInfo, Ping) and get events back: each request's Output when it finishes, Stats,
Info, Pong, or Error for a command that does not decode. Its own thread answers Ping, so a
server busy with a long engine step still shows it is alive. Messages are size-bounded (an
oversized one drops that peer's connection) and decoded only through typed msgspec decoders;
nothing a client sends stops the server. It runs ``EngineLoop``, the loop the demo's child
processes run, until SIGINT or SIGTERM. With ``metrics_port`` set it also serves the
connector's metrics (connector.observability.metrics) on ``http://host:port/metrics``.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable

import msgspec

from connector.config import ENV_SIDE_CHANNEL_SECRET, ConnectorConfig
from connector.errors import UnsupportedConfiguration
from connector.observability.metrics import default_recorder
from examples.engine import Engine, EngineConfig
from examples.engine_loop import EngineLoop
from examples.request_socket import SocketTransport
from examples.server import connector_config, real_agent_factory

logger = logging.getLogger(__name__)

DEFAULT_PORTS = {"prefill": 8100, "decode": 8200}  # request sockets, as in vLLM's P/D examples


class ServeOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: str  # "prefill" or "decode"
    host: str = "127.0.0.1"  # the request socket and the side channel bind here
    port: int | None = None  # request socket; None: DEFAULT_PORTS[role]; 0: a free port
    side_channel_port: int = 0  # 0: a free port (decode learns it from kv_transfer_params)
    metrics_port: int | None = None  # HTTP /metrics on host; None: none; 0: a free port
    engine_id: str | None = None  # None: "<role>-<6 hex>"
    model: str = "dense"
    tp_size: int = 1
    block_size: int = 16
    kernel_block_size: int | None = None
    num_blocks: int = 256
    layout: str = "nhd"
    seed: int = 0
    staged: bool = (
        False  # NIXL reads a host mirror of the KV, copied per step (examples/staging.py)
    )
    # The connector's timeouts (flags --lease, --heartbeat, --handshake-timeout, ...).
    kv_lease_duration_s: float = 30.0  # prefill keeps finished KV this long for decode
    heartbeat_interval_s: float = 5.0  # decode extends leases this often while it waits
    handshake_timeout_s: float = 5.0  # per side-channel attempt
    handshake_retries: int = 2  # more attempts after the first, with backoff
    # Multi-turn (flags --bidirectional, --decoder-kv-ttl, --recompute-threshold): decode holds
    # finished requests' KV for the next turn's prefill, which pulls it (docs/multiturn.md).
    bidirectional_kv_xfer: bool = False
    decoder_kv_blocks_ttl_s: float = 480.0
    kv_recompute_threshold: int = 64


def engine_config(options: ServeOptions) -> EngineConfig:
    """The engine ``options`` describe (its id generated unless given)."""
    return EngineConfig(
        options.engine_id or f"{options.role}-{uuid.uuid4().hex[:6]}",
        role=options.role,
        model=options.model,
        tp_size=options.tp_size,
        block_size=options.block_size,
        kernel_block_size=options.kernel_block_size,
        num_blocks=options.num_blocks,
        layout=options.layout,
        seed=options.seed,
        staged=options.staged,
    )


def serve_connector_config(options: ServeOptions, env: dict[str, str]) -> ConnectorConfig:
    """The demo's connector settings on ``options``' side channel, with the secret from env."""
    secret_env = {k: v for k, v in env.items() if k == ENV_SIDE_CHANNEL_SECRET}
    secret = ConnectorConfig.from_sources({}, env=secret_env).side_channel_secret
    return msgspec.structs.replace(
        connector_config(),
        side_channel_host=options.host,
        side_channel_port=options.side_channel_port,
        side_channel_secret=secret,
        kv_lease_duration_s=options.kv_lease_duration_s,
        heartbeat_interval_s=options.heartbeat_interval_s,
        handshake_timeout_s=options.handshake_timeout_s,
        handshake_retries=options.handshake_retries,
        bidirectional_kv_xfer=options.bidirectional_kv_xfer,
        decoder_kv_blocks_ttl_s=options.decoder_kv_blocks_ttl_s,
        kv_recompute_threshold=options.kv_recompute_threshold,
    )


def validate_options(options: ServeOptions) -> None:
    """Raise UnsupportedConfiguration (flag, value, what to do) for flags no engine can take."""
    if options.role not in DEFAULT_PORTS:
        raise UnsupportedConfiguration(f"--role {options.role!r}: choose prefill or decode")
    for flag, port in (
        ("--port", options.port),
        ("--side-channel-port", options.side_channel_port),
        ("--metrics-port", options.metrics_port),
    ):
        if port is not None and not 0 <= port <= 65535:
            raise UnsupportedConfiguration(f"{flag} {port}: use 1..65535, or 0 for a free port")
    if options.num_blocks < 2:
        raise UnsupportedConfiguration(f"--num-blocks {options.num_blocks}: use at least 2")
    if not 1 <= options.tp_size <= 8:
        raise UnsupportedConfiguration(f"--tp {options.tp_size}: use 1..8 ranks")
    _validate_timeouts(options)
    kernel = options.kernel_block_size or options.block_size
    if options.block_size < 1 or kernel < 1 or options.block_size % kernel:
        raise UnsupportedConfiguration(
            f"--block-size {options.block_size}, --kernel-block-size {kernel}: both >= 1, and "
            "the kernel block size must divide the block size"
        )


def _validate_timeouts(options: ServeOptions) -> None:
    for flag, seconds in (
        ("--lease", options.kv_lease_duration_s),
        ("--heartbeat", options.heartbeat_interval_s),
        ("--handshake-timeout", options.handshake_timeout_s),
    ):
        if not 0 < seconds <= 3600:
            raise UnsupportedConfiguration(f"{flag} {seconds}: use seconds in (0, 3600]")
    if options.heartbeat_interval_s >= options.kv_lease_duration_s:
        raise UnsupportedConfiguration(
            f"--heartbeat {options.heartbeat_interval_s} must be below --lease "
            f"{options.kv_lease_duration_s}, or leases expire between heartbeats"
        )
    if not 0 < options.decoder_kv_blocks_ttl_s <= 86400:
        raise UnsupportedConfiguration(
            f"--decoder-kv-ttl {options.decoder_kv_blocks_ttl_s}: use seconds in (0, 86400]"
        )
    if options.kv_recompute_threshold < 0:
        raise UnsupportedConfiguration(
            f"--recompute-threshold {options.kv_recompute_threshold}: use tokens >= 0"
        )
    if not 0 <= options.handshake_retries <= 100:
        raise UnsupportedConfiguration(
            f"--handshake-retries {options.handshake_retries}: use 0..100"
        )


class Started(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    engine_id: str
    request_port: int
    side_channel_port: int
    setup_s: float
    metrics_url: str | None = None  # where /metrics is served, if it is


def run_server(
    options: ServeOptions,
    stop: threading.Event,
    *,
    env: dict[str, str],
    on_ready: Callable[[Started], None],
) -> None:
    """Bind, start the engine (real NIXL), call ``on_ready``, serve until ``stop`` is set;
    the engine and the socket are closed on return. Start-up problems raise ConnectorError."""
    validate_options(options)
    start_s = time.monotonic()
    config = engine_config(options)
    connector = serve_connector_config(options, env)
    port = DEFAULT_PORTS[options.role] if options.port is None else options.port
    transport = SocketTransport(options.host, port)
    metrics = None
    try:
        if options.metrics_port is not None:
            from connector.observability.metrics_prometheus import MetricsServer

            metrics = MetricsServer(default_recorder(), options.host, options.metrics_port)
        engine = Engine(
            config, connector_config=connector, agent_factory=real_agent_factory(connector)
        )
        try:
            side_channel_port = engine.scheduler.side_channel_port
            setup_s = time.monotonic() - start_s
            url = metrics.url if metrics is not None else None
            on_ready(Started(config.engine_id, transport.port, side_channel_port, setup_s, url))
            EngineLoop(engine, transport).serve(stop)
        finally:
            engine.shutdown()
    finally:
        if metrics is not None:
            metrics.close()
        transport.close()


def stop_on_signals(stop: threading.Event) -> None:
    """SIGINT and SIGTERM set ``stop`` (the loop notices within IDLE_POLL_S); a second one
    gets the default behaviour, so a stuck shutdown can still be interrupted."""

    def handle(signum: int, frame: object) -> None:
        stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)


def ready_line(options: ServeOptions, started: Started) -> str:
    kernel = options.kernel_block_size or options.block_size
    metrics = f", metrics {started.metrics_url}" if started.metrics_url else ""
    return (
        f"nixl-pd serve: {options.role} engine {started.engine_id} ready: requests on "
        f"{options.host}:{started.request_port}, side channel {options.host}:"
        f"{started.side_channel_port}{metrics} (model {options.model}, TP {options.tp_size}, block "
        f"{options.block_size}/{kernel}, {options.layout}, {options.num_blocks} blocks, seed "
        f"{options.seed}; up in {started.setup_s:.2f} s). Ctrl-C to stop."
    )
