"""The stdlib P/D proxy in examples/vllm: toy-proxy protocol against fake engines on loopback."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from examples.vllm.proxy import Overlap, decode_body, make_server, prefill_body

PARAMS = {"do_remote_prefill": True, "remote_request_id": "r1", "remote_block_ids": [[1, 2]]}


class FakeEngine(BaseHTTPRequestHandler):
    """Records each request; prefill answers with PARAMS, decode with a fixed completion."""

    seen: list[tuple[str, str, dict[str, Any]]] = []
    role = ""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((self.role, self.headers["X-Request-Id"], body))
        answer: dict[str, Any] = {"choices": [{"text": "hi"}]}
        if self.role == "prefill":
            answer["kv_transfer_params"] = PARAMS
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


def _serve(server: ThreadingHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    return thread


def _behind_proxy(
    engines: list[ThreadingHTTPServer], overlap: Overlap | None = None
) -> Iterator[str]:
    """Serve the fake prefill and decode ``engines`` behind a proxy; yield its URL once, then
    stop them all."""
    prefill, decode = (f"http://127.0.0.1:{s.server_address[1]}" for s in engines)
    proxy = make_server("127.0.0.1", 0, prefill, decode, overlap)
    servers = [*engines, proxy]
    threads = [_serve(server) for server in servers]
    try:
        yield f"http://127.0.0.1:{proxy.server_address[1]}"
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
        for thread in threads:
            thread.join(timeout=5)


@pytest.fixture
def proxy_url() -> Iterator[tuple[str, list]]:
    seen: list[tuple[str, str, dict[str, Any]]] = []
    servers = []
    for role in ("prefill", "decode"):
        handler = type(f"Fake{role}", (FakeEngine,), {"role": role, "seen": seen})
        servers.append(ThreadingHTTPServer(("127.0.0.1", 0), handler))
    for url in _behind_proxy(servers):
        yield url, seen


def _post(url: str, body: dict[str, Any], request_id: str = "client-7") -> Any:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": request_id},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_prefill_then_decode_with_returned_params_and_same_request_id(proxy_url: Any) -> None:
    url, seen = proxy_url
    answer = _post(url + "/v1/completions", {"prompt": "abc", "max_tokens": 20, "stream": False})
    assert answer == {"choices": [{"text": "hi"}]}
    (p_role, p_id, p_body), (d_role, d_id, d_body) = seen
    assert (p_role, d_role) == ("prefill", "decode")
    assert p_id == d_id == "client-7"
    assert p_body["max_tokens"] == 1 and p_body["kv_transfer_params"] == {"do_remote_decode": True}
    assert d_body["max_tokens"] == 20 and d_body["kv_transfer_params"] == PARAMS


def test_unknown_path_is_refused(proxy_url: Any) -> None:
    url, seen = proxy_url
    with pytest.raises(urllib.error.HTTPError, match="404"):
        _post(url + "/v1/embeddings", {"input": "x"})
    assert seen == []


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"prompt": "x", "max_tokens": 9, "stream": True}, {"max_tokens": 1, "stream": False}),
        ({"messages": [], "max_completion_tokens": 9}, {"max_tokens": 1, "stream": False}),
        ({"prompt": "x", "n": 3, "best_of": 4, "seed": 7}, {"n": 1, "seed": 7}),
    ],
    ids=["completion-streaming", "chat-max-completion-tokens-dropped", "one-choice-of-n"],
)
def test_prefill_body(body: dict[str, Any], expected: dict[str, Any]) -> None:
    prefill = prefill_body(body)
    assert {key: prefill[key] for key in expected} == expected
    assert "max_completion_tokens" not in prefill and "best_of" not in prefill
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True}


def test_decode_body_needs_params_from_prefill() -> None:
    with pytest.raises(ValueError, match="returned no kv_transfer_params"):
        decode_body({"prompt": "x"}, {"choices": []})


HELD_BY_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": "decode-0",
    "remote_request_id": "turn-1",
    "remote_block_ids": [[3, 4]],
    "remote_host": "127.0.0.1",
    "remote_port": 5701,
    "remote_num_tokens": 30,
}


@pytest.mark.parametrize(
    ("client_params", "to_prefill"),
    [
        (None, {"do_remote_decode": True}),
        (HELD_BY_DECODE, HELD_BY_DECODE),
        ({**HELD_BY_DECODE, "do_remote_decode": False}, {"do_remote_decode": True}),
        ("not a dict", {"do_remote_decode": True}),
    ],
    ids=["first-turn", "next-turn-passes-decode-hold", "not-a-hold", "garbage"],
)
def test_prefill_gets_the_previous_turns_params_the_client_passed_back(
    client_params: Any, to_prefill: dict[str, Any]
) -> None:
    body = {"prompt": [1, 2, 3], "max_tokens": 9}
    if client_params is not None:
        body["kv_transfer_params"] = client_params
    assert prefill_body(body)["kv_transfer_params"] == to_prefill


def test_decode_gets_prefill_params_not_the_clients() -> None:
    body = {"prompt": [1], "kv_transfer_params": HELD_BY_DECODE}
    assert decode_body(body, {"kv_transfer_params": PARAMS})["kv_transfer_params"] == PARAMS


class OverlapEngine(BaseHTTPRequestHandler):
    """Prefill answers only once decode got its request (or fails, when told to): a proxy
    that waits for prefill before it calls decode never gets an answer from either."""

    seen: list[tuple[str, str, dict[str, Any]]] = []
    decode_called = threading.Event()
    role = ""
    prefill_status = 200

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((self.role, self.headers["X-Request-Id"], body))
        status = 200
        if self.role == "decode":
            self.decode_called.set()
        else:
            self.decode_called.wait(5.0)
            status = self.prefill_status if self.decode_called.is_set() else 504
        data = json.dumps({"choices": [{"text": self.role}]}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


@pytest.fixture
def overlap_proxy(request: pytest.FixtureRequest) -> Iterator[tuple[str, list]]:
    seen: list[tuple[str, str, dict[str, Any]]] = []
    called = threading.Event()
    servers = []
    for role in ("prefill", "decode"):
        attrs = {"role": role, "seen": seen, "decode_called": called}
        attrs["prefill_status"] = getattr(request, "param", 200)
        handler = type(f"Overlap{role}", (OverlapEngine,), attrs)
        servers.append(ThreadingHTTPServer(("127.0.0.1", 0), handler))
    for url in _behind_proxy(servers, Overlap("127.0.0.1", 5600, "prefill-0")):
        yield url, seen


def test_overlap_sends_both_at_once_under_one_transfer_key(overlap_proxy: Any) -> None:
    url, seen = overlap_proxy
    answer = _post(url + "/v1/completions", {"prompt": "abc", "max_tokens": 20})
    assert answer == {"choices": [{"text": "decode"}]}
    for _ in range(100):  # prefill's request goes out on its own thread: decode may answer first
        if {role for role, _, _ in seen} == {"prefill", "decode"}:
            break
        time.sleep(0.05)
    by_role = {role: (request_id, body) for role, request_id, body in seen}
    (p_id, p_body), (d_id, d_body) = by_role["prefill"], by_role["decode"]
    assert p_id == d_id == "client-7"
    key = p_body["kv_transfer_params"]["transfer_key"]
    assert len(key) == 32 and p_body["max_tokens"] == 1
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "transfer_key": key}
    assert d_body["max_tokens"] == 20
    assert d_body["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "transfer_key": key,
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_engine_id": "prefill-0",
    }


@pytest.mark.parametrize("overlap_proxy", [500], indirect=True)
def test_overlap_logs_a_failing_prefill_and_still_answers_with_decode(
    overlap_proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    url, _ = overlap_proxy
    with caplog.at_level("WARNING", logger="examples.vllm.proxy"):
        answer = _post(url + "/v1/completions", {"prompt": "abc", "max_tokens": 20})
        for _ in range(100):  # prefill's answer is drained on its own thread
            if "prefill answered 500" in caplog.text:
                break
            threading.Event().wait(0.02)
    assert answer == {"choices": [{"text": "decode"}]}
    assert "request client-7: prefill answered 500" in caplog.text
