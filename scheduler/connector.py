"""The scheduler-side connector an engine calls: one request's transfer from params to finish.

It validates kv_transfer_params, then hands prefill requests to Producer (leases, ``sends``)
and decode requests to Consumer (loads, releases, heartbeats), builds each step's metadata and
collects the ranks' reports. Requests are plain RequestInfo records, not engine objects.
Every method runs on the engine thread; the side-channel thread touches only the lease table.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from connector.config import ConnectorConfig
from connector.errors import InvalidTransferParams, UnsupportedConfiguration
from connector.layout import KVCacheSpec
from connector.metadata import ConnectorMetadata, RemoteSource, WorkerReport
from connector.params import KVTransferParams, parse_kv_transfer_params, validate_block_groups
from connector.protocol import BOOT_ID_CHARS, ReaderId, WorkerHandshake
from scheduler.consumer import Consumer
from scheduler.heartbeats import HeartbeatSender
from scheduler.leases import LeaseTable
from scheduler.producer import Producer
from scheduler.requests import FinishedRequests, RequestInfo, Role
from scheduler.side_channel import SideChannelServer
from scheduler.suffix import PULLABLE_KINDS, held_blocks

__all__ = ["FinishedRequests", "RequestInfo", "Role", "SchedulerConnector"]

logger = logging.getLogger(__name__)

_WILDCARD_HOSTS = ("0.0.0.0", "::", "*")


MAX_PARSED_REQUESTS = 65536  # parsed params kept for requests not yet finished; oldest go first


class _Parsed(msgspec.Struct, frozen=True, gc=False):  # gc=False: refers to no record of ours
    """One request's params as parsed: ``source`` is set for a load, from a prefill engine or
    (``pulls``, bidirectional mode) from a decode engine holding an earlier turn."""

    raw: object  # the params object parsed: reused only while the request carries it
    params: KVTransferParams | None
    source: RemoteSource | None
    pulls: bool = False


class SchedulerConnector:
    """``clock`` (seconds, monotonic) drives leases and heartbeats; it must be callable from
    any thread. ``heartbeat_sender`` replaces the default network sender (tests)."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        engine_id: str,
        role: Role,
        spec: KVCacheSpec,
        tp_size: int,
        clock: Callable[[], float] = time.monotonic,
        heartbeat_sender: HeartbeatSender | None = None,
    ) -> None:
        if not engine_id or tp_size < 1:
            raise UnsupportedConfiguration(
                f"engine_id={engine_id!r}, tp_size={tp_size}: need a non-empty engine id and "
                "a tensor-parallel size >= 1"
            )
        self._config = config
        self._engine_id = engine_id
        self._role = role
        self._consumes, self._produces = role.consumes, role.produces
        self._spec = spec
        self._num_groups = len(spec.groups)
        # A pull reads a prefix of what decode holds: only full-attention and MLA groups
        # keep every token's KV (a window or a recurrent state holds the end only).
        self._pull_kinds_ok = all(group.kind in PULLABLE_KINDS for group in spec.groups)
        self._tp_size = tp_size
        self._clock = clock
        # This process's boot: its side channel's boot id, and (with the engine id) how it
        # names itself as a reader, so a holder can tell its restart (scheduler/readers.py).
        self._boot_id = secrets.token_hex(BOOT_ID_CHARS // 2)
        self._reader = ReaderId(engine_id, self._boot_id)
        self._leases = LeaseTable(config.kv_lease_duration_s, num_ranks=tp_size)
        # request id -> its parsed params: parsed once, however often vLLM asks
        # get_num_new_matched_tokens, and reused at the request's end. Insertion-ordered, so
        # the first key is the oldest.
        self._parsed: dict[str, _Parsed] = {}
        self._side_channel: SideChannelServer | None = None
        self._heartbeats = heartbeat_sender or HeartbeatSender(
            secret=config.side_channel_secret,
            timeout_s=config.handshake_timeout_s,
            clock=clock,
            reader=self._reader,
        )
        # vLLM treats kv_role as advisory: an engine serves either direction when a request's
        # params ask for it, so both halves always exist; the role only names the usual one.
        self._producer = Producer(
            engine_id=engine_id,
            tp_size=tp_size,
            leases=self._leases,
            clock=clock,
            address=self._side_channel_address,
            boot_id=self._side_channel_boot_id,
            verify_kv=config.verify_kv,
        )
        self._consumer = Consumer(
            groups=spec.groups,
            tp_size=tp_size,
            heartbeats=self._heartbeats,
            heartbeat_interval_s=config.heartbeat_interval_s,
            clock=clock,
            reader=self._reader,
        )

    @property
    def reader(self) -> ReaderId:
        """How this engine names itself in lease messages: its engine id and this boot."""
        return self._reader

    @property
    def side_channel_port(self) -> int:
        """The bound side-channel port once started (the configured one before)."""
        return self._side_channel_address()[1]

    def start_side_channel(self, handshakes: Sequence[WorkerHandshake]) -> None:
        """Serve every rank's handshake; raises UnsupportedConfiguration if they do not fit."""
        if self._side_channel is not None:
            raise UnsupportedConfiguration(
                f"the side channel already serves on port {self._side_channel.port}; "
                "call start_side_channel once per engine"
            )
        by_rank = self._check_handshakes(handshakes)
        if self._config.side_channel_host in _WILDCARD_HOSTS:
            logger.warning(
                "side channel host %r binds every interface but is also the address decode "
                "engines are told to call; set VLLM_NIXL_SIDE_CHANNEL_HOST to this machine's "
                "reachable address",
                self._config.side_channel_host,
            )
        server = SideChannelServer(
            self._config.side_channel_host,
            self._config.side_channel_port,
            by_rank,
            engine_id=self._engine_id,
            on_heartbeat=lambda ids: self._leases.extend(ids, self._clock()),
            on_release=self._leases.release,
            on_lease_check=lambda refs: self._leases.check(refs, self._clock()),
            on_reader=self._leases.seen,
            secret=self._config.side_channel_secret,
            max_message_bytes=self._config.max_message_bytes,
            boot_id=self._boot_id,
        )
        server.start()
        self._side_channel = server

    def get_num_new_matched_tokens(
        self, request: RequestInfo, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """(tokens that will arrive asynchronously, whether a load is pending).

        Raises InvalidTransferParams for malformed params (the engine fails that request);
        no state is kept for it then.
        """
        parsed = self._parse(request)
        source = parsed.source
        if source is None:
            return 0, False
        num_tokens = request.num_prompt_tokens
        if parsed.pulls:
            num_tokens = min(num_tokens, source.num_tokens or 0)
            if not self._worth_pulling(num_tokens - num_computed_tokens):
                return 0, False
        else:
            validate_block_groups(source.remote_block_ids, self._num_groups)
        return self._consumer.get_num_new_matched_tokens(
            request.request_id, source, num_tokens, num_computed_tokens, request.token_ids
        )

    def _worth_pulling(self, num_tokens: int) -> bool:
        """Pull ``num_tokens`` uncached tokens from decode, or compute them here?"""
        threshold = self._config.kv_recompute_threshold
        return num_tokens > 0 and num_tokens >= threshold

    def update_state_after_alloc(
        self, request: RequestInfo, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """Decode's blocks for the request, per cache group (copied: the engine keeps its own)."""
        self._consumer.update_state_after_alloc(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self) -> ConnectorMetadata:
        sends, forgotten, digests = self._producer.take_step()
        loads, releases = self._consumer.take_step()
        return ConnectorMetadata(
            loads=loads, releases=releases, sends=sends, forgotten=forgotten, digests=digests
        )

    def request_finished(
        self, request: RequestInfo, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """(delay freeing the blocks?, kv_transfer_params to return to the client).

        ``block_ids``: the request's blocks per cache group (read, not kept).
        """
        try:
            parsed = self._parse(request, last_use=True)
        except InvalidTransferParams as exc:
            logger.warning("request %s finished with invalid params: %s", request.request_id, exc)
            return False, None
        if parsed.source is not None:
            delay, _ = self._consumer.request_finished(request.request_id, parsed.source)
            if delay or request.aborted:
                return delay, None
            if not parsed.pulls:
                return self._hold_for_next_turn(request, block_ids)
        params = parsed.params
        if params is None or request.aborted or not params.do_remote_decode:
            return False, None
        return self._producer.request_finished(
            request.request_id, block_ids, request.num_prompt_tokens, token_ids=request.token_ids
        )

    def _hold_for_next_turn(
        self, request: RequestInfo, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Decode, bidirectional mode: lease a finished request's blocks for the next turn's
        prefill (decoder_kv_blocks_ttl), and return the params it needs; else free them."""
        if not self._config.bidirectional_kv_xfer:
            return False, None
        num_tokens = request.num_computed_tokens
        if num_tokens is None:
            num_tokens = request.num_prompt_tokens
        held = held_blocks(block_ids, self._spec.groups, num_tokens)
        if held is None:
            logger.debug("request %s: its blocks cannot be held for a pull", request.request_id)
            return False, None
        return self._producer.request_finished(
            request.request_id,
            held,
            num_tokens,
            hold_s=self._config.decoder_kv_blocks_ttl_s,
            token_ids=request.token_ids,
        )

    def update_connector_output(self, reports: Sequence[WorkerReport]) -> None:
        valid = [report for report in reports if self._is_valid_report(report)]
        self._producer.on_reports(valid)
        self._consumer.on_reports(valid)

    def on_engine_outcomes(
        self, finished_recving: Iterable[str], failed_recving: Iterable[str]
    ) -> None:
        """The engine's own aggregate of the ranks' load results, where it keeps one (vLLM).

        ``finished_recving`` lists loads that ended, ``failed_recving`` those of them that
        failed. It ends loads whose rank reports have not all arrived; call it after
        update_connector_output so the ranks' reasons win.
        """
        self._consumer.on_engine_outcomes(finished_recving, failed_recving)

    def take_finished(self) -> FinishedRequests:
        finished_sending = self._producer.take_finished()
        finished_recving, failed_recving = self._consumer.take_finished()
        return FinishedRequests(finished_sending, finished_recving, failed_recving)

    def has_pending_work(self) -> bool:
        """True while loads, releases or leases still need engine steps to finish.

        An engine that stops stepping while this is true strands them: e.g. a release after a
        full prefix hit must still reach the prefill engine.
        """
        return self._producer.has_pending_work or self._consumer.has_pending_work

    @property
    def holds_finished_requests(self) -> bool:
        """Bidirectional mode: a decode request's blocks may be held at request_finished, so
        the engine must pass them (otherwise a decode keeps none)."""
        return self._config.bidirectional_kv_xfer

    @property
    def num_tracked_loads(self) -> int:
        """Decode requests with a load record (each kept until its request_finished)."""
        return self._consumer.num_tracked

    def shutdown(self) -> None:
        if self._side_channel is not None:
            self._side_channel.stop()
            self._side_channel = None
        self._heartbeats.stop()

    def _parse(self, request: RequestInfo, *, last_use: bool = False) -> _Parsed:
        """The request's params, parsed on first use; ``last_use`` drops the kept parse.

        A kept parse is reused only while the request still carries the very same params
        object (a new dict is parsed afresh). Refusals are not kept: they raise each time.
        """
        raw = request.kv_transfer_params
        parsed = (
            self._parsed.pop(request.request_id, None)
            if last_use
            else self._parsed.get(request.request_id)
        )
        if parsed is not None and parsed.raw is raw:
            return parsed
        parsed = self._parse_afresh(request)
        if not last_use and raw is not None:
            self._parsed[request.request_id] = parsed
            if len(self._parsed) > MAX_PARSED_REQUESTS:
                del self._parsed[next(iter(self._parsed))]
        return parsed

    def _parse_afresh(self, request: RequestInfo) -> _Parsed:
        raw = request.kv_transfer_params
        params = parse_kv_transfer_params(raw)
        if params is None:
            return _Parsed(raw, None, None)
        if params.ignored_keys:
            logger.debug(
                "request %s: ignoring unknown kv_transfer_params keys %s",
                request.request_id,
                ", ".join(params.ignored_keys),
            )
        if params.do_remote_prefill:
            if not self._consumes:
                self._note_other_role(request, params)
            return _Parsed(raw, params, params.remote_source())
        if params.do_remote_decode and not self._produces:
            self._note_other_role(request, params)
        source = params.pull_source() if self._config.bidirectional_kv_xfer else None
        if source is not None and not self._can_pull(request, source):
            source = None
        return _Parsed(raw, params, source, pulls=source is not None)

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

    def _side_channel_address(self) -> tuple[str, int]:
        if self._side_channel is not None:
            return self._side_channel.host, self._side_channel.port
        return self._config.side_channel_host, self._config.side_channel_port

    def _side_channel_boot_id(self) -> str:
        return "" if self._side_channel is None else self._side_channel.boot_id

    def _is_valid_report(self, report: WorkerReport) -> bool:
        if 0 <= report.tp_rank < self._tp_size:
            return True
        logger.error(
            "ignoring a worker report from tp_rank %d: this engine has tp_size %d",
            report.tp_rank,
            self._tp_size,
        )
        return False

    def _check_handshakes(
        self, handshakes: Sequence[WorkerHandshake]
    ) -> dict[int, WorkerHandshake]:
        by_rank = {handshake.tp_rank: handshake for handshake in handshakes}
        ranks = sorted(by_rank)
        if ranks != list(range(self._tp_size)) or len(handshakes) != self._tp_size:
            raise UnsupportedConfiguration(
                f"start_side_channel needs one handshake per rank 0..{self._tp_size - 1}, got "
                f"ranks {[handshake.tp_rank for handshake in handshakes]}"
            )
        for handshake in handshakes:
            if handshake.engine_id != self._engine_id or handshake.tp_size != self._tp_size:
                raise UnsupportedConfiguration(
                    f"rank {handshake.tp_rank}'s handshake says engine {handshake.engine_id!r} "
                    f"tp_size {handshake.tp_size}; this engine is {self._engine_id!r} tp_size "
                    f"{self._tp_size}: give every rank the same engine id and TP size"
                )
        return by_rank
