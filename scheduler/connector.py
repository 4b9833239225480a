"""The scheduler-side connector an engine calls: one request's transfer from params to finish.

It validates kv_transfer_params, then hands prefill requests to Producer (leases, ``sends``)
and decode requests to Consumer (loads, releases, heartbeats), builds each step's metadata and
collects the ranks' reports. Requests are plain RequestInfo records, not engine objects; a
decode request's one record, its parsed params included, is Consumer's.
Every method runs on the engine thread; the side-channel thread touches only the lease table,
and the heartbeat thread only the heartbeat registry (scheduler/heartbeats.py).

Params bind at allocation, as vLLM binds a request: the engine may ask
get_num_new_matched_tokens many times before it allocates, and nothing binds until then. The
first ask only claims the tokens of a dict saying ``do_remote_prefill: true``; the params are
read at allocation (or at an ask that finds nothing left to load). Refused params never raise:
the request is claimed so the engine parks it, announced as a failed load (``take_refused``),
and never loads.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from connector.config import ConnectorConfig
from connector.errors import InvalidTransferParams, UnsupportedConfiguration
from connector.layout import KVCacheSpec
from connector.lifecycle import OnMove
from connector.metadata import ConnectorMetadata, LoadFailure, WorkerReport
from connector.params import raw_flag, validate_block_groups
from connector.protocol import BOOT_ID_CHARS, ReaderId, WorkerHandshake
from scheduler.chunk_leases import ChunkLeases, eligible
from scheduler.consumer import CLAIMED, REFUSED, REFUSING, UNREAD_OR_REFUSED, Consumer, RequestLoad
from scheduler.heartbeats import HeartbeatSender
from scheduler.leases import LeaseTable
from scheduler.overlap import OverlappedLoads
from scheduler.producer import Producer
from scheduler.requests import (
    PULLABLE_KINDS,
    FinishedRequests,
    ParamsReader,
    ParsedParams,
    RequestInfo,
    Role,
    SiblingLoads,
    final_tokens,
    held_blocks,
)
from scheduler.side_channel import SideChannelServer
from scheduler.transfer_board import TransferBoard, lease_under_key

__all__ = ["FinishedRequests", "RequestInfo", "Role", "SchedulerConnector"]

logger = logging.getLogger(__name__)

_WILDCARD_HOSTS = ("0.0.0.0", "::", "*")


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
        on_move: OnMove | None = None,  # sees every decode record's move (tests)
        host_staging: bool = False,  # NIXL reads a host copy: holds are copied there first
    ) -> None:
        if not engine_id or tp_size < 1:
            raise UnsupportedConfiguration(
                f"engine_id={engine_id!r}, tp_size={tp_size}: need a non-empty engine id and "
                "a tensor-parallel size >= 1"
            )
        self._config = config
        self._engine_id = engine_id
        self._spec = spec
        self._num_groups = len(spec.groups)
        self._params = ParamsReader(config, role, spec)
        self._tp_size = tp_size
        self._clock = clock
        # This process's boot: its side channel's boot id, and (with the engine id) how it
        # names itself as a reader, so a holder can tell its restart (scheduler/readers.py).
        self._boot_id = secrets.token_hex(BOOT_ID_CHARS // 2)
        self._reader = ReaderId(engine_id, self._boot_id)
        self._leases = LeaseTable(config.kv_lease_duration_s, num_ranks=tp_size)
        # Overlapped dispatch (docs/overlap.md): prefill announces leases by transfer key.
        self._transfers = TransferBoard(config.kv_lease_duration_s, self._leases.release, clock)
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
            stage_holds=host_staging,
            exact_reads=any(group.kind not in PULLABLE_KINDS for group in spec.groups),
            side_channel_lag=self._side_channel_lag,
        )
        # Heartbeats run on the sender thread's timer, not on engine-thread hooks. Its limit:
        # an engine thread that ran no step for one of its own leases is taken as wedged and
        # its leases are left to expire (scheduler/heartbeats.py says why that bound).
        keepalive = self._heartbeats.keep_alive(
            interval_s=config.heartbeat_interval_s,
            stall_limit_s=config.kv_lease_duration_s,
            clock=clock,
        )
        self._consumer = Consumer(
            groups=spec.groups,
            tp_size=tp_size,
            heartbeats=self._heartbeats,
            keepalive=keepalive,
            # A request naming a lease another load reads waits at most one lease duration.
            siblings=SiblingLoads(max_wait_s=config.kv_lease_duration_s, clock=clock),
            on_move=on_move,
            reader=self._reader,
        )
        self._overlapped = OverlappedLoads(  # decode: loads parked until announced
            config, self._reader, self._consumer, spec.groups,
            parse=self._parse, read=self._params.read, match=self._match,
        )  # fmt: skip
        # Prefill with chunked pulls (docs/overlap.md): partial announcements while it runs.
        self.chunk_leases: ChunkLeases | None = None
        if config.chunked_pull and eligible(spec.groups, host_staging):
            self.chunk_leases = ChunkLeases(
                groups=spec.groups, engine_id=engine_id, tp_size=tp_size, leases=self._leases,
                board=self._transfers, clock=clock, address=self._side_channel_address,
                boot_id=self._side_channel_boot_id,
            )  # fmt: skip

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
            transfers=self._transfers,
        )
        server.start()
        self._side_channel = server

    def get_num_new_matched_tokens(
        self, request: RequestInfo, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """(tokens that will arrive asynchronously, whether a load is pending), or (None, False):
        ask again later (another request's load reads its lease: ``SiblingLoads``,
        scheduler/requests.py). Never raises for params: refused ones are announced by ``take_refused``."""
        raw = request.kv_transfer_params
        if raw is None:
            return 0, False
        request_id = request.request_id
        record = self._consumer.record(request_id)
        num_new_tokens = request.num_prompt_tokens - num_computed_tokens
        if record is None:
            waits = self._consumer.siblings.answer(request_id, raw) if type(raw) is dict else None
            if waits is not None:
                return waits
            unread = (
                raw.get("do_remote_prefill") is True  # raw_flag, inlined: every first ask
                if type(raw) is dict
                else raw_flag(raw, "do_remote_prefill")
            )
        else:
            state = record.state
            if state is REFUSING or state is REFUSED:
                return self._consumer.ask_refused(request_id, num_new_tokens)
            unread = state is CLAIMED
        if unread and num_new_tokens > 0:  # claim now, read the params at allocation
            return self._consumer.claim(request_id, num_new_tokens, num_computed_tokens, raw)
        # else the params are read now (nothing left to load: the claim settles here)
        try:
            return self._match(request, self._parse(request, record), num_computed_tokens)
        except InvalidTransferParams as exc:
            reason = f"invalid kv_transfer_params: {exc}"
            return self._consumer.refuse(request_id, reason, num_new_tokens)

    def _match(
        self, request: RequestInfo, parsed: ParsedParams, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """The read params' answer; raises InvalidTransferParams for a wrong group count."""
        source = parsed.source
        if source is None:
            if parsed.awaits is None:
                return 0, False
            return self._overlapped.claim(request, num_computed_tokens)  # bound at announcement
        num_tokens = request.num_prompt_tokens
        if parsed.pulls:
            num_tokens = min(num_tokens, source.remote_num_tokens or 0)
            if not self._params.worth_pulling(num_tokens - num_computed_tokens):
                return 0, False
        else:
            validate_block_groups(source.remote_block_ids, self._num_groups)
        return self._consumer.get_num_new_matched_tokens(
            request.request_id,
            source,
            num_tokens,
            num_computed_tokens,
            parsed,
            token_ids=request.token_ids,
            kv_salt=request.kv_salt,
        )

    def update_state_after_alloc(
        self, request: RequestInfo, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """Decode's blocks for the request, per cache group (copied: the engine keeps its own)."""
        request_id = request.request_id
        record = self._consumer.record(request_id)
        if record is not None and record.state is CLAIMED:
            if self._overlapped.park_at_allocation(request, record, block_ids, num_external_tokens):
                return
            if not self._read_claim(request, num_external_tokens):
                return
        elif record is not None and record.state in UNREAD_OR_REFUSED:
            self._consumer.refuse_claim(request_id, "", num_external_tokens)  # announce once
            return
        self._consumer.update_state_after_alloc(request_id, block_ids, num_external_tokens)

    def _read_claim(self, request: RequestInfo, num_external_tokens: int) -> bool:
        """Read a claimed request's params now that the engine allocated; True if it loads.

        Refused params, or params that no longer ask for a load while the engine parked the
        request for the claimed tokens (another connector edited them in between: nothing
        would ever answer the wait), fail it; the engine's failure policy decides.
        """
        request_id = request.request_id
        record = self._consumer.record(request_id)
        num_cached_tokens = 0 if record is None else record.num_cached_tokens
        try:
            _, loads = self._match(request, self._parse(request, record), num_cached_tokens)
        except InvalidTransferParams as exc:
            reason = f"invalid kv_transfer_params: {exc}"
            self._consumer.refuse_claim(request_id, reason, num_external_tokens)
            return False
        if loads:
            return True
        if num_external_tokens == 0:  # its params now ask for no load, and nothing is parked
            self._consumer.drop_claim(request_id)
            return False
        reason = (
            "kv_transfer_params changed between the first ask and allocation: "
            f"{_params_summary(request.kv_transfer_params)}; nothing is loaded for this request"
        )
        self._consumer.refuse_claim(request_id, reason, num_external_tokens)
        return False

    def take_refused(self) -> dict[str, LoadFailure]:
        """Requests whose params were refused after the engine parked them, since the last
        call (request id -> reason): announce their load failed."""
        return self._consumer.take_refused()

    def build_connector_meta(self) -> ConnectorMetadata:
        self._overlapped.bind_settled()
        sends, forgotten, digests = self._producer.take_step()
        stage_out = self._producer.take_stage_out()
        loads, releases = self._consumer.take_step()
        return ConnectorMetadata(
            loads=loads,
            releases=releases,
            sends=sends,
            forgotten=forgotten,
            digests=digests,
            stage_out=stage_out,
        )

    def request_finished(
        self, request: RequestInfo, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """(delay freeing the blocks?, kv_transfer_params to return to the client).

        ``block_ids``: the request's blocks per cache group (read, not kept).
        """
        request_id = request.request_id
        chunks = self.chunk_leases  # prefill, chunked pulls: the lease its chunks went under
        chunk_lease = chunks.finish(request_id, request.aborted) if chunks is not None else None
        self._overlapped.end_chunked(request_id)  # decode: abort chunk READs (they drain)
        record = self._consumer.record(request_id)
        if record and record.state is CLAIMED and self._overlapped.end_unbound(request, record):
            return True, None  # overlapped, unbound: parked on blocks the engine frees later
        if record is not None and record.state in UNREAD_OR_REFUSED and record.state is not CLAIMED:
            return self._consumer.request_finished(request_id, None)
        if record is not None and record.state is CLAIMED and record.claimed_params is not None:
            # Release what the claim was made on, whatever the params say now.
            request = msgspec.structs.replace(request, kv_transfer_params=record.claimed_params)
        try:
            parsed = self._parse(request, record)
        except InvalidTransferParams as exc:
            logger.warning("request %s finished with invalid params: %s", request_id, exc)
            self._consumer.request_finished(request_id, None)  # a claim read only now
            return False, None
        if parsed.source is None and record is not None:
            self._consumer.request_finished(request_id, None)  # params edited since the claim
        if parsed.source is not None:
            delay, _ = self._consumer.request_finished(request_id, parsed.source)
            if delay or request.aborted:
                return delay, None
            if not parsed.pulls:
                return self._hold_for_next_turn(request, block_ids)
        params = parsed.params
        if params is None or not params.do_remote_decode:
            return False, None
        prompt_blocks = self._prompt_blocks(request, block_ids)
        lease: Callable[[], tuple[bool, dict[str, Any] | None]] = _no_lease
        if prompt_blocks is not None:  # None: no block holds the prompt's KV any more
            lease = functools.partial(
                self._producer.request_finished, request.request_id, prompt_blocks,
                request.num_prompt_tokens, token_ids=request.token_ids, kv_salt=request.kv_salt,
                lease_id=chunk_lease,
            )  # fmt: skip
        if params.transfer_key is not None:  # overlapped dispatch: announced under the key
            return lease_under_key(self._transfers, params.transfer_key, request.aborted, lease)
        return (False, None) if request.aborted else lease()

    def _prompt_blocks(
        self, request: RequestInfo, block_ids: Sequence[Sequence[int]]
    ) -> Sequence[Sequence[int]] | None:
        """The blocks that hold the prompt's KV, for prefill's lease, or None when none do:
        all of them, unless the request computed past its prompt; then each attention group's
        first blocks, and None for an SSM state or a sliding window, which hold the answer's
        end by then (why offering them would load wrong KV: docs/vllm.md)."""
        computed = request.num_computed_tokens
        if computed is None or computed <= request.num_prompt_tokens:
            return block_ids
        held = held_blocks(block_ids, self._spec.groups, request.num_prompt_tokens)
        if held is None:
            logger.warning(
                "request %s computed %d tokens past its %d-token prompt, and this model's SSM "
                "state or sliding window now holds their end, not the prompt's: its KV is not "
                "offered to a decode engine (send prefill requests with max_tokens=1)",
                request.request_id, computed - request.num_prompt_tokens, request.num_prompt_tokens,
            )  # fmt: skip
        return held

    def _hold_for_next_turn(
        self, request: RequestInfo, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Decode, bidirectional mode: lease a finished request's blocks for the next turn's
        prefill (decoder_kv_blocks_ttl), and return the params it needs; else free them."""
        if not self._config.bidirectional_kv_xfer:
            return False, None
        num_tokens = final_tokens(request)
        if num_tokens is None:
            logger.info(
                "request %s: the engine passed no token ids (prompt embeddings?), so its "
                "blocks are not held for a next turn",
                request.request_id,
            )
            return False, None
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
            kv_salt=request.kv_salt,
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

    @property
    def reported_by_ranks(self) -> frozenset[str]:
        """Of the loads take_finished last returned, those whose LoadSpec went out: the ranks
        ran them (an engine whose ranks report to it themselves need not be told again)."""
        return self._consumer.reported_by_ranks

    def has_pending_work(self) -> bool:
        """True while loads, releases or leases still need engine steps to finish.

        An engine that stops stepping while this is true strands them: e.g. a release after a
        full prefix hit must still reach the prefill engine.
        """
        pending = self._producer.has_pending_work or self._consumer.has_pending_work
        return pending or self._overlapped.has_pending_work

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
        self._overlapped.stop()

    def _parse(self, request: RequestInfo, record: RequestLoad | None) -> ParsedParams:
        """The request's params: its ``record``'s parse (the caller's lookup) while the
        request carries the very same params object, else parsed afresh (Consumer keeps what
        a load needs). Refusals are not kept: they raise each time."""
        raw = request.kv_transfer_params
        if record is not None and record.parsed is not None and record.parsed.raw is raw:
            return record.parsed
        return self._params.read(request)

    def _side_channel_lag(self) -> float:
        """Seconds the side channel's serving thread is in its current turn (0.0: not serving)."""
        server = self._side_channel
        return 0.0 if server is None else server.lag_s()

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
        if sorted(by_rank) != list(range(self._tp_size)) or len(handshakes) != self._tp_size:
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


def _params_summary(raw: object) -> str:
    """What changed params say now, for the error (read, not validated)."""
    if not isinstance(raw, dict):
        return f"params are now {type(raw).__name__}"
    return f"do_remote_prefill is now {raw.get('do_remote_prefill')!r}"


def _no_lease() -> tuple[bool, None]:
    return False, None
