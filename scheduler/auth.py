"""Server-side check of a side-channel request's shared-secret authentication.

See connector/protocol.py for the scheme: HMAC-SHA256 over a client nonce, a timestamp and
the payload. This module adds the server's state: the replay window and the nonces seen in it.
"""

from __future__ import annotations

import math

from connector.errors import ProtocolError
from connector.protocol import NONCE_BYTES, Envelope, macs_equal, request_mac

DEFAULT_REPLAY_WINDOW_S = 60.0
MAX_REMEMBERED_NONCES = 100_000


class RequestAuthenticator:
    """Accepts a request only if its MAC is right, its timestamp fresh and its nonce unseen.

    Not thread-safe: only the side-channel thread uses it.
    """

    def __init__(self, secret: str | None, *, replay_window_s: float = DEFAULT_REPLAY_WINDOW_S):
        self._secret = secret
        self._replay_window_s = replay_window_s
        self._seen_nonces: dict[bytes, float] = {}  # nonce -> its request's timestamp_s

    def check(self, envelope: Envelope, now_s: float) -> None:
        """Raise ProtocolError with the reason if ``envelope`` must not be answered."""
        if self._secret is None:
            return
        if not envelope.mac:
            raise ProtocolError(
                "authentication required: this side channel has a side_channel_secret; "
                "configure the same secret on the calling engine"
            )
        expected = request_mac(self._secret, envelope.nonce, envelope.timestamp_s, envelope.payload)
        if len(envelope.nonce) != NONCE_BYTES or not macs_equal(expected, envelope.mac):
            raise ProtocolError(
                "authentication failed: wrong side_channel_secret (configure the same secret "
                "on both engines)"
            )
        self._check_fresh(envelope, now_s)

    def _check_fresh(self, envelope: Envelope, now_s: float) -> None:
        skew_s = envelope.timestamp_s - now_s
        if not math.isfinite(skew_s) or abs(skew_s) > self._replay_window_s:
            raise ProtocolError(
                f"authentication failed: request timestamp is {skew_s:+.1f} s from this "
                f"server's clock (window ±{self._replay_window_s} s); synchronise the clocks"
            )
        self._forget_old(now_s)
        if envelope.nonce in self._seen_nonces:
            raise ProtocolError("authentication failed: replayed request (nonce already seen)")
        if len(self._seen_nonces) >= MAX_REMEMBERED_NONCES:
            raise ProtocolError("too many authenticated requests within the replay window; retry")
        self._seen_nonces[envelope.nonce] = envelope.timestamp_s

    def _forget_old(self, now_s: float) -> None:
        # A nonce older than the window can never be accepted again: its timestamp fails above.
        oldest_s = now_s - self._replay_window_s
        stale = [nonce for nonce, ts in self._seen_nonces.items() if ts < oldest_s]
        for nonce in stale:
            del self._seen_nonces[nonce]
