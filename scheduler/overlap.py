"""Decode's loads that wait, blocks allocated, for prefill to announce their lease (overlapped dispatch).

With overlapped dispatch (docs/overlap.md) decode's params name prefill's side channel and a
transfer key, not a lease. The request is claimed as any other (the prompt's length is
known), the engine allocates, and at allocation the load is parked here with its blocks while
a LeaseWaiter thread asks prefill for the lease. When the wait settles, the engine thread
takes it at its next step (``bind_settled``) and binds the announced params exactly as it
binds a router's: from there the load is today's (scheduler/connector.py).

Only the engine thread calls this class. A parked load leaves by settling or by its
request's end (``end_unbound``); none outlives its request. The claim record itself is
Consumer's (CLAIMED until the params are bound).

Chunked pulls (``chunked_pull``, docs/overlap.md): the waiter also hands over prefill's partial
announcements. The first that gives decode something to read binds the load (its lease, as a
router's params would) and each one's new blocks go to the ranks as a chunk LoadSpec
(scheduler/chunk_pull.py says what to read and refuses an announcement that does not extend
what was read); the final announcement's LoadSpec reads the rest and proves the whole load.
A failure once chunk READs are out (a refused announcement, prefill's failure, the wait's
timeout) goes to the ranks as a ReleaseSpec with the failure: they end the load with it once
its READs are drained. So does decode's own abort (``end_chunked``), without one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import msgspec

from connector.config import ConnectorConfig
from connector.errors import InvalidTransferParams
from connector.layout import GroupSpec
from connector.metadata import FailureKind, LoadFailure, LoadSpec, RemoteSource
from connector.params import AwaitedLease
from connector.protocol import ReaderId
from scheduler.chunk_pull import CHUNKABLE_KINDS, ChunkedPull, ChunkRefused, Increment
from scheduler.consumer import CLAIMED, LOADING, Consumer, RequestLoad
from scheduler.lease_waiter import LeaseWaiter, Settled
from scheduler.requests import ParsedParams, RequestInfo

PREFILL_FAILED = FailureKind.PREFILL_FAILED  # prefill drew no lease: nothing to cancel

# The connector's own reading of a request's params (reusing its record's parse) and its
# answer to read params (validates them against this engine, starts the load record).
Parse = Callable[[RequestInfo, RequestLoad | None], ParsedParams]
Read = Callable[[RequestInfo], ParsedParams]
Match = Callable[[RequestInfo, ParsedParams, int], tuple[int, bool]]


@dataclasses.dataclass(frozen=True, slots=True)
class ParkedLoad:
    """One decode load waiting for its lease: what binding it needs once announced."""

    request: RequestInfo  # as at allocation (its params are the router's overlapped ones)
    awaited: AwaitedLease
    block_ids: tuple[tuple[int, ...], ...]  # decode's blocks per cache group, as allocated
    num_external_tokens: int


class OverlappedLoads:
    """Waits bounded by overlap_wait_timeout, each side-channel call by handshake_timeout."""

    def __init__(
        self,
        config: ConnectorConfig,
        reader: ReaderId,
        consumer: Consumer,
        groups: tuple[GroupSpec, ...],
        *,
        parse: Parse,
        read: Read,
        match: Match,
    ) -> None:
        chunked = config.chunked_pull and all(g.kind in CHUNKABLE_KINDS for g in groups)
        self._waiter = LeaseWaiter(
            timeout_s=config.overlap_wait_timeout_s,
            call_timeout_s=config.handshake_timeout_s,
            secret=config.side_channel_secret,
            reader=reader,
            chunked=chunked,
        )
        self._consumer = consumer
        self._parse, self._read, self._match = parse, read, match
        self._parked: dict[str, ParkedLoad] = {}  # request id -> its parked load
        # chunked pulls: decode's transfer groups' block sizes (none: no chunked pulls)
        self._block_sizes = tuple(group.block_size for group in groups) if chunked else ()
        self._reader = reader
        self._pulls: dict[str, ChunkedPull] = {}  # chunked pulls: parked loads' read so far

    def claim(self, request: RequestInfo, num_computed_tokens: int) -> tuple[int, bool]:
        """Overlapped params read at an ask: claim the prompt's uncached tokens, as a claim
        on a router's word is (the lease is bound when prefill announces it)."""
        num_new_tokens = request.num_prompt_tokens - num_computed_tokens
        if num_new_tokens <= 0:
            return 0, False
        raw = request.kv_transfer_params
        return self._consumer.claim(request.request_id, num_new_tokens, num_computed_tokens, raw)

    def park_at_allocation(
        self,
        request: RequestInfo,
        record: RequestLoad,
        block_ids: Sequence[Sequence[int]],
        num_external_tokens: int,
    ) -> bool:
        """A claim the engine allocated: park its load until prefill announces the lease (or,
        with nothing to load, cancel the transfer). False: not overlapped params."""
        awaited = self.awaited(request, record)
        if awaited is None:
            return False
        request_id = request.request_id
        if num_external_tokens == 0:  # the engine loads nothing after all: prefill may free
            self._waiter.cancel(request_id, awaited)
            self._consumer.drop_claim(request_id)
            return True
        blocks = tuple(tuple(group) for group in block_ids)
        self._parked[request_id] = ParkedLoad(request, awaited, blocks, num_external_tokens)
        self._waiter.wait(request_id, awaited)
        return True

    def awaited(self, request: RequestInfo, record: RequestLoad | None) -> AwaitedLease | None:
        """The lease a request's overlapped params wait for; None for any other params
        (refused ones too: the connector's usual path refuses them)."""
        raw = request.kv_transfer_params
        if type(raw) is not dict or "transfer_key" not in raw:  # the usual case: no parse
            return None
        try:
            return self._parse(request, record).awaits
        except InvalidTransferParams:
            return None

    def bind_settled(self) -> None:
        """Bind the parked loads whose lease prefill announced; fail those it will not."""
        for outcome in self._waiter.take():
            parked = self._parked.get(outcome.request_id)
            if parked is None:
                continue  # its request ended meanwhile (and cancelled)
            request_id = parked.request.request_id
            record = self._consumer.record(request_id)
            if record is not None and record.state is LOADING and request_id in self._pulls:
                self._next_chunk(parked, outcome, record)  # chunk READs are out
                continue
            if outcome.partial:
                self._first_chunk(parked, outcome, record)
                continue
            del self._parked[request_id]
            self._pulls.pop(request_id, None)
            if record is None or record.state is not CLAIMED:
                self._waiter.cancel(request_id, parked.awaited)  # no longer wanted
                continue
            if outcome.failure is not None and outcome.failure.kind is not PREFILL_FAILED:
                # a late lease is then released at once
                self._waiter.cancel(request_id, parked.awaited)
            failure = outcome.failure or self._bind(parked, outcome, record.num_cached_tokens)
            if failure is not None:
                self._consumer.refuse_claim(
                    request_id, failure.message, parked.num_external_tokens, kind=failure.kind
                )
                continue
            self._consumer.update_state_after_alloc(
                request_id, parked.block_ids, parked.num_external_tokens
            )

    def end_chunked(self, request_id: str) -> None:
        """Decode's request_finished while chunk READs are out: cancel the transfer and abort
        the load on the ranks (they drain its READs first; the record then finishes as any
        load in flight)."""
        parked, record = self._parked.get(request_id), self._consumer.record(request_id)
        if parked is None or request_id not in self._pulls or record is None:
            return
        if record.state is CLAIMED:
            return  # nothing read yet: end_unbound ends it as any parked claim
        self._drop(parked)
        if record.state is LOADING:
            self._consumer.stop_chunks(request_id, None)

    def end_unbound(self, request: RequestInfo, record: RequestLoad) -> bool:
        """request_finished of a claim whose lease is not bound: cancel the transfer. True if
        its load was parked on allocated blocks: then it is reported received with nothing
        read, since vLLM frees a waiting request's blocks only at its load's end."""
        request_id = request.request_id
        parked = self._parked.pop(request_id, None)
        self._pulls.pop(request_id, None)
        awaited = self.awaited(request, record) or (parked.awaited if parked else None)
        if awaited is not None:
            self._waiter.cancel(request_id, awaited)
        if parked is None:
            return False
        self._consumer.end_parked(request_id)
        return True

    @property
    def has_pending_work(self) -> bool:
        """Loads still waiting: the engine must step to bind them when they settle."""
        return bool(self._parked)

    def stop(self) -> None:
        self._waiter.stop()

    def _bind(
        self, parked: ParkedLoad, settled: Settled, num_cached_tokens: int
    ) -> LoadFailure | None:
        """Read prefill's announced params as a router's are read, bound to the parked
        request (None: it loads); on a refusal the lease is cancelled at once."""
        request, awaited = parked.request, parked.awaited
        try:
            bound, _ = self._announced(parked, settled)
            _, loads = self._match(request, bound, num_cached_tokens)
        except InvalidTransferParams as exc:
            self._waiter.cancel(request.request_id, awaited)
            return _refused(awaited, exc)
        if not loads:
            self._waiter.cancel(request.request_id, awaited)
            return LoadFailure(FailureKind.PARAMS, "the announced lease gives nothing to load")
        return None

    def _announced(self, parked: ParkedLoad, settled: Settled) -> tuple[ParsedParams, RemoteSource]:
        """Prefill's announced params read as a router's are, bound to the parked request, and
        the source they name; raises InvalidTransferParams."""
        request = parked.request
        parsed = self._read(msgspec.structs.replace(request, kv_transfer_params=settled.params))
        source = parsed.source
        if source is None or parsed.pulls or parsed.awaits is not None:
            raise InvalidTransferParams("they ask for no load from prefill")
        if source.engine_id != settled.engine_id:
            raise InvalidTransferParams(
                f"they name engine {source.engine_id!r}, but engine "
                f"{settled.engine_id!r} announced them"
            )
        # The record keeps the router's params object as raw: later hooks see that one.
        return msgspec.structs.replace(parsed, raw=request.kv_transfer_params), source

    def _first_chunk(
        self, parked: ParkedLoad, settled: Settled, record: RequestLoad | None
    ) -> None:
        """A partial announcement for a load with nothing read yet: bind it once it gives
        decode something to read, and send that READ."""
        request_id = parked.request.request_id
        if record is None or record.state is not CLAIMED:
            self._drop(parked)  # no longer wanted
            return
        pull = self._pulls.get(request_id)
        if pull is None:
            pull = self._pulls[request_id] = ChunkedPull(
                parked.block_ids, self._block_sizes,
                num_cached_tokens=record.num_cached_tokens, num_tokens=record.num_tokens,
            )  # fmt: skip
        try:
            bound, source = self._announced(parked, settled)
            increment = pull.next(source, _num_tokens(bound), final=False)
            if increment is None:
                return  # nothing past decode's own prefix yet: wait for more
            _, loads = self._match(parked.request, bound, record.num_cached_tokens)
        except InvalidTransferParams as exc:
            failure: LoadFailure = _refused(parked.awaited, exc)
        except ChunkRefused as exc:
            failure = exc.failure
        else:
            if loads:
                self._consumer.update_state_after_alloc(
                    request_id, parked.block_ids, parked.num_external_tokens
                )
                if record.local_block_ids is None:  # unplannable: the next step fails it
                    self._drop(parked)
                    return
                self._send(request_id, record, source, increment)
                return
            failure = LoadFailure(FailureKind.PARAMS, "the announced lease gives nothing to load")
        self._drop(parked)
        self._consumer.refuse_claim(
            request_id, failure.message, parked.num_external_tokens, kind=failure.kind
        )

    def _next_chunk(self, parked: ParkedLoad, settled: Settled, record: RequestLoad) -> None:
        """An announcement (or the wait's end) for a load whose chunk READs are out."""
        request_id = parked.request.request_id
        failure = settled.failure
        if failure is None:
            try:
                bound, source = self._announced(parked, settled)
                pull = self._pulls[request_id]
                increment = pull.next(source, _num_tokens(bound), final=not settled.partial)
            except InvalidTransferParams as exc:
                failure = _refused(parked.awaited, exc)
            except ChunkRefused as exc:
                failure = exc.failure
        if failure is not None:
            self._drop(parked)  # prefill's lease ends at once (if any is left)
            self._consumer.stop_chunks(request_id, failure)
            return
        if increment is not None:
            self._send(request_id, record, source, increment)
        if not settled.partial:  # the final LoadSpec went out: from here a sequential load
            self._parked.pop(request_id, None)
            self._pulls.pop(request_id, None)

    def _send(
        self, request_id: str, record: RequestLoad, source: RemoteSource, increment: Increment
    ) -> None:
        """One chunk's LoadSpec (or the final one) for a bound load: it reads tokens
        [start, end) into their blocks; the final one proves [num_cached_tokens, num_tokens)."""
        local = record.local_block_ids
        if local is None:
            return  # decode's blocks cannot take the load: the next step fails it (PLAN)
        source = msgspec.structs.replace(source, reader=self._reader)
        spec = LoadSpec(
            request_id, local, increment.end_token, record.num_cached_tokens, source,
            record.token_ids, record.kv_salt, chunk=not increment.final,
            num_read_tokens=increment.start_token, read_block_ids=increment.local_block_ids,
        )  # fmt: skip
        self._consumer.send_chunk(request_id, spec)

    def _drop(self, parked: ParkedLoad) -> None:
        """Forget a parked load and cancel its transfer (prefill's lease ends at once)."""
        request_id = parked.request.request_id
        self._parked.pop(request_id, None)
        self._pulls.pop(request_id, None)
        self._waiter.cancel(request_id, parked.awaited)


def _refused(awaited: AwaitedLease, exc: InvalidTransferParams) -> LoadFailure:
    return LoadFailure(
        FailureKind.PARAMS,
        f"prefill announced kv_transfer_params for transfer_key {awaited.transfer_key!r} "
        f"that decode refuses: {exc}",
    )


def _num_tokens(parsed: ParsedParams) -> int:
    """The tokens whose KV an announcement's blocks hold (chunked pulls need the count)."""
    num_tokens = None if parsed.params is None else parsed.params.remote_num_tokens
    if num_tokens is None:
        raise InvalidTransferParams("remote_num_tokens is missing; a chunked pull needs it")
    return num_tokens
