"""The TTFT benchmark's client and proxies: streamed token arrival times, and proxy processes.

Stdlib only (it runs in .venv beside the harness). A request's timings are taken at the
client: the time from sending it to each token's server-sent event, so they include every
hop a deployment adds (proxy, prefill, the relay to decode, decode's intake and load).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.real_vllm_harness import HOST, MODEL_NAME, RequestFailed, free_port

REPO = Path(__file__).resolve().parents[1]
PROXY_READY_TIMEOUT_S = 30.0
PROXY_STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class TokenTimes:
    """When each generated token reached the client, in seconds from sending the request."""

    arrival_s: tuple[float, ...]

    @property
    def first_s(self) -> float:
        return self.arrival_s[0]

    @property
    def second_s(self) -> float:
        return self.arrival_s[1]


def stream_token_times(
    url: str, prompt_ids: Sequence[int], max_tokens: int, timeout_s: float
) -> TokenTimes:
    """Send one greedy streamed completion; one arrival time per token (an event carrying two
    tokens gives both the same time). Raises RequestFailed unless exactly max_tokens came."""
    body = {
        "model": MODEL_NAME,
        "prompt": list(prompt_ids),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    arrival_s: list[float] = []
    started = time.monotonic()
    try:
        response = urllib.request.urlopen(request, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        raise RequestFailed(exc.code, exc.read().decode(errors="replace")) from None
    with response:
        for raw in response:
            now = time.monotonic() - started
            arrival_s += [now] * len(_event_token_ids(raw))
    if len(arrival_s) != max_tokens:
        raise RequestFailed(200, f"{url}: {len(arrival_s)} tokens streamed, {max_tokens} asked")
    return TokenTimes(tuple(arrival_s))


def _event_token_ids(raw: bytes) -> list[int]:
    """The token ids of one server-sent event line (none for blank lines and [DONE])."""
    line = raw.decode().strip()
    if not line.startswith("data: ") or line == "data: [DONE]":
        return []
    event = json.loads(line[len("data: ") :])
    if "error" in event:
        raise RequestFailed(200, line)
    return list(event["choices"][0].get("token_ids") or [])


class ProxyProcess:
    """examples/vllm/proxy.py in its own process (as a deployment runs it), on a free port."""

    def __init__(self, prefill_url: str, decode_url: str, extra_args: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        command = [sys.executable, "-m", "examples.vllm.proxy", "--prefill", prefill_url]
        command += ["--decode", decode_url, "--host", HOST, "--port", str(self.port)]
        self._command = command + list(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            self._command, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        )
        deadline = time.monotonic() + PROXY_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"proxy {self._command} exited with {self._proc.returncode}")
            with socket.socket() as probe:
                if probe.connect_ex((HOST, self.port)) == 0:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"proxy {self._command} not listening after {PROXY_READY_TIMEOUT_S} s")

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=PROXY_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=PROXY_STOP_TIMEOUT_S)
        self._proc = None


def proxy_has_option(option: str) -> bool:
    """Whether this checkout's examples/vllm/proxy.py accepts ``option`` (per its --help)."""
    done = subprocess.run(
        [sys.executable, "-m", "examples.vllm.proxy", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return option in done.stdout
