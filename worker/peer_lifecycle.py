r"""One remote engine generation as a rank knows it: the Peer record, its states and moves.

    HANDSHAKING ──► READY ──► RETIRED ──► CLOSED      (retired: no new loads; closed once
        │   \                                          idle, its lists and agents freed)
        │    └──► RETIRED_HANDSHAKING ──► FAILED
        └──────────────────────────────► FAILED
    PROBING (a background re-check of a failed key) ──► READY | FAILED

A READY peer always carries its PeerLink (plan, handshakes, agents, prepared lists): the
one call that moves it to READY sets it. The peer counts its own loads and live READs; the
table (worker/peers.py) decides when it moves.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from connector.lifecycle import TransitionTable
from connector.metadata import SideChannelBoot
from connector.protocol import WorkerHandshake

if TYPE_CHECKING:  # annotations only: no import at run time
    from worker.plan.recipe import PeerPlan
    from worker.prepped import PreparedReads

PeerKey = tuple[SideChannelBoot, int]  # (the side channel, remote TP size)


class PeerState(enum.Enum):
    HANDSHAKING = "handshaking"  # the key's handshake is in flight; loads wait for it
    PROBING = "probing"  # a background re-check of a failed key: no load waits on it
    RETIRED_HANDSHAKING = "retired_handshaking"  # superseded mid-handshake: it will fail
    READY = "ready"  # handshaken: carries its PeerLink
    RETIRED = "retired"  # superseded: no new loads; its agents go once it is idle
    FAILED = "failed"  # the handshake failed (``failure`` says why); terminal
    CLOSED = "closed"  # a retired peer's agents and lists are gone; terminal


_S = PeerState
PEER_LIFECYCLE = TransitionTable(
    "peer",
    {
        _S.HANDSHAKING: {_S.READY, _S.FAILED, _S.RETIRED_HANDSHAKING},
        _S.PROBING: {_S.READY, _S.FAILED},
        _S.RETIRED_HANDSHAKING: {_S.FAILED},
        _S.READY: {_S.RETIRED},
        _S.RETIRED: {_S.CLOSED},
        _S.FAILED: (),
        _S.CLOSED: (),
    },
)
_WAITING = frozenset({_S.HANDSHAKING, _S.PROBING, _S.RETIRED_HANDSHAKING})


@dataclass(frozen=True)
class PeerLink:
    """What a completed handshake gives a peer, all at once: a READY peer always has one."""

    plan: PeerPlan  # pairing, prepared rows (only where lists were prepared), duty
    handshakes: dict[int, WorkerHandshake]  # remote rank -> what it sent
    agent_names: dict[int, str]  # remote rank -> its loaded NIXL agent
    prepared: dict[int, PreparedReads]  # remote rank -> prepared lists (READs by index)


@dataclass(eq=False)
class Peer:
    """One generation of a remote engine as this rank knows it.

    ``state`` moves only through PEER_LIFECYCLE (the methods below); ``link`` is set by the
    same call that makes it READY. The peer counts the loads and posted READs that hold it.
    """

    engine_id: str
    host: str
    port: int
    remote_tp_size: int
    # Remote rank this rank covers -> readers its free notification counts: computed once per
    # peer (worker.topology.notification_duty), used for the handshake, the PeerPlan and loads.
    duty: dict[int, int]
    state: PeerState = PeerState.HANDSHAKING
    failure: str | None = None  # why the handshake failed (FAILED only)
    restarted: bool = False  # FAILED because the side channel is a later boot than the params'
    link: PeerLink | None = None  # set with READY, kept while RETIRED
    stale_reason: str = "a newer handshake superseded it"  # why it retired, for waiting loads
    num_live_transfers: int = 0  # posted READs not yet released (transfer_started/ended)
    num_loads: int = 0  # loads that hold this record (load_attached/detached)
    submitted_s: float = 0.0  # when its handshake was submitted (table's clock), for metrics
    handshake_phases: str = ""  # where its handshake's time went (worker/handshake.py)
    # The prefill boot the requests' params name ("": params without one). A prefill restarted
    # under the same engine id and address is another peer: its params name another boot.
    boot_id: str = ""

    @property
    def key(self) -> PeerKey:
        side_channel = SideChannelBoot(self.engine_id, self.host, self.port, self.boot_id)
        return (side_channel, self.remote_tp_size)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def waiting(self) -> bool:
        """Its handshake is still in flight."""
        return self.state in _WAITING

    @property
    def retired(self) -> bool:
        return self.state in (_S.RETIRED_HANDSHAKING, _S.RETIRED, _S.CLOSED)

    @property
    def idle(self) -> bool:
        return self.num_live_transfers == 0 and self.num_loads == 0

    def load_attached(self) -> None:
        self.num_loads += 1

    def load_detached(self) -> None:
        self.num_loads -= 1

    def transfer_started(self) -> None:
        self.num_live_transfers += 1

    def transfer_ended(self) -> None:
        self.num_live_transfers -= 1

    def connect(self, link: PeerLink) -> None:
        """The handshake completed: READY, with what it gave."""
        self.state = PEER_LIFECYCLE.move(self._subject, self.state, _S.READY)
        self.link = link

    def fail(self, reason: str, *, restarted: bool = False) -> None:
        self.state = PEER_LIFECYCLE.move(self._subject, self.state, _S.FAILED)
        self.failure = reason
        self.restarted = restarted

    def retire(self, reason: str | None) -> None:
        target = _S.RETIRED if self.state is _S.READY else _S.RETIRED_HANDSHAKING
        self.state = PEER_LIFECYCLE.move(self._subject, self.state, target)
        if reason is not None:
            self.stale_reason = reason

    def close(self) -> None:
        self.state = PEER_LIFECYCLE.move(self._subject, self.state, _S.CLOSED)

    @property
    def _subject(self) -> str:
        return f"peer {self.engine_id} at {self.address}"
