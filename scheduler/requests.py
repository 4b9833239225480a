"""A request as the scheduler half sees it: the plain records it exchanges with the engine, and
its kv_transfer_params read for this engine (``ParamsReader``), and which of its blocks a load
fills or a multi-turn hold keeps (``uncached_suffix_blocks``, ``held_blocks``), and on a
decode engine which request's load reads each lease the params name (``SiblingLoads``: one
load per lease, its siblings wait).

Parsing is connector.params' job; the reader adds what the engine knows: its role (advisory:
an engine serves either direction when the params ask), whether it pulls earlier turns from
decode (bidirectional_kv_xfer), and whether its cache groups can take such a pull.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from connector.config import ConnectorConfig
from connector.errors import TransferPlanError
from connector.layout import GroupKind, GroupSpec, KVCacheSpec
from connector.lease_binding import KVSalt
from connector.lifecycle import LifecycleState, TransitionTable
from connector.metadata import BlockIds, LoadFailure, RemoteSource
from connector.params import AwaitedLease, KVTransferParams, parse_kv_transfer_params
from connector.protocol import lease_key

PULLABLE_KINDS = (GroupKind.FULL, GroupKind.MLA)  # groups holding every token's KV
_SSM = GroupKind.SSM  # an Enum member read off its class costs ~0.5 µs on Python 3.11


class Role(enum.Enum):
    PRODUCER = "producer"  # prefill: keeps finished requests' KV for decode engines to read
    CONSUMER = "consumer"  # decode: loads prompt KV from prefill engines
    BOTH = "both"


class RequestInfo(msgspec.Struct, gc=False):  # made per hook call; holds no cycle
    """What the connector needs to know about one engine request (not the engine's object).

    ``aborted`` matters to ``request_finished`` only: True when the engine stopped the
    request before its prompt's KV was complete (client abort, error). Prefill then does not
    offer the KV to a decode engine; decode treats it like any finish.
    """

    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None
    aborted: bool = False
    # Decode in bidirectional mode, at request_finished: the tokens whose KV the request's
    # blocks hold (prompt and answer, less the last sampled token). None: the prompt's.
    num_computed_tokens: int | None = None
    # The request's token ids, prompt first (vLLM: ``all_token_ids``; kept by a load until its
    # LoadSpec goes out, and by a holder's lease, unpacked, until a check first needs them:
    # the engine may append to the list, never change the ids a lease covers). They bind
    # leases to tokens (connector/lease_binding.py): a reader's load expects its first tokens,
    # a holder's lease holds its first ``num_prompt_tokens`` (a multi-turn hold: its final
    # tokens, ``final_tokens`` below). None: unknown (prompt embeddings, an
    # engine that does not pass them): nothing is offered, since no lease is unbound.
    token_ids: Sequence[int] | None = None
    # What the KV of those ids depends on besides them (a LoRA adapter, a cache salt,
    # multimodal inputs), as parts (first token position affected, bytes): bound with the ids,
    # so a reader whose request differs in any is refused (connector/lease_binding.py KVSalt).
    # Both sides of a transfer must derive the parts alike from their requests. (): the ids'
    # KV depends on nothing else.
    kv_salt: KVSalt = ()


class FinishedRequests(msgspec.Struct):
    """Requests whose transfer ended since the last ``take_finished()``; each appears once.

    finished_sending: prefill requests whose blocks the engine may free now.
    finished_recving: decode requests whose prompt KV arrived; decoding may start.
    failed_recving: decode requests whose load failed: request id -> why (a kind and a
    message, connector/metadata.py). Their blocks may
    be freed (no READ is in flight); the engine fails or recomputes them.
    """

    finished_sending: tuple[str, ...] = ()
    finished_recving: tuple[str, ...] = ()
    failed_recving: dict[str, LoadFailure] = msgspec.field(default_factory=dict)


class ParsedParams(msgspec.Struct, frozen=True, gc=False):  # gc=False: refers to no record
    """One request's params as parsed: ``source`` is set for a load, from a prefill engine or
    (``pulls``, bidirectional mode) from a decode engine holding an earlier turn; ``awaits``
    instead (overlapped dispatch) while the source is still to be announced by prefill."""

    raw: object  # the params object parsed: the parse is reused only while the request has it
    params: KVTransferParams | None
    source: RemoteSource | None
    pulls: bool = False
    awaits: AwaitedLease | None = None


class RequestLoadState(LifecycleState):
    """Where one request's load stands in the scheduler: the request's only record there,
    from the engine's first ask to request_finished (scheduler/consumer.py)."""

    NEW = enum.auto()  # record made; moved on before the call that made it returns
    CLAIMED = enum.auto()  # tokens claimed on the params' word; params unread (bind at alloc)
    REFUSING = enum.auto()  # params refused; tokens claimed so the engine parks the request
    REFUSED = enum.auto()  # params refused (announced as a failed load if parked): never loads
    MATCHED = enum.auto()  # params read; get_num_new_matched_tokens claimed its tokens
    ALLOCATED = enum.auto()  # decode's blocks known; its LoadSpec goes out at the next step
    LOADING = enum.auto()  # LoadSpec sent; the engine waits for every rank's report
    DRAINING = enum.auto()  # request finished while ranks hold its blocks; report, then forget
    REPORTED = enum.auto()  # reported to the engine; forgotten at request_finished
    REPORTED_RELEASING = enum.auto()  # reported failed (unplannable); ranks still ack a release
    RELEASING = enum.auto()  # release only: ranks ack a ReleaseSpec; the engine waits for nothing
    RELEASED = enum.auto()  # prefill told to free, the request lives on: it never loads again
    ENDED = enum.auto()


_L = RequestLoadState
# No way leads from RELEASING, RELEASED or REFUSED back to LOADING: once prefill was told
# to free (or the params were refused) the request never reads a block again.
REQUEST_LOAD_LIFECYCLE = TransitionTable(
    "request load",
    {
        _L.NEW: {_L.CLAIMED, _L.REFUSING, _L.REFUSED, _L.MATCHED},
        # read at allocation (or at an ask with nothing left to load): valid, refused, or
        # asking for no load with nothing parked (ENDED; also finished while unread)
        _L.CLAIMED: {_L.MATCHED, _L.REFUSED, _L.ENDED},
        _L.REFUSING: {_L.REFUSED, _L.ENDED},  # REFUSED at allocation (announced if parked)
        _L.REFUSED: {_L.ENDED},  # at request_finished
        # asked again before allocation: no move; nothing to load at allocation: release only
        _L.MATCHED: {_L.ALLOCATED, _L.RELEASING},
        _L.ALLOCATED: {_L.LOADING, _L.DRAINING, _L.REPORTED_RELEASING},
        _L.LOADING: {_L.DRAINING, _L.REPORTED},
        _L.DRAINING: {_L.ENDED},
        _L.REPORTED: {_L.ENDED},
        _L.REPORTED_RELEASING: {_L.REPORTED, _L.RELEASING},
        _L.RELEASING: {_L.ENDED, _L.RELEASED},  # RELEASED: acked while the request lives
        _L.RELEASED: {_L.ENDED},  # at request_finished
        _L.ENDED: (),
    },
)


def final_tokens(request: RequestInfo) -> int | None:
    """Decode, at request_finished: how many leading tokens have both an id and final KV in
    the request's blocks; None without ids.

    At most ``num_computed_tokens`` (None: the prompt), and never the last id: a sampled
    token whose KV no step computed yet. Positions past the ids are scratch: vLLM 0.33's
    async scheduling counts in-flight positions (speculative drafts among them) in
    ``num_computed_tokens`` before their ids exist (``num_output_placeholders``).
    Example: ids [p0..p9, a0, a1] with num_computed_tokens 14 (two draft positions) -> 11.
    """
    token_ids = request.token_ids
    if token_ids is None:
        return None
    num_computed = request.num_computed_tokens
    if num_computed is None:
        num_computed = request.num_prompt_tokens
    return min(num_computed, len(token_ids) - 1)


logger = logging.getLogger(__name__)


class ParamsReader:
    def __init__(self, config: ConnectorConfig, role: Role, spec: KVCacheSpec) -> None:
        self._role = role
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
            if self._role is Role.PRODUCER:
                self._note_other_role(request, params)
            awaited = params.awaited_lease()
            if awaited is not None:  # overlapped: the lease is announced later
                return ParsedParams(raw, params, None, awaits=awaited)
            return ParsedParams(raw, params, params.remote_source())
        if params.do_remote_decode and self._role is Role.CONSUMER:
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


def uncached_suffix_blocks(
    block_ids: Sequence[Sequence[int]],
    groups: tuple[GroupSpec, ...],
    *,
    num_cached_tokens: int,
    num_tokens: int,
) -> BlockIds:
    """Decode's blocks covering tokens [num_cached_tokens, num_tokens), per group.

    An attention group's block i holds tokens [i * block_size, (i + 1) * block_size), so the
    suffix is blocks [num_cached_tokens // block_size, ceil(num_tokens / block_size)).
    Example: block_size 16, 40 tokens, 16 cached -> blocks [1, 3) of the request's list.
    An SSM group holds one state per request, in its last block: that block, or none when
    nothing is left to load. Raises TransferPlanError if a group holds too few blocks.
    """
    if len(block_ids) != len(groups):
        raise TransferPlanError(
            f"the engine allocated {len(block_ids)} block group(s), the KV cache spec has "
            f"{len(groups)}"
        )
    if not 0 <= num_cached_tokens <= num_tokens:
        raise TransferPlanError(
            f"num_cached_tokens={num_cached_tokens} is outside [0, num_tokens={num_tokens}]"
        )
    if num_cached_tokens == num_tokens:
        return tuple(() for _ in groups)
    if len(groups) == 1:  # the usual model; this runs once per load in a step's metadata
        return (_group_suffix(0, block_ids[0], groups[0], num_cached_tokens, num_tokens),)
    return tuple(
        [
            _group_suffix(index, group_ids, group, num_cached_tokens, num_tokens)
            for index, (group_ids, group) in enumerate(zip(block_ids, groups, strict=True))
        ]
    )


def _group_suffix(
    index: int,
    group_ids: Sequence[int],
    group: GroupSpec,
    num_cached_tokens: int,
    num_tokens: int,
) -> tuple[int, ...]:
    if group.kind is _SSM:
        if not group_ids:
            raise TransferPlanError(f"cache group {index} (SSM) has no block for the state")
        return (group_ids[len(group_ids) - 1],)
    first_block = num_cached_tokens // group.block_size
    end_block = -(-num_tokens // group.block_size)
    if len(group_ids) < end_block:
        raise TransferPlanError(
            f"cache group {index}: {len(group_ids)} block(s) of {group.block_size} tokens "
            f"cannot hold {num_tokens} tokens (need {end_block})"
        )
    return tuple(group_ids[first_block:end_block])  # a copy: the engine keeps its lists


def held_blocks(
    block_ids: Sequence[Sequence[int]], groups: tuple[GroupSpec, ...], num_tokens: int
) -> BlockIds | None:
    """The blocks to hold so a reader can pull tokens [0, num_tokens) (decode in
    bidirectional mode, for a later turn; prefill, for a prompt it computed past); None when
    there is nothing a pull could use.

    Only full-attention and MLA groups hold every token's KV; a sliding window or an SSM
    state holds the sequence's end only, which a longer next prompt cannot start from.
    """
    if num_tokens <= 0 or any(group.kind not in PULLABLE_KINDS for group in groups):
        return None
    try:
        return uncached_suffix_blocks(block_ids, groups, num_cached_tokens=0, num_tokens=num_tokens)
    except TransferPlanError:
        return None


# --- sibling loads: one load per lease on a decode engine -------------------------------------


def params_key(raw: Mapping[str, Any]) -> str | None:
    """The lease (or transfer) key raw params name, read without validating them (the
    params are validated when they bind); None if they name none."""
    remote_request_id = raw.get("remote_request_id")
    if isinstance(remote_request_id, str):
        lease_id = raw.get("remote_lease_id")
        return lease_key(remote_request_id, lease_id if isinstance(lease_id, str) else "")
    transfer_key = raw.get("transfer_key")
    return f"transfer:{transfer_key}" if isinstance(transfer_key, str) else None


class SiblingLoads:
    """Decode side: one load per prefill lease on this engine; a request naming a lease another
    request's load reads waits for it, then computes locally what its prefix cache does not hold.

    vLLM fans an ``n > 1`` request out into children that carry the parent's
    ``kv_transfer_params``, and adds them to the engine together. Prefill frees a lease once this
    engine's ranks notify after the first load's proof, so a second load of it would fail its
    lease check (never wrong, but a good request failed). Instead, while one request's load uses
    the lease, another naming it gets ``None`` from the engine's ask (vLLM asks again next step;
    the loading request goes first, and once loaded its blocks are in the prefix cache); once
    that load is done, ``(0, False)``: the engine computes locally whatever its prefix cache does
    not hold (at most a partial block after a successful load). A wait lasts at most
    ``max_wait_s``; after it the request computes locally too.

    A request naming a lease no load on this engine uses now (params resent after their load, a
    replay of an old boot's params) loads as any other: its proof fails if the lease is gone, and
    vLLM's ``kv_load_failure_policy`` decides.

    Keys are lease keys (``connector.protocol.lease_key``), or an overlapped dispatch's transfer
    key while the lease is not drawn yet. Engine thread only.
    """

    def __init__(self, *, max_wait_s: float, clock: Callable[[], float]) -> None:
        self._max_wait_s = max_wait_s
        self._clock = clock
        self._reader_of: dict[str, str] = {}  # key -> the request whose load uses it
        self._key_of: dict[str, str] = {}  # that request -> its key
        self._waiting: dict[str, tuple[str, float]] = {}  # request -> (key, when it first waited)

    def answer(self, request_id: str, raw: Mapping[str, Any]) -> tuple[int | None, bool] | None:
        """For a request with no load record yet: ``(None, False)`` (ask again later) while
        another request's load uses its key, ``(0, False)`` (compute locally) once that load
        is done or the wait ran out; None when its params may load."""
        key = params_key(raw)
        if key is None:
            return None
        reader = self._reader_of.get(key)
        waited = self._waiting.get(request_id)
        if reader is not None and reader != request_id:
            if waited is None:
                self._waiting[request_id] = (key, self._clock())
                return None, False
            if self._clock() - waited[1] < self._max_wait_s:
                return None, False
        elif waited is None or waited[0] != key:
            return None
        del self._waiting[request_id]
        return 0, False

    def reading(self, request_id: str, key: str | None) -> None:
        """``request_id``'s load now uses ``key`` (its record started)."""
        self._waiting.pop(request_id, None)
        if key is not None and key not in self._reader_of:
            self._reader_of[key] = request_id
            self._key_of[request_id] = key

    def done(self, request_id: str) -> None:
        """``request_id``'s load no longer uses its key (read, failed, released or ended)."""
        key = self._key_of.pop(request_id, None)
        if key is not None:
            del self._reader_of[key]

    def used_by_another(self, request_id: str, key: str) -> bool:
        """At the finish of a request that never loaded (it may have waited): True if another
        request's load uses ``key``: not this one's to release."""
        self._waiting.pop(request_id, None)
        reader = self._reader_of.get(key)
        return reader is not None and reader != request_id
