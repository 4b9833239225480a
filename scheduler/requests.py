"""The plain-data records the engine and the scheduler-side connector exchange."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import msgspec

from connector.metadata import RemoteSource
from connector.outcomes import LoadFailure
from connector.params import AwaitedLease, KVTransferParams
from connector.token_digest import KVSalt


class Role(enum.Enum):
    PRODUCER = "producer"  # prefill: keeps finished requests' KV for decode engines to read
    CONSUMER = "consumer"  # decode: loads prompt KV from prefill engines
    BOTH = "both"

    @property
    def produces(self) -> bool:
        return self is not Role.CONSUMER

    @property
    def consumes(self) -> bool:
        return self is not Role.PRODUCER


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
    # leases to tokens (connector/token_digest.py): a reader's load expects its first tokens,
    # a holder's lease holds its first ``num_prompt_tokens`` (a multi-turn hold: its final
    # tokens, ``final_tokens`` below). None: unknown (prompt embeddings, an
    # engine that does not pass them): nothing is offered, since no lease is unbound.
    token_ids: Sequence[int] | None = None
    # What the KV of those ids depends on besides them (a LoRA adapter, a cache salt,
    # multimodal inputs), as parts (first token position affected, bytes): bound with the ids,
    # so a reader whose request differs in any is refused (connector/token_digest.py KVSalt).
    # Both sides of a transfer must derive the parts alike from their requests. (): the ids'
    # KV depends on nothing else.
    kv_salt: KVSalt = ()


class FinishedRequests(msgspec.Struct):
    """Requests whose transfer ended since the last ``take_finished()``; each appears once.

    finished_sending: prefill requests whose blocks the engine may free now.
    finished_recving: decode requests whose prompt KV arrived; decoding may start.
    failed_recving: decode requests whose load failed: request id -> why (a kind and a
    message, connector/outcomes.py). Their blocks may
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
