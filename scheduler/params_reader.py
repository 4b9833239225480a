"""Read a request's kv_transfer_params for this engine: what to load, from where, or nothing.

Parsing is connector.params' job; this adds what the engine knows: its role (advisory: an
engine serves either direction when the params ask), whether it pulls earlier turns from
decode (bidirectional_kv_xfer), and whether its cache groups can take such a pull.
"""

from __future__ import annotations

import logging

from connector.config import ConnectorConfig
from connector.layout import KVCacheSpec
from connector.metadata import RemoteSource
from connector.params import KVTransferParams, parse_kv_transfer_params
from scheduler.requests import ParsedParams, RequestInfo, Role
from scheduler.suffix import PULLABLE_KINDS

logger = logging.getLogger(__name__)


class ParamsReader:
    def __init__(self, config: ConnectorConfig, role: Role, spec: KVCacheSpec) -> None:
        self._role = role
        self._consumes, self._produces = role.consumes, role.produces
        self._bidirectional = config.bidirectional_kv_xfer
        self._recompute_threshold = config.kv_recompute_threshold
        self._num_groups = len(spec.groups)
        # A pull reads a prefix of what decode holds: only full-attention and MLA groups
        # keep every token's KV (a window or a recurrent state holds the end only).
        self._pull_kinds_ok = all(group.kind in PULLABLE_KINDS for group in spec.groups)

    def worth_pulling(self, num_tokens: int) -> bool:
        """Pull ``num_tokens`` uncached tokens from decode, or compute them here?"""
        return num_tokens > 0 and num_tokens >= self._recompute_threshold

    def read(self, request: RequestInfo) -> ParsedParams:
        """The request's params parsed; raises InvalidTransferParams naming a bad key."""
        raw = request.kv_transfer_params
        params = parse_kv_transfer_params(raw)
        if params is None:
            return ParsedParams(raw, None, None)
        if params.ignored_keys:
            logger.debug(
                "request %s: ignoring unknown kv_transfer_params keys %s",
                request.request_id,
                ", ".join(params.ignored_keys),
            )
        if params.do_remote_prefill:
            if not self._consumes:
                self._note_other_role(request, params)
            awaited = params.awaited_lease()
            if awaited is not None:  # overlapped: the lease is announced later
                return ParsedParams(raw, params, None, awaits=awaited)
            return ParsedParams(raw, params, params.remote_source())
        if params.do_remote_decode and not self._produces:
            self._note_other_role(request, params)
        source = params.pull_source() if self._bidirectional else None
        if source is not None and not self._can_pull(request, source):
            source = None
        return ParsedParams(raw, params, source, pulls=source is not None)

    def _can_pull(self, request: RequestInfo, source: RemoteSource) -> bool:
        """Can this engine pull an earlier turn's KV from decode's held blocks? When not, it
        computes the prompt itself (always correct) and says why."""
        why = ""
        if len(source.remote_block_ids) != self._num_groups:
            why = (
                f"decode sent {len(source.remote_block_ids)} cache group(s), this engine has "
                f"{self._num_groups}"
            )
        elif not self._pull_kinds_ok:
            why = "a sliding-window or SSM cache group holds no KV of an arbitrary prefix"
        if why:
            logger.info(
                "request %s: not pulling its history from decode: %s", request.request_id, why
            )
        return not why

    def _note_other_role(self, request: RequestInfo, params: KVTransferParams) -> None:
        logger.debug(
            "request %s: %s on an engine whose role is %s; serving it (the role is advisory)",
            request.request_id,
            "do_remote_decode" if params.do_remote_decode else "do_remote_prefill",
            self._role.value,
        )
