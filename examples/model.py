"""A tiny deterministic decoder-only transformer that reads and writes its KV through a paged cache.

Every token is computed on its own (one position at a time), in float64, with reductions done
as elementwise products summed over a contiguous axis. So a token's result depends only on the
values it reads, never on batch shape, block layout or tensor-parallel size: a prefill engine,
a decode engine and a single reference engine produce bit-identical KV and tokens.

Model kinds:
- dense: grouped-query attention (8 query heads over 4 KV heads).
- mla: a latent cache (one replicated 16-wide latent per token), keys/values projected from it.
- hybrid-swa: full-attention layers and sliding-window layers with a smaller head_dim (a
  different page size), in two cache groups.
- hybrid-ssm: full-attention layers and a toy recurrent layer whose per-request state lives
  in an SSM cache group, one state per block boundary.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from connector.errors import UnsupportedConfiguration
from connector.layout import GroupKind

Array = npt.NDArray[np.float64]

VOCAB_SIZE = 64
MODEL_DIM = 32
MAX_POSITIONS = 4096
CACHE_DTYPE_BYTES = 4  # the cache stores float32; compute is float64


class ModelKind(enum.Enum):
    DENSE = "dense"
    MLA = "mla"
    HYBRID_SWA = "hybrid-swa"
    HYBRID_SSM = "hybrid-ssm"


@dataclass(frozen=True)
class LayerPlan:
    """One model layer and the cache group that holds its KV (or state)."""

    kind: GroupKind
    num_kv_heads: int  # model-wide KV heads (MLA: 1 latent; SSM: state heads)
    head_dim: int  # elements per head (MLA: latent width; SSM: state width)
    num_planes: int  # K and V = 2; latent or state = 1
    window: int | None = None  # sliding window in tokens (SLIDING_WINDOW only)


_LAYER_PLANS: dict[ModelKind, tuple[LayerPlan, ...]] = {
    ModelKind.DENSE: (LayerPlan(GroupKind.FULL, 4, 8, 2),) * 2,
    ModelKind.MLA: (LayerPlan(GroupKind.MLA, 1, 16, 1),) * 2,
    ModelKind.HYBRID_SWA: (
        LayerPlan(GroupKind.FULL, 4, 8, 2),
        LayerPlan(GroupKind.SLIDING_WINDOW, 4, 4, 2, window=6),
        LayerPlan(GroupKind.FULL, 4, 8, 2),
        LayerPlan(GroupKind.SLIDING_WINDOW, 4, 4, 2, window=6),
    ),
    ModelKind.HYBRID_SSM: (
        LayerPlan(GroupKind.FULL, 4, 8, 2),
        LayerPlan(GroupKind.SSM, 4, 8, 1),
        LayerPlan(GroupKind.FULL, 4, 8, 2),
    ),
}
NUM_QUERY_HEADS = 8  # attention layers; MLA uses 4 query heads of head_dim 8
MLA_QUERY_HEADS = 4
MLA_HEAD_DIM = 8


def layer_plans(kind: ModelKind) -> tuple[LayerPlan, ...]:
    """The model's layers in order; layers of one GroupKind share one cache group."""
    return _LAYER_PLANS[kind]


class RequestCache(Protocol):
    """One request's view of the paged cache, by model layer index and token position."""

    @property
    def tp_size(self) -> int: ...

    def rank_heads(self, layer: int, tp_rank: int) -> range:
        """Model-wide head indices rank ``tp_rank`` holds for ``layer``."""
        ...

    def write(self, layer: int, position: int, planes: tuple[Array, ...]) -> None:
        """Store one token's planes, each shaped (model heads, head_dim), on every rank."""
        ...

    def read(self, layer: int, start: int, end: int, tp_rank: int) -> tuple[Array, ...]:
        """Rank ``tp_rank``'s planes for tokens [start, end), each (tokens, rank heads, dim)."""
        ...

    def read_state(self, layer: int, num_tokens: int) -> Array:
        """The SSM state after ``num_tokens`` tokens, (model heads, dim); zeros for 0."""
        ...

    def write_state(self, layer: int, position: int, state: Array) -> None:
        """Store the state after the token at ``position``."""
        ...


def check_tp(kind: ModelKind, tp_size: int) -> None:
    """Raise UnsupportedConfiguration if ``kind``'s heads cannot be split over ``tp_size``."""
    query_heads = MLA_QUERY_HEADS if kind is ModelKind.MLA else NUM_QUERY_HEADS
    kv_heads = layer_plans(kind)[0].num_kv_heads
    if tp_size < 1 or query_heads % tp_size or (kind is not ModelKind.MLA and kv_heads % tp_size):
        raise UnsupportedConfiguration(
            f"model {kind.value} cannot run with tensor-parallel size {tp_size}: it has "
            f"{query_heads} query heads and {kv_heads} KV heads; use a TP size dividing both"
        )


def _dot(matrix_rows: Array, vector: Array) -> Array:
    """matrix_rows @ vector with a fixed reduction order (sum over a contiguous last axis)."""
    return (matrix_rows * vector).sum(axis=-1)


def _rms_norm(x: Array) -> Array:
    return x / np.sqrt((x * x).sum() / x.shape[0] + 1e-6)


class TinyModel:
    """Seeded weights; ``step`` runs one token through every layer and returns the next token."""

    def __init__(self, kind: ModelKind, seed: int = 0) -> None:
        self.kind = kind
        self.plans = layer_plans(kind)
        rng = np.random.default_rng(seed)

        def weight(*shape: int) -> Array:
            return rng.standard_normal(shape) / np.sqrt(shape[-1])

        self.embed = rng.standard_normal((VOCAB_SIZE, MODEL_DIM))
        self.pos_embed = 0.5 * rng.standard_normal((MAX_POSITIONS, MODEL_DIM))
        self.unembed = weight(VOCAB_SIZE, MODEL_DIM)
        self.layers: list[dict[str, Array]] = []
        for plan in self.plans:
            w: dict[str, Array] = {"up": weight(64, MODEL_DIM), "down": weight(MODEL_DIM, 64)}
            if plan.kind is GroupKind.MLA:
                w["q"] = weight(MLA_QUERY_HEADS, MLA_HEAD_DIM, MODEL_DIM)
                w["latent"] = weight(plan.head_dim, MODEL_DIM)
                w["uk"] = weight(MLA_QUERY_HEADS, MLA_HEAD_DIM, plan.head_dim)
                w["uv"] = weight(MLA_QUERY_HEADS, MLA_HEAD_DIM, plan.head_dim)
                w["o"] = weight(MODEL_DIM, MLA_QUERY_HEADS * MLA_HEAD_DIM)
            elif plan.kind is GroupKind.SSM:
                w["b"] = weight(plan.num_kv_heads, plan.head_dim, MODEL_DIM)
                w["decay"] = rng.uniform(0.5, 0.95, (plan.num_kv_heads, plan.head_dim))
                w["c"] = weight(MODEL_DIM, plan.num_kv_heads * plan.head_dim)
            else:
                w["q"] = weight(NUM_QUERY_HEADS, plan.head_dim, MODEL_DIM)
                w["k"] = weight(plan.num_kv_heads, plan.head_dim, MODEL_DIM)
                w["v"] = weight(plan.num_kv_heads, plan.head_dim, MODEL_DIM)
                w["o"] = weight(MODEL_DIM, NUM_QUERY_HEADS * plan.head_dim)
            self.layers.append(w)

    def check_tp(self, tp_size: int) -> None:
        check_tp(self.kind, tp_size)

    def step(self, token_id: int, position: int, cache: RequestCache) -> int:
        """Run token ``token_id`` at ``position`` (writing its KV) and return the greedy next token."""
        if not 0 <= position < MAX_POSITIONS:
            raise UnsupportedConfiguration(
                f"position {position} is outside the model's {MAX_POSITIONS} positions"
            )
        x = self.embed[token_id] + self.pos_embed[position]
        for index, (plan, w) in enumerate(zip(self.plans, self.layers, strict=True)):
            h = _rms_norm(x)
            if plan.kind is GroupKind.MLA:
                x = x + self._mla(index, w, h, position, cache)
            elif plan.kind is GroupKind.SSM:
                x = x + self._recurrent(index, w, h, position, cache)
            else:
                x = x + self._attention(index, plan, w, h, position, cache)
            x = x + _dot(w["down"], np.tanh(_dot(w["up"], _rms_norm(x))))
        logits = _dot(self.unembed, _rms_norm(x))
        return int(np.argmax(logits))

    def _attention(
        self,
        layer: int,
        plan: LayerPlan,
        w: dict[str, Array],
        h: Array,
        position: int,
        cache: RequestCache,
    ) -> Array:
        cache.write(layer, position, (_dot(w["k"], h), _dot(w["v"], h)))
        start = 0 if plan.window is None else max(0, position + 1 - plan.window)
        queries = _dot(w["q"], h)  # (query heads, head_dim)
        group_size = NUM_QUERY_HEADS // plan.num_kv_heads
        out = np.zeros((NUM_QUERY_HEADS, plan.head_dim))
        for tp_rank in range(cache.tp_size):
            keys, values = cache.read(layer, start, position + 1, tp_rank)
            for local_head, kv_head in enumerate(cache.rank_heads(layer, tp_rank)):
                for q_head in range(kv_head * group_size, (kv_head + 1) * group_size):
                    out[q_head] = _attend(
                        queries[q_head], keys[:, local_head], values[:, local_head]
                    )
        return _dot(w["o"], out.reshape(-1))

    def _mla(
        self, layer: int, w: dict[str, Array], h: Array, position: int, cache: RequestCache
    ) -> Array:
        cache.write(layer, position, (_dot(w["latent"], h)[None, :],))
        queries = _dot(w["q"], h)
        heads_per_rank = MLA_QUERY_HEADS // cache.tp_size
        out = np.zeros((MLA_QUERY_HEADS, MLA_HEAD_DIM))
        for tp_rank in range(cache.tp_size):
            (latents,) = cache.read(layer, 0, position + 1, tp_rank)  # every rank: whole latent
            latent = latents[:, 0, None, :]  # (tokens, 1, latent)
            for q_head in range(tp_rank * heads_per_rank, (tp_rank + 1) * heads_per_rank):
                keys = _dot(w["uk"][q_head], latent)
                values = _dot(w["uv"][q_head], latent)
                out[q_head] = _attend(queries[q_head], keys, values)
        return _dot(w["o"], out.reshape(-1))

    def _recurrent(
        self, layer: int, w: dict[str, Array], h: Array, position: int, cache: RequestCache
    ) -> Array:
        state = w["decay"] * cache.read_state(layer, position) + np.tanh(_dot(w["b"], h))
        cache.write_state(layer, position, state)
        return _dot(w["c"], cache.read_state(layer, position + 1).reshape(-1))


def _attend(query: Array, keys: Array, values: Array) -> Array:
    """Softmax attention of one query (dim,) over keys/values (tokens, dim)."""
    scores = _dot(keys, query) / np.sqrt(query.shape[0])
    weights = np.exp(scores - scores.max())
    weights = weights / weights.sum()
    return (weights[:, None] * values).sum(axis=0)
