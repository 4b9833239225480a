"""The command loop that serves one engine over a transport, and the messages it speaks.

``EngineLoop`` applies commands (Submit, GetStats, GetInfo, Ping, Shutdown) and sends events
(Output, Stats, Info, Pong, Error; the processes add Ready and Fatal), each request's output to
the peer that submitted it. ``examples.server`` runs it over stdin/stdout (the demo's child processes),
``examples.serve`` over a loopback ZMQ socket (``nixl-pd serve``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

import msgspec

from connector.errors import ProtocolError
from examples.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from examples.metering import StatsSnapshot
from examples.model import MAX_POSITIONS, VOCAB_SIZE

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.0005  # how long an engine with only transfers in flight waits for input
IDLE_POLL_S = 0.1  # how long an idle engine waits for input (also bounds reaction to a stop)
MAX_IN_FLIGHT_REQUESTS = 4096  # submitted, output not yet sent: beyond this, refuse new ones
MAX_PARAMS_DEPTH = 8  # kv_transfer_params nest 2 deep; deeper is refused before anyone walks it
BAD_INPUT_LOG_INTERVAL_S = 10.0  # at most one log line per interval for refused commands


class BadCommand(ProtocolError):
    """A command on the request socket or stdin that does not decode; the loop replies Error."""


class Submit(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="submit"):
    request: EngineRequest


class GetStats(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="get_stats"):
    pass


class GetInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="get_info"):
    pass


class Ping(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="ping"):
    """Are you alive? ``nixl-pd serve`` answers it off the engine thread, even mid-step."""


class Shutdown(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="shutdown"):
    pass


Command = Submit | GetStats | GetInfo | Ping | Shutdown


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


class Pong(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="pong"):
    pass  # the process is alive; its engine may still be busy with a long step


class Error(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="error"):
    message: str  # a command that could not be decoded; the server keeps serving


class Fatal(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="fatal"):
    message: str


Event = Ready | Output | Stats | Info | Pong | Error | Fatal

command_decoder = msgspec.json.Decoder(Command)
event_decoder = msgspec.json.Decoder(Event)
COMMAND_HELP = (
    'send one JSON object per message: {"type": "submit", "request": {"request_id": ..., '
    '"prompt_token_ids": [...], "max_tokens": ..., "kv_transfer_params": {...}}}, '
    '{"type": "get_stats"}, {"type": "get_info"} or {"type": "ping"}'
)

Peer = tuple[bytes, ...]  # where a command came from, so replies go back there (() on stdin)


class Transport(Protocol):
    """How commands reach an EngineLoop and its events leave (only the loop's thread calls)."""

    def receive(self, timeout_s: float) -> list[tuple[bytes, Peer]] | None:
        """Commands that arrived, waiting at most ``timeout_s`` for the first; None: closed."""
        ...

    def decode(self, payload: bytes) -> Command:
        """One command (raises BadCommand for anything else: see ``decode_command``)."""
        ...

    def send(self, peer: Peer, event: Event) -> None: ...


def decode_command(decoder: msgspec.json.Decoder[Any], payload: bytes) -> Command:
    """Decode one command; any malformed input raises BadCommand, never anything else.

    msgspec raises DecodeError for most garbage but RecursionError for deep nesting (1,000
    levels in 2 KB), and an ``Any`` field (kv_transfer_params) decodes to arbitrarily deep
    values that later code would walk recursively: both become BadCommand here.
    """
    try:
        command: Command = decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise BadCommand(str(exc)) from None
    except RecursionError:
        raise BadCommand("JSON nested too deeply to decode") from None
    except (ValueError, TypeError) as exc:  # not seen from msgspec; kept typed all the same
        raise BadCommand(f"{type(exc).__name__}: {exc}") from None
    if isinstance(command, Submit):
        _check_params_depth(command.request.kv_transfer_params)
    return command


def _check_params_depth(params: object) -> None:
    """Iterative (a recursive walk is what fails): containers at most MAX_PARAMS_DEPTH levels
    below kv_transfer_params itself."""
    level: list[Any] = [params] if isinstance(params, dict | list) else []
    for _ in range(MAX_PARAMS_DEPTH):
        children: list[Any] = []
        for value in level:
            items = value.values() if isinstance(value, dict) else value
            children.extend(child for child in items if isinstance(child, dict | list))
        if not children:
            return
        level = children
    raise BadCommand(
        f"kv_transfer_params are nested deeper than {MAX_PARAMS_DEPTH} levels; send the flat "
        "keys a router forwards (do_remote_prefill, remote_block_ids, ...)"
    )


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


class RateLimitedWarning:
    """One warning per interval, then how many were suppressed: a peer sending garbage in a
    loop must not fill the log (engine loop thread only)."""

    def __init__(self, interval_s: float, clock: Any = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._next_s = float("-inf")
        self._num_suppressed = 0

    def note(self, message: str) -> None:
        now_s = self._clock()
        if now_s < self._next_s:
            self._num_suppressed += 1
            return
        suffix = (
            f" ({self._num_suppressed} more since the last line)" if self._num_suppressed else ""
        )
        logger.warning("%s%s", message[:500], suffix)
        self._next_s, self._num_suppressed = now_s + self._interval_s, 0


class EngineLoop:
    """Serve one engine over a transport: apply commands, step while there is work, and send
    each request's output to the peer that submitted it. Nothing a peer sends stops the loop."""

    def __init__(self, engine: Engine, transport: Transport) -> None:
        self.engine = engine
        self.transport = transport
        self.owners: dict[str, Peer] = {}  # request id -> who submitted it, until its output
        self._bad_input = RateLimitedWarning(BAD_INPUT_LOG_INTERVAL_S)

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
        """Apply one command; False on Shutdown. Nothing a peer sends raises out of here."""
        try:
            command = self.transport.decode(payload)
        except BadCommand as exc:
            self._bad_input.note(f"bad command ({len(payload)} bytes): {exc}")
            self.transport.send(peer, Error(f"bad command: {exc}; {COMMAND_HELP}"))
            return True
        try:
            return self._apply(command, peer)
        except Exception as exc:  # a bug must cost one command, not the server
            logger.exception("command %s failed", type(command).__name__)
            self.transport.send(peer, Error(f"command failed: {type(exc).__name__}: {exc}"))
            return True

    def _apply(self, command: Command, peer: Peer) -> bool:
        if isinstance(command, Shutdown):
            return False
        if isinstance(command, Ping):
            self.transport.send(peer, Pong())
        elif isinstance(command, GetStats):
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
