"""A stdlib P/D router for two `vllm serve` engines, speaking vLLM's toy-proxy protocol.

For each OpenAI completion or chat request: send it to the prefill engine with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``, then send the original
request to the decode engine with the ``kv_transfer_params`` prefill returned, under the same
``X-Request-Id``; decode's answer (streamed or not) goes back to the client as it arrives.

Multi-turn (engines with ``bidirectional_kv_xfer``): decode's answer carries the
``kv_transfer_params`` of its held KV. A client that sends them back with its next turn (the
previous answer's ``kv_transfer_params``, unchanged) gets them passed to prefill instead of a
plain ``do_remote_decode``, so prefill pulls the conversation so far from decode. The proxy
keeps no state: the client carries the conversation's params, as it carries its text.

    python -m examples.vllm.proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ROUTES = ("/v1/completions", "/v1/chat/completions")
TIMEOUT_S = 300.0  # per upstream call; long generations stream within it
CHUNK_BYTES = 16 * 1024


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill engine's copy: one token, no streaming, asking to keep the KV for decode
    (and to pull the earlier turns' KV from decode, with the params a client passed back)."""
    prefill = dict(body, max_tokens=1, stream=False, kv_transfer_params=prefill_params(body))
    prefill.pop("max_completion_tokens", None)
    prefill.pop("stream_options", None)
    return prefill


def prefill_params(body: dict[str, Any]) -> dict[str, Any]:
    """``do_remote_decode``, plus decode's held KV when the client passed back the params of
    the previous turn's answer (they say ``do_remote_decode: true`` themselves)."""
    params = body.get("kv_transfer_params")
    if isinstance(params, dict) and params.get("do_remote_decode") is True:
        return dict(params)
    return {"do_remote_decode": True}


def decode_body(body: dict[str, Any], prefill_response: dict[str, Any]) -> dict[str, Any]:
    """The decode engine's copy: the original request plus prefill's kv_transfer_params."""
    params = prefill_response.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise ValueError(
            "the prefill engine returned no kv_transfer_params: is it running with "
            "--kv-transfer-config and kv_role kv_producer?"
        )
    return dict(body, kv_transfer_params=params)


def _post(url: str, body: dict[str, Any], request_id: str) -> Any:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": request_id},
        method="POST",
    )
    return urllib.request.urlopen(request, timeout=TIMEOUT_S)


class ProxyHandler(BaseHTTPRequestHandler):
    prefill_url = ""  # set by make_server
    decode_url = ""

    def do_POST(self) -> None:
        if self.path not in ROUTES:
            self._reply(404, {"error": f"unknown path {self.path}; proxied: {list(ROUTES)}"})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        except (ValueError, json.JSONDecodeError) as exc:
            self._reply(400, {"error": f"request body is not JSON: {exc}"})
            return
        request_id = self.headers.get("X-Request-Id") or str(uuid.uuid4())
        try:
            with _post(self.prefill_url + self.path, prefill_body(body), request_id) as response:
                prefilled = json.loads(response.read())
            upstream = _post(self.decode_url + self.path, decode_body(body, prefilled), request_id)
        except urllib.error.HTTPError as exc:
            self._reply(exc.code, {"error": f"upstream {exc.url}: {exc.read()[:500]!r}"})
            return
        except (OSError, ValueError) as exc:
            self._reply(502, {"error": f"upstream failed: {exc}"})
            return
        with upstream:
            self.send_response(upstream.status)
            self.send_header("Content-Type", upstream.headers.get("Content-Type", "text/plain"))
            self.end_headers()
            while chunk := upstream.read1(CHUNK_BYTES):
                self.wfile.write(chunk)
                self.wfile.flush()

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (stdlib signature)
        """Quiet: one line per request is the upstream engines' job."""


def make_server(host: str, port: int, prefill_url: str, decode_url: str) -> ThreadingHTTPServer:
    handler = type(
        "BoundProxyHandler",
        (ProxyHandler,),
        {"prefill_url": prefill_url.rstrip("/"), "decode_url": decode_url.rstrip("/")},
    )
    return ThreadingHTTPServer((host, port), handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", required=True, help="prefill engine URL")
    parser.add_argument("--decode", required=True, help="decode engine URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    server = make_server(args.host, args.port, args.prefill, args.decode)
    print(f"P/D proxy on http://{args.host}:{args.port} -> {args.prefill} then {args.decode}")
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
