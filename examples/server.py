"""Run one example engine as a child process speaking JSON lines on stdin/stdout (loopback only).

    python -m examples.server '<EngineConfig as JSON>' ['<ConnectorConfig as JSON>']

stdin carries commands (``examples.engine_loop``: Submit, GetStats, GetInfo, Shutdown), one JSON
object a line; stdout carries events (Ready, Output, Stats, Info, Error, Fatal). Closing stdin
stops the server. Logs and anything a native library prints go to stderr: stdout is re-pointed
there at start, and the protocol writes to a private duplicate of the original stdout.
``ServerProcess`` is the parent's handle.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from typing import IO, Any

import msgspec

from connector.config import ConnectorConfig
from connector.errors import UnsupportedConfiguration
from examples.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from examples.engine_loop import (
    Command,
    EngineLoop,
    Error,
    Event,
    Fatal,
    GetStats,
    Output,
    Peer,
    Ready,
    Shutdown,
    Stats,
    Submit,
    command_decoder,
    decode_command,
    event_decoder,
)

logger = logging.getLogger("examples.server")


def real_agent_factory(config: ConnectorConfig) -> Any:
    """Agent name -> a RealNixlAgent (UCX on DRAM) with the connector's backend settings."""
    from worker.nixl_real import RealNixlAgent

    def create(name: str) -> Any:
        return RealNixlAgent(name, backends=config.backends, num_threads=config.num_threads)

    return create


def connector_config() -> ConnectorConfig:
    """Loopback side channel on a free port; short handshake timeouts for a demo."""
    return ConnectorConfig(
        side_channel_host="127.0.0.1",
        side_channel_port=0,
        handshake_timeout_s=5.0,
        handshake_retries=2,
    )


class StdioTransport:
    """Commands as JSON lines on stdin (a reader thread), events as JSON lines on ``out``."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.lines: queue.Queue[bytes | None] = queue.Queue()
        self.closed = False

    def start(self) -> None:
        threading.Thread(target=self._read_stdin, name="stdin", daemon=True).start()

    def _read_stdin(self) -> None:
        for line in sys.stdin.buffer:
            if line.strip():
                self.lines.put(line)
        self.lines.put(None)

    def receive(self, timeout_s: float) -> list[tuple[bytes, Peer]] | None:
        if self.closed:
            return None
        messages: list[tuple[bytes, Peer]] = []
        try:
            line = self.lines.get(timeout=timeout_s) if timeout_s > 0 else self.lines.get_nowait()
            while line is not None:
                messages.append((line, ()))
                line = self.lines.get_nowait()
            self.closed = True  # EOF: serve what came before it, then stop
        except queue.Empty:
            pass
        return messages

    def decode(self, payload: bytes) -> Command:
        return decode_command(command_decoder, payload)

    def send(self, peer: Peer, event: Event) -> None:
        self.out.write(msgspec.json.encode(event).decode() + "\n")
        self.out.flush()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    protocol_fd = os.dup(1)
    os.dup2(2, 1)  # native libraries that print to stdout must not corrupt the protocol
    sys.stdout = sys.stderr
    transport = StdioTransport(os.fdopen(protocol_fd, "w", encoding="utf-8"))
    start_s = time.monotonic()
    try:
        config = msgspec.json.decode(args[0], type=EngineConfig)
        connector = (
            msgspec.json.decode(args[1], type=ConnectorConfig)
            if len(args) > 1
            else connector_config()
        )
        engine = Engine(
            config, connector_config=connector, agent_factory=real_agent_factory(connector)
        )
    except Exception as exc:  # report any start-up failure to the parent, then exit
        transport.send((), Fatal(f"{type(exc).__name__}: {exc}"))
        return 1
    try:
        ready_s = time.monotonic() - start_s
        transport.send((), Ready(config.engine_id, engine.scheduler.side_channel_port, ready_s))
        transport.start()
        EngineLoop(engine, transport).serve(threading.Event())
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())


class ServerProcess:
    """The parent's handle to one server process (an EngineHandle for the router).

    A reader thread turns the child's stdout lines into events; every wait is bounded. Use as
    a context manager, or call ``close()``: it asks the child to stop, then terminates and
    finally kills it, so no process outlives the handle. ``connector`` replaces the default
    ``connector_config()`` (e.g. a short lease in tests); it travels on the command line, so
    it must not carry a secret.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        env: dict[str, str],
        log_path: str,
        connector: ConnectorConfig | None = None,
    ) -> None:
        import subprocess

        if connector is not None and connector.side_channel_secret is not None:
            raise UnsupportedConfiguration(
                "ServerProcess passes the connector config on the command line, where a "
                "a side_channel_secret would be visible to every user; pass a config without one"
            )
        argv = [sys.executable, "-m", "examples.server", msgspec.json.encode(config).decode()]
        if connector is not None:
            argv.append(msgspec.json.encode(connector).decode())
        self.config = config
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            start_new_session=True,  # Ctrl-C reaches the parent only; it stops the child in order
        )
        self.events: queue.Queue[Event | None] = queue.Queue()
        self._outputs: list[RequestOutput] = []
        self._reader = threading.Thread(
            target=self._read, name=f"{config.engine_id}-out", daemon=True
        )
        self._reader.start()
        self.ready: Ready | None = None

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                self.events.put(event_decoder.decode(line))
            except msgspec.DecodeError:
                logger.warning("%s printed a non-protocol line: %r", self.config.engine_id, line)
        self.events.put(None)

    def _next_event(self, timeout_s: float) -> Event | None:
        try:
            event = self.events.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if event is None:
            self.events.put(None)  # keep reporting the exit to later callers
            raise ConnectionError(f"{self.config.engine_id} exited: {self.log_tail()}")
        if isinstance(event, Fatal):
            raise ConnectionError(f"{self.config.engine_id} failed: {event.message}")
        if isinstance(event, Error):  # a command we sent was refused: a bug on this side
            logger.error("%s refused a command: %s", self.config.engine_id, event.message)
        return event

    def wait_ready(self, timeout_s: float) -> Ready:
        deadline_s = time.monotonic() + timeout_s
        while self.ready is None:
            if time.monotonic() > deadline_s:
                raise TimeoutError(f"{self.config.engine_id} not ready after {timeout_s} s")
            event = self._next_event(0.05)
            if isinstance(event, Ready):
                self.ready = event
        return self.ready

    def _send(self, command: Command) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(msgspec.json.encode(command) + b"\n")
        self.process.stdin.flush()

    def submit(self, request: EngineRequest) -> None:
        self._send(Submit(request))

    def poll(self, timeout_s: float) -> list[RequestOutput]:
        event = self._next_event(timeout_s) if not self._outputs else None
        while event is not None:
            if isinstance(event, Output):
                self._outputs.append(event.output)
            event = self._next_event(0.0) if not self.events.empty() else None
        outputs, self._outputs = self._outputs, []
        return outputs

    def problem(self, num_pending: int) -> str | None:
        code = self.process.poll()
        if code is None:
            return None
        return f"{self.config.engine_id} exited with code {code}: {self.log_tail(300)}"

    def stats(self, timeout_s: float) -> Stats:
        self._send(GetStats())
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            event = self._next_event(0.05)
            if isinstance(event, Stats):
                return event
            if isinstance(event, Output):
                self._outputs.append(event.output)
        raise TimeoutError(f"{self.config.engine_id} sent no stats within {timeout_s} s")

    def log_tail(self, num_bytes: int = 2000) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as log:
            text = log.read().decode(errors="replace")
        return text[len(text) - min(len(text), num_bytes) :].strip() or "(no log output)"

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the child: Shutdown + EOF, then SIGTERM, then SIGKILL; bounded waits."""
        import subprocess

        if self.process.poll() is None:
            try:
                self._send(Shutdown())
                assert self.process.stdin is not None
                self.process.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
            for stop in (lambda: None, self.process.terminate, self.process.kill):
                stop()
                try:
                    self.process.wait(timeout=timeout_s / 2)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._reader.join(timeout=timeout_s)
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
