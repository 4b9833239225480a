"""`nixl-pd serve` and `nixl-pd route` as a person runs them: separate processes, real NIXL.

Two servers on free loopback ports, the router with --check against them, then SIGTERM and
SIGINT must stop them cleanly; the request socket answers garbage with an error and keeps
serving. Every process started here is stopped (signal, then kill; every wait bounded).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

pytestmark = pytest.mark.real_nixl

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
REPLY_TIMEOUT_MS = 10_000
READY = re.compile(r"engine (\S+) ready: requests on 127\.0\.0\.1:(\d+), side channel")


class ServedEngine:
    """One `nixl-pd serve` subprocess; ``close()`` kills it if it is still running."""

    def __init__(self, role: str, log_path: Path, *extra_args: str) -> None:
        self.role = role
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            [
                *(sys.executable, "-m", "connector.tools.cli", "serve"),
                *("--role", role, "--port", "0", *extra_args),
            ],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=dict(os.environ, UCX_NET_DEVICES="lo", PYTHONUNBUFFERED="1"),
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.port = 0

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_ready(self) -> str:
        """The request socket's HOST:PORT, from the one line the server prints when ready."""
        deadline_s = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline_s:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is None:
                break
            match = READY.search(line)
            if match:
                self.port = int(match.group(2))
                return f"127.0.0.1:{self.port}"
        raise AssertionError(f"{self.role} server not ready: {self.log_path.read_text()[-2000:]}")

    def stop(self, signum: int) -> tuple[int | None, float, str]:
        """Send ``signum``; the exit code (None: still running), seconds taken, last stdout."""
        start_s = time.monotonic()
        self.process.send_signal(signum)
        try:
            code: int | None = self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        elapsed_s = time.monotonic() - start_s
        self._reader.join(timeout=STOP_TIMEOUT_S)
        rest = []
        while not self.lines.empty():
            rest.append(self.lines.get_nowait() or "")
        return code, elapsed_s, "".join(rest)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=STOP_TIMEOUT_S)
        self._log.close()


def run_cli(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "connector.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=dict(os.environ, UCX_NET_DEVICES="lo"),
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_route_check_over_two_served_engines_then_signals_stop_them(tmp_path: Path) -> None:
    prefill = ServedEngine("prefill", tmp_path / "prefill.log")
    decode = ServedEngine("decode", tmp_path / "decode.log")
    try:
        prefill_address, decode_address = prefill.wait_ready(), decode.wait_ready()
        routed = run_cli(
            "route",
            *("--prefill", prefill_address, "--decode", decode_address),
            *("--requests", "4", "--prompt-len", "40", "--max-tokens", "5"),
            *("--check", "--json"),
        )
        prefill_stop = prefill.stop(signal.SIGTERM)
        decode_stop = decode.stop(signal.SIGINT)
    finally:
        prefill.close()
        decode.close()

    assert routed.returncode == 0, routed.stderr
    result = json.loads(routed.stdout)
    assert (result["ok"], result["tokens_match"], result["kv_match"]) == (True, True, True)
    assert (result["completed_requests"], result["failed_requests"]) == (4, 0)
    for request in result["results"]:
        assert len(request["token_ids"]) == 6
        assert request["num_external_tokens"] == 40  # fresh decode engine: all KV READ
    for (code, elapsed_s, stdout), role in ((prefill_stop, "prefill"), (decode_stop, "decode")):
        assert code == 0, f"{role} exit code {code} after {elapsed_s:.1f} s"
        assert f"nixl-pd serve: {role} engine stopped" in stdout


def test_route_turns_pull_the_history_from_decode_with_bidirectional_engines(
    tmp_path: Path,
) -> None:
    flags = ("--bidirectional", "--recompute-threshold", "8")
    prefill = ServedEngine("prefill", tmp_path / "prefill.log", *flags)
    decode = ServedEngine("decode", tmp_path / "decode.log", *flags)
    try:
        prefill_address, decode_address = prefill.wait_ready(), decode.wait_ready()
        routed = run_cli(
            "route",
            *("--prefill", prefill_address, "--decode", decode_address),
            *("--requests", "2", "--prompt-len", "40", "--max-tokens", "20", "--turns", "3"),
            *("--check", "--json"),
        )
    finally:
        prefill.close()
        decode.close()

    assert routed.returncode == 0, routed.stderr
    result = json.loads(routed.stdout)
    assert (result["ok"], result["tokens_match"], result["kv_match"]) == (True, True, True)
    assert (result["completed_requests"], result["failed_requests"]) == (6, 0)
    by_turn: dict[int, list[int]] = {}
    for request in result["results"]:
        by_turn.setdefault(request["turn"], []).append(request["num_pulled_tokens"])
    # Turn 1 has no history; later turns pull what prefill has not cached: at least the
    # part of the answer past prefill's last cached block (16 tokens).
    assert by_turn[1] == [0, 0]
    assert all(pulled >= 8 for turn in (2, 3) for pulled in by_turn[turn]), by_turn
    assert result["pulled_tokens"] == sum(by_turn[2] + by_turn[3])


@pytest.fixture(scope="module")
def prefill_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = ServedEngine("prefill", tmp_path_factory.mktemp("serve") / "prefill.log")
    try:
        yield server.wait_ready()
    finally:
        server.stop(signal.SIGTERM)
        server.close()


def request_reply(address: str, payload: bytes) -> Any:
    """One REQ round trip (bounded wait); the reply decoded."""
    req: zmq.Socket = zmq.Context.instance().socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.setsockopt(zmq.RCVTIMEO, REPLY_TIMEOUT_MS)
    try:
        req.connect(f"tcp://{address}")
        req.send(payload)
        return json.loads(req.recv())
    finally:
        req.close()


def submit(request_id: str, tokens: str, extra: str = "") -> bytes:
    return (
        f'{{"type": "submit", "request": {{"request_id": "{request_id}", '
        f'"prompt_token_ids": {tokens}, "max_tokens": 1{extra}}}}}'
    ).encode()


BAD_COMMANDS = {
    "not-json": (b"garbage", "error", "bad command: JSON is malformed"),
    "empty-message": (b"", "error", "bad command: Input data was truncated"),
    "not-an-object": (b"[1, 2]", "error", "bad command: Expected `object`, got `array`"),
    "shutdown-is-not-a-socket-command": (
        b'{"type": "shutdown"}',
        "error",
        "bad command: Invalid value 'shutdown' - at `$.type`",
    ),
    "unknown-field": (
        b'{"type": "get_info", "verbose": true}',
        "error",
        "bad command: Object contains unknown field `verbose`",
    ),
    "tokens-not-a-list": (
        submit("r1", '"abc"'),
        "error",
        "Expected `array`, got `str` - at `$.request.prompt_token_ids`",
    ),
    "token-outside-vocabulary": (
        submit("r2", "[1, 99999999999999999999]"),
        "output",
        "token ids must be in 0..63; got [99999999999999999999]",
    ),
    "longer-than-the-model": (
        submit("r3", json.dumps([1] * 4096)),
        "output",
        "prompt (4096 tokens) + max_tokens (1) = 4097 exceeds the model's 4096 positions",
    ),
    "empty-prompt": (submit("r4", "[]"), "output", "the prompt is empty; send at least one token"),
    "bad-transfer-params": (
        submit("r5", "[1, 2, 3]", ', "kv_transfer_params": {"do_remote_decode": "yes"}'),
        "output",
        "invalid kv_transfer_params",
    ),
}


@pytest.mark.parametrize(
    ("payload", "reply_type", "message"), list(BAD_COMMANDS.values()), ids=list(BAD_COMMANDS)
)
def test_bad_commands_get_an_error_reply_and_the_server_keeps_serving(
    prefill_server: str, payload: bytes, reply_type: str, message: str
) -> None:
    reply = request_reply(prefill_server, payload)

    assert reply["type"] == reply_type
    text = reply["message"] if reply_type == "error" else reply["output"]["error"]
    assert message in str(text)
    info = request_reply(prefill_server, b'{"type": "get_info"}')
    assert info["config"]["role"] == "prefill"


def test_an_oversized_message_is_dropped_and_the_server_keeps_serving(prefill_server: str) -> None:
    dealer: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(f"tcp://{prefill_server}")
        dealer.send(b"x" * (5 * 2**20))  # the bound is 4 MiB: the server drops the connection
    finally:
        dealer.close()

    info = request_reply(prefill_server, b'{"type": "get_info"}')
    assert info["type"] == "info"


def test_a_request_id_still_in_flight_is_refused(prefill_server: str) -> None:
    held = submit("held-1", "[5, 6, 7]", ', "kv_transfer_params": {"do_remote_decode": true}')

    first = request_reply(prefill_server, held)  # prefill holds the KV for a decode reader
    second = request_reply(prefill_server, held)

    assert first["output"]["kv_transfer_params"]["do_remote_prefill"] is True
    assert second["output"]["error"] == (
        "request id 'held-1' is still in flight on this engine; use a new id"
    )


CLI_FAILURES = {
    "route-to-nothing-fails-fast": (
        [
            "route",
            "--prefill",
            "127.0.0.1:{port}",
            "--decode",
            "127.0.0.1:{port}",
            "--timeout",
            "1",
        ],
        1,
        "nixl-pd route: failed: no engine answered on 127.0.0.1:{port} within 1.0 s",
    ),
    "route-bad-address": (
        ["route", "--prefill", "localhost", "--decode", "127.0.0.1:8200"],
        2,
        "nixl-pd route: error: --prefill 'localhost': expected HOST:PORT",
    ),
    "serve-bad-port": (
        ["serve", "--role", "decode", "--port", "70000"],
        2,
        "nixl-pd serve: error: --port 70000: use 1..65535, or 0 for a free port",
    ),
    "serve-bad-role": (
        ["serve", "--role", "router"],
        2,
        "nixl-pd serve: error: argument --role: invalid choice: 'router'",
    ),
}


@pytest.mark.parametrize(
    ("args", "exit_code", "message"), list(CLI_FAILURES.values()), ids=list(CLI_FAILURES)
)
def test_cli_failures_say_why_in_one_line(args: list[str], exit_code: int, message: str) -> None:
    port = str(free_port())

    completed = run_cli(*(arg.replace("{port}", port) for arg in args), timeout_s=30.0)

    assert completed.returncode == exit_code
    assert message.replace("{port}", port) in completed.stderr
    assert len(completed.stderr.strip().splitlines()) == 1
