"""Helpers for the drill (tests/test_drill.py): `nixl-pd serve` processes and request batches.

``Served`` is one server process (its own session, so signals reach it alone); ``Batch``
drives requests by hand through `EngineClient`s, so a drill can fault a server between the
prefill and the decode half of a request. Every wait is bounded.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from examples.engine import EngineRequest, RequestOutput
from examples.engine_client import EngineClient
from examples.engine_loop import Stats
from examples.model import VOCAB_SIZE

READY = re.compile(
    r"engine (\S+) ready: requests on 127\.0\.0\.1:(\d+), side channel 127\.0\.0\.1:(\d+)"
)
# Short timeouts keep lease expiry and dead-peer paths inside the drill's time budget.
TIMEOUT_FLAGS = ("--lease", "4", "--heartbeat", "1", "--handshake-timeout", "1",
                 "--handshake-retries", "1")  # fmt: skip


class Served:
    """One `nixl-pd serve` process on free loopback ports."""

    def __init__(self, role: str, log_dir: Path) -> None:
        self.role = role
        self.log_path = log_dir / f"{role}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "connector.tools.cli", "serve", "--role", role, "--port", "0",
             *TIMEOUT_FLAGS],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(os.environ, UCX_NET_DEVICES="lo", PYTHONUNBUFFERED="1"),
        )  # fmt: skip
        self.engine_id = ""
        self.port = self.side_channel_port = 0
        self.client: EngineClient | None = None

    def wait_ready(self, timeout_s: float = 60.0) -> EngineClient:
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s and self.process.poll() is None:
            match = READY.search(self.log_path.read_text(errors="replace"))
            if match:
                self.engine_id = match.group(1)
                self.port, self.side_channel_port = int(match.group(2)), int(match.group(3))
                self.client = EngineClient("127.0.0.1", self.port, dead_after_s=3.0)
                return self.client
            time.sleep(0.05)
        raise AssertionError(f"{self.role} not ready: {self.log_tail()}")

    def signal(self, signum: int) -> None:
        os.kill(self.process.pid, signum)

    def stats(self) -> Stats:
        assert self.client is not None
        return self.client.stats(timeout_s=5.0)

    def drained_leaks(self, timeout_s: float) -> int:
        """Blocks still referenced once the engine has no more work (bounded wait)."""
        deadline_s = time.monotonic() + timeout_s
        stats = self.stats()
        while stats.busy and time.monotonic() < deadline_s:
            time.sleep(0.05)
            stats = self.stats()
        assert not stats.busy, f"{self.role} still busy after {timeout_s} s: {stats}"
        return stats.leaked_blocks

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a stopped process ignores SIGTERM
            self.process.terminate()
            try:
                self.process.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10.0)
        self._log.close()


def prompts(tag: str, num_requests: int, prompt_len: int = 48) -> dict[str, list[int]]:
    rng = np.random.default_rng(abs(hash(tag)) % 2**32)
    return {
        f"{tag}-{i}": [int(t) for t in rng.integers(0, VOCAB_SIZE, prompt_len)]
        for i in range(num_requests)
    }


def collect(
    client: EngineClient, request_ids: set[str], timeout_s: float
) -> dict[str, RequestOutput]:
    """The outputs for ``request_ids`` (fewer if ``timeout_s`` passes first)."""
    outputs: dict[str, RequestOutput] = {}
    deadline_s = time.monotonic() + timeout_s
    while set(outputs) != request_ids and time.monotonic() < deadline_s:
        outputs.update((o.request_id, o) for o in client.poll(0.01) if o.request_id in request_ids)
    return outputs


def prefill_all(prefill: EngineClient, batch: dict[str, list[int]]) -> dict[str, RequestOutput]:
    for request_id, prompt in batch.items():
        prefill.submit(EngineRequest(request_id, prompt, 1, {"do_remote_decode": True}))
    outputs = collect(prefill, set(batch), timeout_s=20.0)
    assert set(outputs) == set(batch) and not any(o.error for o in outputs.values()), outputs
    return outputs


def decode_request(
    request_id: str, prompt: list[int], prefilled: RequestOutput, **param_overrides: Any
) -> EngineRequest:
    params = dict(prefilled.kv_transfer_params or {}, **param_overrides)
    return EngineRequest(request_id, prompt + prefilled.token_ids[:1], 4, params)
