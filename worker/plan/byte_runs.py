"""The one record for byte runs: copy ``lengths[i]`` bytes from remote (region, offset) to local.

Every planning stage that yields byte ranges (exact runs, whole blocks from the prepared rows)
returns a ``ByteRuns``; the READ's descriptors are built from it (worker/reads.py), the oracle
executes it. Columns, not rows: each stage fills a column with one numpy call. A frozen msgspec Struct:
its constructor costs a fraction of a frozen dataclass's on the per-request path.

Pure: numpy only.
"""

from __future__ import annotations

import msgspec
import numpy as np
import numpy.typing as npt

Int64Array = npt.NDArray[np.int64]


class ByteRuns(msgspec.Struct, frozen=True):
    """Run i copies ``lengths[i]`` bytes from remote region ``remote_regions[i]`` at
    ``remote_offsets[i]`` to local region ``local_regions[i]`` at ``local_offsets[i]``."""

    local_regions: Int64Array
    local_offsets: Int64Array
    remote_regions: Int64Array
    remote_offsets: Int64Array
    lengths: Int64Array

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_bytes(self) -> int:
        return int(self.lengths.sum())

    def take(self, rows: npt.NDArray[np.intp] | npt.NDArray[np.int64]) -> ByteRuns:
        """The runs at ``rows`` (an index array), in that order."""
        return ByteRuns(
            self.local_regions[rows],
            self.local_offsets[rows],
            self.remote_regions[rows],
            self.remote_offsets[rows],
            self.lengths[rows],
        )


def concatenate(parts: list[ByteRuns]) -> ByteRuns:
    """The runs of ``parts`` one after the other (no merging)."""
    if len(parts) == 1:
        return parts[0]
    return ByteRuns(
        np.concatenate([p.local_regions for p in parts]),
        np.concatenate([p.local_offsets for p in parts]),
        np.concatenate([p.remote_regions for p in parts]),
        np.concatenate([p.remote_offsets for p in parts]),
        np.concatenate([p.lengths for p in parts]),
    )
