"""Choose a cache group's kernel block size from what its attention backends support.

A backend declares the kernel block sizes it supports as exact ints and/or ``MultipleOf(n)``.
The group's kernel block size is the largest size every backend of the group supports that
divides the group's logical block size (the engine's allocation unit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from connector.errors import UnsupportedConfiguration


@dataclass(frozen=True)
class MultipleOf:
    """A backend supports every kernel block size that is a positive multiple of ``n``."""

    n: int


SupportedSizes = Sequence[int | MultipleOf]  # one backend's declaration


def _supports(declared: SupportedSizes, size: int) -> bool:
    return any(
        size % item.n == 0 if isinstance(item, MultipleOf) else size == item for item in declared
    )


def _describe(declared: SupportedSizes) -> str:
    parts = [
        f"multiples of {item.n}" if isinstance(item, MultipleOf) else str(item) for item in declared
    ]
    return "[" + ", ".join(parts) + "]"


def _smallest_common(backends: Sequence[SupportedSizes], limit: int) -> int | None:
    """The smallest size every backend supports, searched up to ``limit`` tokens."""
    for size in range(1, limit + 1):
        if all(_supports(declared, size) for declared in backends):
            return size
    return None


def _validate(logical_block_size: int, backends: Sequence[SupportedSizes]) -> None:
    if logical_block_size <= 0:
        raise UnsupportedConfiguration(
            f"logical block size must be positive, got {logical_block_size}"
        )
    for declared in backends:
        for item in declared:
            value = item.n if isinstance(item, MultipleOf) else item
            if value <= 0:
                raise UnsupportedConfiguration(
                    f"an attention backend declares kernel block size {item!r}; sizes must be positive"
                )


def choose_kernel_block_size(
    logical_block_size: int,
    backends_supported: Sequence[SupportedSizes],
    *,
    group_name: str = "the cache group",
) -> int:
    """Largest size every backend supports that divides ``logical_block_size``.

    No backends means no constraint (the logical size itself). Raises UnsupportedConfiguration
    naming the logical size, each backend's sizes, and a block size that would work.
    """
    _validate(logical_block_size, backends_supported)
    for size in range(logical_block_size, 0, -1):
        if logical_block_size % size == 0 and all(
            _supports(declared, size) for declared in backends_supported
        ):
            return size
    declared_text = "; ".join(
        f"backend {index}: {_describe(declared)}"
        for index, declared in enumerate(backends_supported)
    )
    common = _smallest_common(backends_supported, max(4096, 4 * logical_block_size))
    fix = (
        f"set the block size (--block-size) to a multiple of {common}"
        if common is not None
        else "the backends share no kernel block size; choose attention backends that do"
    )
    raise UnsupportedConfiguration(
        f"{group_name}: no kernel block size supported by every attention backend divides the "
        f"logical block size {logical_block_size} ({declared_text}); {fix}"
    )
