"""The typed errors every module raises: one hierarchy, rooted at ConnectorError.

Messages say what was wrong, the value seen (``clipped`` when long), and what to do about
it. A request-level error fails that one request; the engine keeps serving.
"""


def clipped(text: str, max_chars: int) -> str:
    """``text`` cut to at most ``max_chars`` characters, ending in "...": a value a peer or a
    user sent goes into our messages and logs whole only when it is short."""
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


class ConnectorError(Exception):
    """Base of every error this package raises on purpose."""


class InvalidTransferParams(ConnectorError, ValueError):
    """A request's kv_transfer_params are malformed; the message names the bad key."""


class InvalidNotification(ConnectorError, ValueError):
    """A NIXL notification's bytes are not a well-formed free notification."""


class UnsupportedConfiguration(ConnectorError):
    """A configuration (ours, the engine's, or a pairing of two engines) we cannot serve."""


class TransferPlanError(ConnectorError):
    """Block ids, token counts or layouts that cannot be turned into a correct transfer plan."""


class HandshakeError(ConnectorError):
    """The side-channel handshake with a remote engine failed (timeout, garbage, mismatch)."""


class PeerRestarted(HandshakeError):
    """The remote side channel is a later boot than the one a message was meant for."""


class SideChannelTimeout(HandshakeError):
    """The remote side channel did not answer within the timeout (down, paused or unreachable)."""


class LeaseRefused(ConnectorError):
    """A lease's holder holds it, but not for this reader: its ref disagrees with what the
    holder leased. The message carries the holder's verdict."""


class TokensMismatch(LeaseRefused):
    """A lease's holder says its blocks hold other tokens than the reader's prompt: the
    params were paired with another prompt."""


class BlocksMismatch(LeaseRefused):
    """A lease's holder says the reader reads other blocks (or assumes another token count)
    than the lease holds: the params' remote_block_ids were edited or paired with another
    request's."""


class TransferFailed(ConnectorError):
    """A NIXL transfer or notification failed (peer gone, bad descriptor, backend error)."""


class ProtocolError(ConnectorError, ValueError):
    """Bytes on the side channel that do not decode to a message we understand."""


class IllegalTransition(ConnectorError, RuntimeError):
    """A lifecycle record asked to move between states its transition table does not allow:
    a bug in the connector, never a peer's or a user's doing. The message names the record."""
