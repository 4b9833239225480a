"""The KV cache layout description: cache groups, their layers, and each rank's byte geometry.

Two levels:
- ``KVCacheSpec`` is model-wide and says what is cached: groups (full attention, sliding
  window, MLA, SSM state), their logical and kernel block sizes, pool size and member layers.
- ``RankLayout`` is one TP rank's geometry and says where every byte lives: for each layer's
  plane (K, V, MLA latent or SSM state) its region, offset and strides per kernel block. It is
  what a rank sends its peers in the handshake, and all the planner needs to address memory.

Byte address of (kernel block k, token slot t, head h) in a plane:

    region base + offset_bytes + k * kernel_block_stride_bytes
                + t * token_stride_bytes + h * head_stride_bytes

followed by ``head_bytes`` contiguous bytes. A padded page (GroupSpec.page_stride_bytes) only
widens kernel_block_stride_bytes (or, block-outermost, the offsets of later layers). NHD (token-major) has token_stride_bytes ==
num_heads * head_bytes; HND (head-major) has head_stride_bytes == kernel_block_size * head_bytes.
A block-outermost region puts all layers of one kernel block together, so
kernel_block_stride_bytes spans every layer: one block of a whole group is one contiguous
span, and a request's blocks read as about one descriptor each.
"""

from __future__ import annotations

import enum

import msgspec


class GroupKind(enum.Enum):
    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    MLA = "mla"
    SSM = "ssm"


def window_read_start(num_tokens: int, window: int) -> int:
    """The first token of a sliding-window group a reader loads with ``num_tokens`` tokens.

    The next token, ``num_tokens``, attends to [num_tokens - window + 1, num_tokens] (vLLM
    0.32/0.33 ``SlidingWindowManager.get_num_skipped_tokens``: after n computed tokens,
    ``n - window + 1`` are skipped), so its window's KV is [num_tokens - window + 1,
    num_tokens): ``window - 1`` tokens. vLLM frees the blocks wholly before that start (its
    null block stands in for them) on both sides, so a read starting earlier could touch one.
    Example: 46 tokens, window 16 -> 31.
    """
    return max(num_tokens - window + 1, 0)


class MemoryLayout(enum.Enum):
    NHD = "nhd"  # per layer: (planes, kernel blocks, tokens, heads, head_dim)
    HND = "hnd"  # per layer: (planes, kernel blocks, heads, tokens, head_dim)
    # Per group: (kernel blocks, layers, planes, tokens, heads, head_dim).
    BLOCK_OUTERMOST = "block_outermost"
    # Per layer, K and V packed into one cell per (token, head), as vLLM >= 0.33 stores them
    # (its layouts LBNHC and LBHNC, cell C = K then V): planes sit head_bytes apart in a cell.
    NHD_PACKED = "nhd_packed"  # per layer: (kernel blocks, tokens, heads, planes * head_dim)
    HND_PACKED = "hnd_packed"  # per layer: (kernel blocks, heads, tokens, planes * head_dim)
    # Block-outermost and packed, vLLM's BLNHC and BLHNC: one row per kernel block holding
    # every layer's packed page back to back (rows may be padded: KVCacheSpec.block_stride_bytes).
    BLOCK_NHD_PACKED = "block_nhd_packed"  # per group: (kernel blocks, layers, tokens, heads, C)
    BLOCK_HND_PACKED = "block_hnd_packed"  # per group: (kernel blocks, layers, heads, tokens, C)

    # Each value names its properties: "block_" rows, "_packed" cells, "hnd" head-major.
    @property
    def block_outermost(self) -> bool:
        """One kernel block of every layer of a group is one contiguous row."""
        return self.value.startswith("block_")

    @property
    def packed(self) -> bool:
        """K and V of one (token, head) sit side by side in one cell."""
        return self.value.endswith("_packed")

    @property
    def head_major(self) -> bool:
        """Inside a layer's block, each head's tokens are contiguous."""
        return "hnd" in self.value


class BlockFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What is known of the bytes inside one kernel block: a fact about the attention kernel.

    Token-addressable blocks hold each (token, head) where the memory layout's formula says,
    so any token range can be copied and peers may differ in block sizes and TP. Any other
    format is opaque: the kernel keeps its own order inside a block (vLLM's CPU backend stores
    K transposed per head), so blocks move whole, only between peers with the same ``name``,
    block sizes and memory layout. ``head_chunks``: an opaque block is one independent,
    contiguous chunk per head (head-major layouts), so TP head slices still work.
    """

    name: str = "tokens"  # compared between peers, e.g. "CPU_ATTN:vec"
    token_addressable: bool = True
    head_chunks: bool = False


TOKEN_ADDRESSABLE = BlockFormat()


class LayerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One layer's cache shape, model-wide (before TP sharding).

    Attention: two planes (K, V), ``num_kv_heads`` heads of ``head_dim`` elements per token.
    MLA: one plane, one replicated "head" holding the latent of ``head_dim`` elements.
    SSM: one plane holding a request's recurrent state: ``num_kv_heads`` state heads of
    ``head_dim`` elements, one state per block (there is no token axis).

    ``dtype_bytes`` is the cache element's size (1 for an FP8 cache, whatever the model's
    dtype). ``kv_scales``: a cache quantized per tensor (vLLM's ``fp8``) stores each element
    as value / scale with one K and one V scale per layer, kept by the attention layer, not
    in the pages; bytes mean the same values on two engines only under equal scales. None:
    unquantized, or not known on this side (vLLM's scheduler process).
    """

    name: str
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    num_planes: int = 2
    kv_scales: tuple[float, float] | None = None  # (k_scale, v_scale)


class GroupSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One KV cache group: layers that share block ids and a block size."""

    kind: GroupKind
    block_size: int  # logical block: tokens per engine allocation unit
    kernel_block_size: int  # tokens per attention-kernel block; divides block_size
    num_blocks: int  # logical blocks in the pool, from the engine's configuration
    layers: tuple[LayerSpec, ...]
    window: int | None = None  # SLIDING_WINDOW only: a position attends to the last `window` tokens
    block_format: BlockFormat = TOKEN_ADDRESSABLE
    # Padded pages: the bytes one layer's kernel block occupies on this engine's ranks, padding
    # included (None: exactly its content). vLLM pads a hybrid's state pages up to its
    # attention pages (and may pad attention pages), so one page of one layer is content, then
    # unused bytes. Only content moves; the other side's padding may differ. A page is one
    # layer's kernel block of every plane: padding needs the planes of a kernel block side by
    # side (packed or block-outermost layouts, or one-plane layers: state, MLA latent).
    page_stride_bytes: int | None = None

    @property
    def ratio(self) -> int:
        """Kernel blocks per logical block."""
        return self.block_size // self.kernel_block_size


class KVCacheSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What an engine caches, model-wide. Both sides of a transfer must agree on the model part."""

    model: str
    dtype: str  # the model's dtype name, e.g. "bfloat16"
    cache_dtype: str  # the KV cache's dtype name
    groups: tuple[GroupSpec, ...]
    memory_layout: MemoryLayout = MemoryLayout.NHD
    # Block-outermost layouts only: the engine's row, shared by every group. Bytes from one
    # logical block's row to the next on this engine's ranks (vLLM sizes every group's row
    # like its largest group's and aliases all groups in one buffer): every group then lives
    # in one region. None: each group has its own region, rows holding exactly its pages.
    block_stride_bytes: int | None = None


class PlaneGeometry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where one plane (K, V, latent or state) of one layer lives in one rank's memory."""

    layer: int  # index of the layer within its group
    plane: int  # 0 = K (or latent, or state), 1 = V
    region: int  # index into RankLayout.region_bytes
    offset_bytes: int  # start of kernel block 0 within the region
    kernel_block_stride_bytes: int
    token_stride_bytes: int
    head_stride_bytes: int
    head_bytes: int  # contiguous bytes of one head of one token
    num_heads: int  # heads this rank holds
    model_heads: int  # heads of this layer across all ranks (before sharding)
    replicated: bool  # every rank holds the whole plane (MLA latent)


class GroupGeometry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One cache group as laid out on one rank."""

    kind: GroupKind
    block_size: int
    kernel_block_size: int
    num_blocks: int
    window: int | None
    planes: tuple[PlaneGeometry, ...]  # layer-major: (layer 0, K), (layer 0, V), (layer 1, K), ...
    block_format: BlockFormat = TOKEN_ADDRESSABLE

    @property
    def ratio(self) -> int:
        return self.block_size // self.kernel_block_size

    @property
    def num_kernel_blocks(self) -> int:
        return self.num_blocks * self.ratio


class RankLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One TP rank's KV cache geometry: everything a peer needs to address its bytes."""

    tp_rank: int
    tp_size: int
    memory_layout: MemoryLayout
    groups: tuple[GroupGeometry, ...]
    region_bytes: tuple[int, ...]  # size of each registered region, in bytes
