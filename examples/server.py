"""Run one example engine as a process, speaking JSON lines on stdin/stdout (loopback only).

    python -m examples.server '<EngineConfig as JSON>'

stdin carries commands (Submit, GetStats, Shutdown), one JSON object a line; stdout carries
events (Ready, Output, Stats, Fatal). Closing stdin stops the server. Logs and anything a
native library prints go to stderr: stdout is re-pointed there at start, and the protocol
writes to a private duplicate of the original stdout.
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
from examples.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from examples.metering import StatsSnapshot

logger = logging.getLogger("examples.server")

IDLE_WAIT_S = 0.0005  # how long an engine with only transfers in flight waits for input


class Submit(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="submit"):
    request: EngineRequest


class GetStats(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="get_stats"):
    pass


class Shutdown(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="shutdown"):
    pass


Command = Submit | GetStats | Shutdown


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


class Fatal(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="fatal"):
    message: str


Event = Ready | Output | Stats | Fatal

command_decoder = msgspec.json.Decoder(Command)
event_decoder = msgspec.json.Decoder(Event)


def stats_of(engine: Engine) -> Stats:
    return Stats(engine.has_work(), engine.num_leaked_blocks, engine.stats.snapshot())


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


class _Server:
    def __init__(self, engine: Engine, out: IO[str]) -> None:
        self.engine = engine
        self.out = out
        self.commands: queue.Queue[bytes | None] = queue.Queue()

    def emit(self, event: Event) -> None:
        self.out.write(msgspec.json.encode(event).decode() + "\n")
        self.out.flush()

    def read_stdin(self) -> None:
        for line in sys.stdin.buffer:
            if line.strip():
                self.commands.put(line)
        self.commands.put(None)

    def serve(self) -> None:
        """Step while there is work; wait for commands otherwise. Returns on Shutdown or EOF."""
        while True:
            busy = self.engine.has_work()
            timeout_s = IDLE_WAIT_S if busy else 0.5
            if not self._handle_commands(timeout_s if not self.engine.running else 0.0):
                return
            if self.engine.has_work():
                for output in self.engine.step():
                    self.emit(Output(output))

    def _handle_commands(self, timeout_s: float) -> bool:
        try:
            line = (
                self.commands.get(timeout=timeout_s)
                if timeout_s > 0
                else self.commands.get_nowait()
            )
        except queue.Empty:
            return True
        while line is not None:
            try:
                command = command_decoder.decode(line)
            except msgspec.DecodeError as exc:
                logger.error("ignoring a bad command line: %s", exc)
            else:
                if isinstance(command, Shutdown):
                    return False
                self._apply(command)
            try:
                line = self.commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _apply(self, command: Submit | GetStats) -> None:
        if isinstance(command, GetStats):
            self.emit(stats_of(self.engine))
            return
        error = self.engine.add_request(command.request)
        if error is not None:
            self.emit(Output(error))


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
    out = os.fdopen(protocol_fd, "w", encoding="utf-8")
    start_s = time.monotonic()
    try:
        config = msgspec.json.decode(args[0], type=EngineConfig)
        connector = connector_config()
        engine = Engine(
            config, connector_config=connector, agent_factory=real_agent_factory(connector)
        )
    except Exception as exc:  # report any start-up failure to the parent, then exit
        out.write(msgspec.json.encode(Fatal(f"{type(exc).__name__}: {exc}")).decode() + "\n")
        out.flush()
        return 1
    server = _Server(engine, out)
    try:
        server.emit(
            Ready(config.engine_id, engine.scheduler.side_channel_port, time.monotonic() - start_s)
        )
        threading.Thread(target=server.read_stdin, name="stdin", daemon=True).start()
        server.serve()
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())


class ServerProcess:
    """The parent's handle to one server process (an EngineHandle for the router).

    A reader thread turns the child's stdout lines into events; every wait is bounded. Use as
    a context manager, or call ``close()``: it asks the child to stop, then terminates and
    finally kills it, so no process outlives the handle.
    """

    def __init__(self, config: EngineConfig, *, env: dict[str, str], log_path: str) -> None:
        import subprocess

        self.config = config
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "examples.server", msgspec.json.encode(config).decode()],
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
