"""vLLM's request semantics the adapter mirrors: what a transfer covers, and of which state.

After a full external load vLLM's decode recomputes the last loaded prompt token to get its
logits. Attention does not mind (the slot is rewritten with the same values), but a recurrent
state would take that token twice: so with SSM (Mamba) groups prefill stops ``backoff``
tokens short and decode loads ``N - backoff`` tokens, deriving h(N) itself. Multi-token
prediction keeps its lookahead window off the prefiller the same way. With speculative
decoding vLLM co-allocates scratch SSM slots after the running state: only the running
state is transferred.

A state is the state after exactly its tokens, so both sides count the transfer with one
function, ``transferred_prompt_tokens``, of what both see alike: the prompt's length and the
model's back-off. No request option enters it: prompt logprobs, sampling parameters and
prompt embeddings back off like any request. (A decode request that skips reading the prefix
cache, prompt logprobs there, loads nothing: vLLM's scheduler zeroes its external tokens and
our connector releases the lease.) Engines whose back-offs differ (one runs multi-token
prediction, the other not) count differently: the state prefill leased is then not the one
decode needs, and a state lease is readable only for its exact count (scheduler/leases.py).

A LoRA adapter, a cache salt and multimodal inputs change a prompt's KV without changing its
ids: ``kv_salt`` names them for the lease's token binding (connector/token_digest.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_cache_interface import MambaSpec

from connector.params import raw_flag
from connector.token_digest import KVSalt

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def prefill_backoff_tokens(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """Trailing prompt tokens prefill leaves for decode to compute (0 for plain attention)."""
    lookahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 1) or 1)
    return max(1 if kv_cache_config.has_mamba_layers else 0, lookahead - 1)


def ssm_scratch_blocks(kv_cache_config: KVCacheConfig) -> tuple[int | None, ...]:
    """Per transfer group: speculative scratch slots after the SSM state, None for attention."""
    return tuple(
        int(group.kv_cache_spec.num_speculative_blocks)
        if isinstance(group.kv_cache_spec, MambaSpec)
        else None
        for group in kv_cache_config.transfer_groups
    )


def clip_ssm_groups(
    groups: Sequence[Sequence[int]], scratch: Sequence[int | None]
) -> tuple[Sequence[int], ...]:
    """Each SSM group reduced to its running-state block; attention groups unchanged.

    vLLM's SSM list is [placeholders..., running state, scratch x num_speculative_blocks]:
    ``[0, 0, 7, 8, 9]`` with 2 scratch slots -> ``[7]``. An empty list stays empty.
    """
    return tuple(
        group if spec is None or not group else _running_state(group, spec)
        for group, spec in zip(groups, scratch, strict=True)
    )


def _running_state(group: Sequence[int], num_scratch: int) -> Sequence[int]:
    keep = len(group) - min(num_scratch, len(group) - 1)
    return group[keep - 1 : keep]


def kv_salt(request: Request) -> KVSalt:
    """What the request's KV depends on besides its ids, as vLLM's prefix cache hashes it
    (the "extra keys" of its block hashes): the LoRA adapter's name, the cache salt (both from
    token 0 on), and each multimodal item's hash and placeholder length, from its offset on.
    () for a plain request. Prompt embeddings are not here: their leases bind no ids at all.

    The adapter is named, not located: engines may keep one adapter at different paths, so
    they must give one name to one adapter.
    """
    lora, cache_salt, features = request.lora_request, request.cache_salt, request.mm_features
    if lora is None and not cache_salt and not features:
        return ()
    parts: list[tuple[int, bytes]] = []
    if lora is not None:
        parts.append((0, b"lora\0" + lora.lora_name.encode()))
    if cache_salt:
        parts.append((0, b"cache_salt\0" + cache_salt.encode()))
    for feature in features:
        position = feature.mm_position
        identity = f"{feature.identifier}\0{position.length}".encode()
        parts.append((position.offset, b"mm\0" + identity))
    return tuple(parts)


def kv_transfer_params(request: Request) -> dict[str, Any] | None:
    """The request's raw kv_transfer_params: the adapter's one reading of them. Unvalidated:
    our SchedulerConnector parses them; flags are read with ``loads_from_remote`` and
    ``offers_to_decode`` (a literal JSON true, connector.params.raw_flag)."""
    return request.kv_transfer_params


def loads_from_remote(params: Mapping[str, Any] | None) -> bool:
    """Decode side: do these params say ``do_remote_prefill: true``?"""
    return raw_flag(params, "do_remote_prefill")


def offers_to_decode(params: Mapping[str, Any] | None) -> bool:
    """Prefill side: do these params say ``do_remote_decode: true``?"""
    return raw_flag(params, "do_remote_decode")


def transferred_prompt_tokens(num_prompt_tokens: int, backoff: int) -> int:
    """The prompt tokens a prefill->decode transfer covers: prefill computes them, decode loads
    them. All but the last ``backoff``; none when the prompt has no more than that (decode
    computes it whole: a state for all of it would take its last token twice)."""
    if backoff <= 0:
        return num_prompt_tokens
    return max(num_prompt_tokens - backoff, 0)


def truncate_for_prefill(request: Request, backoff: int) -> bool:
    """Prefill side: drop the prompt tokens of a do_remote_decode request that decode computes
    (``transferred_prompt_tokens``); returns whether it did.

    Every such request, whatever it asks (prompt logprobs included: their values for the
    dropped tokens are decode's to give), so that the state prefill leases is the one decode
    loads. A prompt no longer than ``backoff`` stays whole: decode loads none of it.
    """
    num_tokens = transferred_prompt_tokens(request.num_prompt_tokens, backoff)
    if (
        num_tokens in (0, request.num_prompt_tokens)
        or not offers_to_decode(kv_transfer_params(request))
        or (request.prompt_token_ids is None and request.prompt_embeds is None)
    ):
        return False
    if request.prompt_token_ids is not None:
        del request.prompt_token_ids[num_tokens:]
    if request.prompt_embeds is not None:
        request.prompt_embeds = request.prompt_embeds[:num_tokens]
    is_token_ids = getattr(request, "prompt_is_token_ids", None)  # ids and embeddings mixed
    if is_token_ids is not None:
        request.prompt_is_token_ids = is_token_ids[:num_tokens]
    del request._all_token_ids[num_tokens:]
    request.num_prompt_tokens = num_tokens
    request.max_tokens = 1
    return True
