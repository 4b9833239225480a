"""Server-side check of a side-channel request's shared-secret authentication.

See connector/protocol.py for the scheme: HMAC-SHA256 over a client nonce, a timestamp, the
boot id and the payload. This module adds the server's state: the replay window and the
nonces seen in it, kept in ``NonceBook``.
"""

from __future__ import annotations

import math

from connector.errors import ProtocolError
from connector.protocol import NONCE_BYTES, Envelope, macs_equal, request_mac

DEFAULT_REPLAY_WINDOW_S = 60.0
NONCE_BUCKET_S = 1.0
MAX_REMEMBERED_NONCES = 100_000  # about 10 MB of nonces at most


class NonceBook:
    """The nonces accepted within the replay window, in one set per second of request time.

    Cost per request is O(1): a replay carries the same MAC-covered timestamp as the original,
    so it can only collide inside the original's bucket, and only that set is looked at.
    Buckets leave whole once every timestamp they hold is outside the window (checked at most
    once per bucket period).

    Memory is bounded by ``max_nonces``. When it is full, the oldest bucket is dropped early and
    the *horizon* moves up to its end: requests with older timestamps are refused from then on
    (one of them could be a replay of a dropped nonce). A flood of valid requests thus only
    shortens the replay window's past side; a legitimate peer's fresh request (timestamp "now",
    in the newest bucket) is still accepted. Only the current bucket itself overflowing
    (more than ``max_nonces`` signed requests in one ``bucket_s``) refuses fresh requests, and
    only until the next bucket starts.

    Not thread-safe: only the side-channel thread uses it.
    """

    def __init__(
        self,
        *,
        window_s: float = DEFAULT_REPLAY_WINDOW_S,
        bucket_s: float = NONCE_BUCKET_S,
        max_nonces: int = MAX_REMEMBERED_NONCES,
    ) -> None:
        self._window_s = window_s
        self._bucket_s = bucket_s
        self._max_nonces = max_nonces
        self._buckets: dict[int, set[bytes]] = {}  # floor(timestamp_s / bucket_s) -> nonces
        self._num_nonces = 0
        self._horizon_s = -math.inf  # timestamps below it are refused (their bucket was dropped)
        self._next_expiry_s = -math.inf  # when _expire next has work to do

    def __len__(self) -> int:
        return self._num_nonces

    @property
    def horizon_s(self) -> float:
        """Requests with an older timestamp are refused: -inf unless a flood moved it up."""
        return self._horizon_s

    def admit(self, nonce: bytes, timestamp_s: float, now_s: float) -> None:
        """Remember ``nonce``; raise ProtocolError if it is stale, replayed or cannot be held."""
        skew_s = timestamp_s - now_s
        if not math.isfinite(skew_s) or abs(skew_s) > self._window_s:
            raise ProtocolError(
                f"authentication failed: request timestamp is {skew_s:+.1f} s from this "
                f"server's clock (window ±{self._window_s} s); synchronise the clocks"
            )
        self._expire(now_s)
        if timestamp_s < self._horizon_s:
            raise ProtocolError(
                f"authentication failed: request timestamp is {now_s - timestamp_s:.1f} s old "
                f"but a burst of requests shortened the replay window to "
                f"{now_s - self._horizon_s:.1f} s; send a fresh request"
            )
        key = math.floor(timestamp_s / self._bucket_s)
        bucket = self._buckets.get(key)
        if bucket is not None and nonce in bucket:
            raise ProtocolError("authentication failed: replayed request (nonce already seen)")
        if self._num_nonces >= self._max_nonces:
            self._drop_oldest_bucket(key)
        if bucket is None:
            bucket = self._buckets[key] = set()
        bucket.add(nonce)
        self._num_nonces += 1

    def _expire(self, now_s: float) -> None:
        if now_s < self._next_expiry_s:
            return
        # A bucket whose newest possible timestamp is older than the window can never match.
        oldest_live_key = math.floor((now_s - self._window_s) / self._bucket_s)
        for key in [key for key in self._buckets if key < oldest_live_key]:
            self._num_nonces -= len(self._buckets.pop(key))
        self._next_expiry_s = (oldest_live_key + 1) * self._bucket_s + self._window_s

    def _drop_oldest_bucket(self, incoming_key: int) -> None:
        oldest_key = min(self._buckets)
        if oldest_key >= incoming_key:
            raise ProtocolError(
                f"too many authenticated requests: more than {self._max_nonces} within "
                f"{self._bucket_s} s; retry in a second"
            )
        self._num_nonces -= len(self._buckets.pop(oldest_key))
        self._horizon_s = max(self._horizon_s, (oldest_key + 1) * self._bucket_s)


class RequestAuthenticator:
    """Accepts a request only if its MAC is right, its timestamp fresh and its nonce unseen.

    Not thread-safe: only the side-channel thread uses it.
    """

    def __init__(self, secret: str | None) -> None:
        self._secret = secret
        self._nonces = NonceBook()

    @property
    def num_remembered_nonces(self) -> int:
        return len(self._nonces)

    def check(self, envelope: Envelope, now_s: float) -> None:
        """Raise ProtocolError with the reason if ``envelope`` must not be answered."""
        if self._secret is None:
            return
        if not envelope.mac:
            raise ProtocolError(
                "authentication required: this side channel has a side_channel_secret; "
                "configure the same secret on the calling engine"
            )
        expected = request_mac(
            self._secret, envelope.nonce, envelope.timestamp_s, envelope.payload, envelope.boot_id
        )
        if len(envelope.nonce) != NONCE_BYTES or not macs_equal(expected, envelope.mac):
            raise ProtocolError(
                "authentication failed: wrong side_channel_secret (configure the same secret "
                "on both engines)"
            )
        self._nonces.admit(envelope.nonce, envelope.timestamp_s, now_s)
