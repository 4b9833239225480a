"""The doctor's two-host READ: a NIXL target on one host, a reader on the other, over the network.

``--listen HOST:PORT`` starts a ``connector.tools.doctor_peer`` target and waits (bounded) for one
peer on a ZMQ REP socket bound to HOST:PORT; it hands that peer the target's buffer address and
agent metadata (Offer), then waits for the peer's Report and returns it. ``--peer HOST:PORT``
asks for the Offer, starts a ``doctor_peer`` reader with ``UCX_PROTO_INFO=y`` into its own log,
READs the target, names the transport from UCX's protocol tables, and sends its Report back so
that both sides print the same verdict. Messages are msgpack, size-bounded, decoded into typed
structs (connector.tools.doctor_hosts); every wait has a deadline; the children are always stopped.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import msgspec
import zmq

from connector.errors import TransferFailed
from connector.net.side_channel_client import zmq_endpoint
from connector.tools.doctor_hosts import (
    MAX_REMOTE_BYTES,
    MESSAGE_DECODER,
    Bye,
    Hello,
    Message,
    Offer,
    RemoteRead,
    Report,
)
from connector.tools.doctor_loopback import STOP_TIMEOUT_S, PeerProcess, ReaderResult, target_ready
from connector.tools.doctor_ucx import parse_proto_tables, read_lanes, read_scopes, slowest_class

MAX_MESSAGE_BYTES = 2**20  # agent metadata is a few KiB
_ENCODER = msgspec.msgpack.Encoder()


def _child_env(env: Mapping[str, str]) -> dict[str, str]:
    """The engines' environment for a doctor_peer child. Unlike the loopback READ, no
    UCX_NET_DEVICES default: "lo" cannot reach another host."""
    return {"NIXL_LOG_LEVEL": "WARN", **env, "PYTHONUNBUFFERED": "1"}


def _socket(kind: int) -> zmq.Socket:
    sock: zmq.Socket = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.IPV6, 1)
    return sock


def _receive(sock: zmq.Socket, deadline_s: float, waiting_for: str) -> bytes:
    remaining_ms = int(max(0.0, deadline_s - time.monotonic()) * 1000)
    if not sock.poll(remaining_ms, zmq.POLLIN):
        raise TransferFailed(f"no {waiting_for} in time")
    return bytes(sock.recv())


# ----------------------------------------------------------------------------- listener


def run_listener(
    host: str, port: int, env: Mapping[str, str], *, num_bytes: int, timeout_s: float
) -> RemoteRead:
    """Serve one peer's READ of ``num_bytes``; its Report, or a failed RemoteRead on error."""
    listener = f"{host}:{port}"
    deadline_s = time.monotonic() + timeout_s
    with tempfile.TemporaryFile() as target_err:
        target = PeerProcess(
            "target", _child_env(env), target_err, num_bytes=num_bytes, timeout_s=timeout_s
        )
        try:
            address, metadata_hex = target_ready(target.wait_line("READY", deadline_s))
            offer = Offer(int(address), num_bytes, bytes.fromhex(metadata_hex))
            return _serve_one_peer(host, port, offer, deadline_s)
        except TransferFailed as exc:
            return RemoteRead(ok=False, listener=listener, error=str(exc))
        finally:
            target.stop()


def _serve_one_peer(host: str, port: int, offer: Offer, deadline_s: float) -> RemoteRead:
    sock = _socket(zmq.REP)
    try:
        try:
            sock.bind(zmq_endpoint(host, port))
        except zmq.ZMQError as exc:
            raise TransferFailed(f"cannot listen on {host}:{port}: {exc}") from None
        while True:
            raw = _receive(sock, deadline_s, f"peer on {host}:{port} (run doctor --peer there)")
            try:
                message: Message = MESSAGE_DECODER.decode(raw)
            except msgspec.DecodeError as exc:
                sock.send(_ENCODER.encode(Bye(error=f"undecodable message: {exc}")))
                continue
            if isinstance(message, Report):
                sock.send(_ENCODER.encode(Bye()))
                return message.read
            reply = offer if isinstance(message, Hello) else Bye(error="expected hello or report")
            sock.send(_ENCODER.encode(reply))
    finally:
        sock.close()


# ----------------------------------------------------------------------------- peer


def run_peer(
    host: str, port: int, env: Mapping[str, str], *, num_reads: int, timeout_s: float
) -> RemoteRead:
    """READ the listener's target ``num_reads`` times (after a warm-up) and report back."""
    child_env = _child_env(env)
    failed = RemoteRead(
        ok=False,
        listener=f"{host}:{port}",
        ucx_net_devices=child_env.get("UCX_NET_DEVICES"),
        ucx_tls=child_env.get("UCX_TLS"),
    )
    deadline_s = time.monotonic() + timeout_s
    sock = _socket(zmq.REQ)
    try:
        sock.connect(zmq_endpoint(host, port))
        offer = _ask(sock, Hello(), deadline_s)
        if not isinstance(offer, Offer) or not 0 < offer.num_bytes <= MAX_REMOTE_BYTES:
            raise TransferFailed(f"listener sent {offer!r}, not an offer of 1..2**30 bytes")
        read = _read(offer, child_env, num_reads, deadline_s, failed)
        with contextlib.suppress(TransferFailed):  # the verdict stands if the listener is gone
            _ask(sock, Report(read), min(deadline_s, time.monotonic() + STOP_TIMEOUT_S))
        return read
    except TransferFailed as exc:
        return msgspec.structs.replace(failed, error=str(exc))
    finally:
        sock.close()


def _ask(sock: zmq.Socket, message: Message, deadline_s: float) -> Message:
    sock.send(_ENCODER.encode(message))
    raw = _receive(sock, deadline_s, "answer from the listener (is doctor --listen running?)")
    try:
        reply: Message = MESSAGE_DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        raise TransferFailed(f"listener's reply does not decode: {exc}") from None
    if isinstance(reply, Bye) and reply.error is not None:
        raise TransferFailed(f"listener refused: {reply.error}")
    return reply


def _read(
    offer: Offer, env: Mapping[str, str], num_reads: int, deadline_s: float, failed: RemoteRead
) -> RemoteRead:
    timeout_s = deadline_s - time.monotonic()
    with tempfile.TemporaryDirectory(prefix="nixl-pd-doctor-") as tmp:
        ucx_log = Path(tmp) / "ucx-reader.log"
        reader_env = {**env, "UCX_PROTO_INFO": "y", "UCX_LOG_FILE": str(ucx_log)}
        with tempfile.TemporaryFile() as reader_err:
            reader = PeerProcess(
                "reader", reader_env, reader_err,
                num_bytes=offer.num_bytes, num_reads=num_reads, timeout_s=timeout_s,
            )  # fmt: skip
            try:
                reader.send(f"{offer.address} {offer.agent_metadata.hex()}")
                result = ReaderResult.parse(reader.wait_line("RESULT", deadline_s))
            finally:
                reader.stop()
        tables = parse_proto_tables(ucx_log.read_text(errors="replace") if ucx_log.exists() else "")
    lanes = read_lanes(tables, min(offer.num_bytes, result.descriptor_bytes))
    return msgspec.structs.replace(
        failed,
        ok=True,
        num_bytes=offer.num_bytes,
        num_reads=result.num_reads,
        seconds=result.seconds,
        gbps=round(offer.num_bytes * result.num_reads / max(result.seconds, 1e-9) / 1e9, 3),
        bytes_matched=result.matched,
        read_lanes=lanes,
        transport_class=slowest_class(lanes),
        scopes=read_scopes(tables),
    )
