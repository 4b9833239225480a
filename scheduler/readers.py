"""Which reader boot claimed each held lease, and which leases a reader's restart orphaned.

A reader names itself (``ReaderId``: its engine id and the boot of its process) in its lease
checks, heartbeats and releases. A message naming a held lease *claims* it for that reader
boot. When a message comes from a new boot of a reader engine seen before, the earlier boot
is gone (it restarted under the same engine id): the leases only that earlier boot claimed
will never be read or freed by it, so ``seen`` returns them for the holder to end now rather
than at the lease's expiry.

Left alone: leases never claimed (their reader may not have asked yet), leases that another
reader also claimed (several decode engines, or a reader whose ranks run as other boots),
and every lease the new boot claimed, in this very message too. A retired boot never becomes
current again: a late message from it is served but claims and ends nothing, so two
processes wrongly sharing one engine id end each other's leases at most once per boot.
Messages without a reader (older peers) change nothing here.

Not thread-safe: the LeaseTable calls it under its own lock. Bounded: claims live only while
their lease is held (``forget``), and at most MAX_READER_ENGINES engines and
MAX_RETIRED_BOOTS retired boots are remembered (oldest dropped first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from connector.protocol import ReaderId

MAX_READER_ENGINES = 4096
MAX_RETIRED_BOOTS = 4096


class ReaderBoots:
    def __init__(self) -> None:
        self._current: OrderedDict[str, str] = OrderedDict()  # reader engine id -> its boot
        self._retired: OrderedDict[ReaderId, None] = OrderedDict()  # boots that restarted
        self._claims: dict[str, set[ReaderId]] = {}  # held lease name -> its claimants
        self._by_reader: dict[ReaderId, set[str]] = {}  # claimant -> lease names it claimed

    def seen(self, reader: ReaderId, held_names: Iterable[str]) -> list[str]:
        """A message from ``reader`` named the held leases ``held_names``: record the claims,
        and return the names of the leases an earlier boot of that engine alone claimed."""
        if reader in self._retired:
            return []
        for name in held_names:
            self._claims.setdefault(name, set()).add(reader)
            self._by_reader.setdefault(reader, set()).add(name)
        earlier = self._current.get(reader.engine_id)
        self._current[reader.engine_id] = reader.boot_id
        self._current.move_to_end(reader.engine_id)
        if len(self._current) > MAX_READER_ENGINES:
            self._current.popitem(last=False)
        if earlier is None or earlier == reader.boot_id:
            return []
        return self._retire(ReaderId(reader.engine_id, earlier))

    def forget(self, name: str) -> None:
        """The lease ``name`` ended: drop its claims."""
        for reader in self._claims.pop(name, ()):
            names = self._by_reader.get(reader)
            if names is not None:
                names.discard(name)
                if not names:
                    del self._by_reader[reader]

    def _retire(self, gone: ReaderId) -> list[str]:
        self._retired[gone] = None
        if len(self._retired) > MAX_RETIRED_BOOTS:
            self._retired.popitem(last=False)
        names = self._by_reader.pop(gone, set())
        orphaned = sorted(name for name in names if self._claims.get(name) == {gone})
        for name in names:
            self._claims[name].discard(gone)
        return orphaned
