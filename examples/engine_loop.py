"""The command loop that serves one engine over a transport, and the messages it speaks.

``EngineLoop`` applies commands (Submit, GetStats, GetInfo, Shutdown) and sends events (Output,
Stats, Info, Error; the processes add Ready and Fatal), each request's output to the peer that
submitted it. ``examples.server`` runs it over stdin/stdout (the demo's child processes),
``examples.serve`` over a loopback ZMQ socket (``nixl-pd serve``).
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

import msgspec

from examples.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from examples.metering import StatsSnapshot
from examples.model import MAX_POSITIONS, VOCAB_SIZE

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.0005  # how long an engine with only transfers in flight waits for input
IDLE_POLL_S = 0.1  # how long an idle engine waits for input (also bounds reaction to a stop)
MAX_IN_FLIGHT_REQUESTS = 4096  # submitted, output not yet sent: beyond this, refuse new ones


class Submit(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="submit"):
    request: EngineRequest


class GetStats(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="get_stats"):
    pass


class GetInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="get_info"):
    pass


class Shutdown(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="shutdown"):
    pass


Command = Submit | GetStats | GetInfo | Shutdown


class Ready(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="ready"):
    engine_id: str
    side_channel_port: int
    setup_s: float


class Output(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="output"):
    output: RequestOutput


class Stats(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="stats"):
    busy: bool  # requests waiting, running, loading or held for a remote reader
    leaked_blocks: int
    transfer: StatsSnapshot


class Info(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="info"):
    config: EngineConfig  # role, model, seed, TP, blocks: what a router needs to know
    side_channel_port: int


class Error(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="error"):
    message: str  # a command that could not be decoded; the server keeps serving


class Fatal(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="fatal"):
    message: str


Event = Ready | Output | Stats | Info | Error | Fatal

command_decoder = msgspec.json.Decoder(Command)
event_decoder = msgspec.json.Decoder(Event)
COMMAND_HELP = (
    'send one JSON object per message: {"type": "submit", "request": {"request_id": ..., '
    '"prompt_token_ids": [...], "max_tokens": ..., "kv_transfer_params": {...}}}, '
    '{"type": "get_stats"} or {"type": "get_info"}'
)

Peer = tuple[bytes, ...]  # where a command came from, so replies go back there (() on stdin)


class Transport(Protocol):
    """How commands reach an EngineLoop and its events leave (only the loop's thread calls)."""

    def receive(self, timeout_s: float) -> list[tuple[bytes, Peer]] | None:
        """Commands that arrived, waiting at most ``timeout_s`` for the first; None: closed."""
        ...

    def decode(self, payload: bytes) -> Command:
        """One command (raises msgspec.DecodeError for anything else)."""
        ...

    def send(self, peer: Peer, event: Event) -> None: ...


def stats_of(engine: Engine) -> Stats:
    return Stats(engine.has_work(), engine.num_leaked_blocks, engine.stats.snapshot())


def request_error(request: EngineRequest) -> str | None:
    """Why the model can never run ``request`` (token ids or length out of range), or None."""
    bad = [t for t in request.prompt_token_ids if not 0 <= t < VOCAB_SIZE]
    if bad:
        return f"token ids must be in 0..{VOCAB_SIZE - 1}; got {bad[:5]}"
    num_positions = len(request.prompt_token_ids) + max(request.max_tokens, 0)
    if num_positions > MAX_POSITIONS:
        return (
            f"prompt ({len(request.prompt_token_ids)} tokens) + max_tokens "
            f"({request.max_tokens}) = {num_positions} exceeds the model's {MAX_POSITIONS} "
            "positions; shorten the request"
        )
    return None


class EngineLoop:
    """Serve one engine over a transport: apply commands, step while there is work, and send
    each request's output to the peer that submitted it. Nothing a peer sends stops the loop."""

    def __init__(self, engine: Engine, transport: Transport) -> None:
        self.engine = engine
        self.transport = transport
        self.owners: dict[str, Peer] = {}  # request id -> who submitted it, until its output

    def serve(self, stop: threading.Event) -> None:
        """Step while there is work; wait for commands otherwise. Returns on ``stop``, a
        Shutdown command or a closed transport."""
        while not stop.is_set():
            if self.engine.running:
                timeout_s = 0.0
            else:
                timeout_s = IDLE_WAIT_S if self.engine.has_work() else IDLE_POLL_S
            messages = self.transport.receive(timeout_s)
            if messages is None:
                return
            for payload, peer in messages:
                if not self._handle(payload, peer):
                    return
            if self.engine.has_work():
                for output in self.engine.step():
                    self._deliver(output)

    def _handle(self, payload: bytes, peer: Peer) -> bool:
        """Apply one command; False on Shutdown."""
        try:
            command = self.transport.decode(payload)
        except msgspec.DecodeError as exc:
            logger.warning("bad command (%d bytes): %s", len(payload), exc)
            self.transport.send(peer, Error(f"bad command: {exc}; {COMMAND_HELP}"))
            return True
        if isinstance(command, Shutdown):
            return False
        if isinstance(command, GetStats):
            self.transport.send(peer, stats_of(self.engine))
        elif isinstance(command, GetInfo):
            side_channel_port = (
                self.engine.scheduler.side_channel_port if self.engine.scheduler else 0
            )
            self.transport.send(peer, Info(self.engine.config, side_channel_port))
        else:
            self._submit(command.request, peer)
        return True

    def _submit(self, request: EngineRequest, peer: Peer) -> None:
        request_id = request.request_id
        error = request_error(request)
        if request_id in self.owners or request_id in self.engine.blocks.tables:
            error = f"request id {request_id!r} is still in flight on this engine; use a new id"
        elif len(self.owners) >= MAX_IN_FLIGHT_REQUESTS:
            error = f"{len(self.owners)} requests already in flight on this engine; retry later"
        if error is None:
            rejected = self.engine.add_request(request)
            error = rejected.error if rejected is not None else None
        if error is not None:
            self.transport.send(peer, Output(RequestOutput(request_id, [], error=error)))
            return
        self.owners[request_id] = peer

    def _deliver(self, output: RequestOutput) -> None:
        peer = self.owners.pop(output.request_id, None)
        if peer is None:
            logger.warning("output for %r, which no peer submitted", output.request_id)
            return
        self.transport.send(peer, Output(output))
