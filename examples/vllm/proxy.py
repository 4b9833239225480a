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

Overlapped (``--overlap``, docs/overlap.md): the request goes to prefill and to decode at
the same time under one fresh ``transfer_key``; decode is told prefill's side channel
(``--prefill-side-channel HOST:PORT``, its VLLM_NIXL_SIDE_CHANNEL_HOST/PORT, and optionally
``--prefill-engine-id``) and learns the lease from it as soon as prefill draws it. Decode's
answer streams back; prefill's is read and dropped (its errors are logged).

    python -m examples.vllm.proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000 \\
        --overlap --prefill-side-channel 127.0.0.1:5600
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger("examples.vllm.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
TIMEOUT_S = 300.0  # per upstream call; long generations stream within it
CHUNK_BYTES = 16 * 1024


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill engine's copy: one token of one choice, no streaming, asking to keep the KV
    for decode (and to pull the earlier turns' KV from decode, with the params a client passed
    back). One choice: the prompt's KV is the same for every one of ``n``, and each choice
    prefill made would hold a lease of its own that no decode reads."""
    prefill = dict(body, max_tokens=1, n=1, stream=False, kv_transfer_params=prefill_params(body))
    for key in ("max_completion_tokens", "stream_options", "best_of"):
        prefill.pop(key, None)
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


class Overlap:
    """Where decode learns prefill's leases in overlapped mode: prefill's side channel."""

    def __init__(self, host: str, port: int, engine_id: str | None = None) -> None:
        self.host, self.port, self.engine_id = host, port, engine_id

    def decode_params(self, transfer_key: str) -> dict[str, Any]:
        """Decode's kv_transfer_params: wait for ``transfer_key``'s lease on that prefill."""
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "transfer_key": transfer_key,
            "remote_host": self.host,
            "remote_port": self.port,
        }
        if self.engine_id:
            params["remote_engine_id"] = self.engine_id
        return params


def overlapped_bodies(
    body: dict[str, Any], overlap: Overlap, transfer_key: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefill's copy, decode's copy) of a request dispatched to both at once."""
    prefill = prefill_body(body)
    prefill["kv_transfer_params"] = dict(prefill["kv_transfer_params"], transfer_key=transfer_key)
    decode = dict(body, kv_transfer_params=overlap.decode_params(transfer_key))
    return prefill, decode


def _drain_prefill(url: str, body: dict[str, Any], request_id: str) -> None:
    """Overlapped mode: prefill's answer is not needed (decode learns the lease from its side
    channel); read it so the engine finishes cleanly, and log what went wrong."""
    try:
        with _post(url, body, request_id) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        logger.warning(
            "request %s: prefill answered %d: %r", request_id, exc.code, exc.read()[:500]
        )
    except (OSError, ValueError) as exc:
        logger.warning("request %s: prefill failed: %s", request_id, exc)


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
    overlap: Overlap | None = None  # set: overlapped dispatch

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
            upstream = self._dispatch(body, request_id)
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

    def _dispatch(self, body: dict[str, Any], request_id: str) -> Any:
        """Decode's open response: after prefill's (sequential), or alongside it (overlap)."""
        if self.overlap is None:
            with _post(self.prefill_url + self.path, prefill_body(body), request_id) as response:
                prefilled = json.loads(response.read())
            return _post(self.decode_url + self.path, decode_body(body, prefilled), request_id)
        prefill, decode = overlapped_bodies(body, self.overlap, uuid.uuid4().hex)
        threading.Thread(
            target=_drain_prefill,
            args=(self.prefill_url + self.path, prefill, request_id),
            name=f"prefill-{request_id[:16]}",
            daemon=True,
        ).start()
        return _post(self.decode_url + self.path, decode, request_id)

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (stdlib signature)
        """Quiet: one line per request is the upstream engines' job."""


def make_server(
    host: str, port: int, prefill_url: str, decode_url: str, overlap: Overlap | None = None
) -> ThreadingHTTPServer:
    handler = type(
        "BoundProxyHandler",
        (ProxyHandler,),
        {
            "prefill_url": prefill_url.rstrip("/"),
            "decode_url": decode_url.rstrip("/"),
            "overlap": overlap,
        },
    )
    return ThreadingHTTPServer((host, port), handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", required=True, help="prefill engine URL")
    parser.add_argument("--decode", required=True, help="decode engine URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--overlap", action="store_true", help="send to prefill and decode at the same time"
    )
    parser.add_argument(
        "--prefill-side-channel",
        metavar="HOST:PORT",
        help="with --overlap: the prefill engine's side channel (VLLM_NIXL_SIDE_CHANNEL_HOST/PORT)",
    )
    parser.add_argument(
        "--prefill-engine-id",
        help="with --overlap: the prefill engine's kv_transfer_config engine_id (optional: "
        "decode then accepts whichever engine serves the side channel)",
    )
    args = parser.parse_args()
    overlap = _overlap(parser, args)
    server = make_server(args.host, args.port, args.prefill, args.decode, overlap)
    how = "with" if overlap else "then"
    print(f"P/D proxy on http://{args.host}:{args.port} -> {args.prefill} {how} {args.decode}")
    try:
        server.serve_forever()
    finally:
        server.server_close()


def _overlap(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Overlap | None:
    if not args.overlap:
        return None
    host, _, port = (args.prefill_side_channel or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        parser.error(
            "--overlap needs --prefill-side-channel HOST:PORT, the prefill engine's "
            f"VLLM_NIXL_SIDE_CHANNEL_HOST and _PORT (got {args.prefill_side_channel!r})"
        )
    return Overlap(host.strip("[]"), int(port), args.prefill_engine_id)


if __name__ == "__main__":
    main()
