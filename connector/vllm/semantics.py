"""vLLM's decode semantics the adapter mirrors: the prefill backoff and SSM scratch slots.

After a full external load vLLM's decode recomputes the last loaded prompt token to get its
logits. Attention does not mind (the slot is rewritten with the same values), but a recurrent
state would take that token twice: so with SSM (Mamba) groups prefill stops ``backoff``
tokens short and decode loads ``N - backoff`` tokens, deriving h(N) itself. Multi-token
prediction keeps its lookahead window off the prefiller the same way. With speculative
decoding vLLM co-allocates scratch SSM slots after the running state: only the running
state is transferred.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_cache_interface import MambaSpec

from connector.params import raw_flag

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


def truncate_for_prefill(request: Request, backoff: int) -> bool:
    """Prefill side: drop the last ``backoff`` prompt tokens of a do_remote_decode request.

    Returns whether it did. A request that skips the prefix cache (prompt logprobs) is left
    whole: decode recomputes its whole prompt and loads nothing.
    """
    if (
        backoff <= 0
        or not offers_to_decode(kv_transfer_params(request))
        or request.num_prompt_tokens <= backoff
        or request.prompt_token_ids is None
        or request.get_skip_reading_prefix_cache()
    ):
        return False
    del request.prompt_token_ids[-backoff:]
    del request._all_token_ids[-backoff:]
    request.num_prompt_tokens -= backoff
    request.max_tokens = 1
    return True
