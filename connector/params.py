"""Validate a request's kv_transfer_params (an untrusted dict from a client or router).

The keys (vLLM's NixlConnector's, so existing routers work, plus ``remote_boot_id`` and
``remote_lease_id``, which a load's lease proof names) and the rules they follow are in
docs/vllm.md, "kv_transfer_params": null counts as absent; with ``do_remote_prefill`` every
remote_* key but ``remote_num_tokens`` is required; unknown keys are tolerated and listed in
``KVTransferParams.ignored_keys``; the whole dict must be JSON-like data that can travel on
(nested at most MAX_DEPTH deep, every string UTF-8 encodable). A multi-turn decode's params
for the next turn's prefill (``KVTransferParams.pull_source``, ``remote_blocks_expiry_time``):
docs/multiturn.md; overlapped dispatch's ``transfer_key`` (``KVTransferParams.awaited_lease``):
docs/overlap.md. Anything else raises InvalidTransferParams naming the key and the value seen;
nothing else escapes.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import msgspec

from connector.errors import InvalidTransferParams, clipped
from connector.metadata import MAX_BLOCK_ID, BlockIds, RemoteSource

TRANSFER_MODE = "pull"
MAX_DEPTH = 32  # nesting levels below the params dict; ours need 2 (remote_block_ids groups)


# Each key's rule as a type; the Meta's description says what the key accepts (error messages).
_Flag = Annotated[bool, msgspec.Meta(description="true or false")]
_Text = Annotated[
    str, msgspec.Meta(min_length=1, max_length=4096, description="a non-empty string")
]
_Host = Annotated[
    str,
    msgspec.Meta(min_length=1, max_length=4096, description="a non-empty host name or IP address"),
]
_BlockId = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_ID)]
_BlockGroup = tuple[_BlockId, ...]
_Groups = Annotated[
    tuple[_BlockGroup, ...],
    msgspec.Meta(
        description=f"a list of block-id lists (integers in 0..{MAX_BLOCK_ID}), one per cache "
        "group, or a flat list of ids"
    ),
]
_Port = Annotated[int, msgspec.Meta(ge=1, le=65535, description="an integer TCP port in 1..65535")]
_TpSize = Annotated[int, msgspec.Meta(ge=1, le=65536, description="an integer >= 1")]
_NumTokens = Annotated[int, msgspec.Meta(ge=0, le=2**40, description="an integer >= 0")]
_Mode = Annotated[
    str, msgspec.Meta(description=f"{TRANSFER_MODE!r} (decode reads the KV from prefill)")
]
# The shape of a boot id, lease id and transfer key; each type adds its own description.
_ID_SHAPE = msgspec.Meta(min_length=1, max_length=64, pattern="^[0-9A-Za-z_.-]+$")
_BootId = Annotated[
    str, _ID_SHAPE, msgspec.Meta(description="the boot id string the prefill engine returned")
]
_LeaseId = Annotated[
    str, _ID_SHAPE, msgspec.Meta(description="the lease id string the prefill engine returned")
]
_TransferKey = Annotated[
    str,
    _ID_SHAPE,
    msgspec.Meta(
        description="1..64 characters of [0-9A-Za-z_.-], e.g. a uuid4 hex the router drew"
    ),
]
_Expiry = Annotated[float, msgspec.Meta(description="a number: when decode frees the held blocks")]


class KVTransferParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Validated kv_transfer_params: the type is the rule. Each field's type states its key's
    rule (and, in its description, what the key accepts); ``__post_init__`` the rules that
    join keys. With do_remote_prefill, every remote_* field but remote_num_tokens is set.
    """

    do_remote_decode: _Flag = False
    do_remote_prefill: _Flag = False
    remote_engine_id: _Text | None = None
    remote_request_id: _Text | None = None
    remote_block_ids: _Groups | None = None
    remote_host: _Host | None = None
    remote_port: _Port | None = None
    tp_size: _TpSize | None = None
    remote_num_tokens: _NumTokens | None = None
    transfer_mode: _Mode | None = None
    remote_boot_id: _BootId | None = None
    remote_lease_id: _LeaseId | None = None
    remote_blocks_expiry_time: _Expiry | None = None  # decode's clock; advisory (pull_source)
    transfer_key: _TransferKey | None = None  # overlapped dispatch: see awaited_lease
    ignored_keys: tuple[str, ...] = ()  # unknown keys seen in the dict (tolerated, for logging)

    def __post_init__(self) -> None:
        """The rules no single key states; raises InvalidTransferParams naming the keys."""
        if self.do_remote_decode and self.do_remote_prefill:
            raise InvalidTransferParams(
                "kv_transfer_params: do_remote_decode and do_remote_prefill are both true; a "
                "request goes to a prefill engine (do_remote_decode) or a decode engine "
                "(do_remote_prefill)"
            )
        if self.transfer_key is not None:
            _check_overlap_keys(self)
        elif self.do_remote_prefill:
            missing = [key for key in _REQUIRED_FOR_PREFILL if getattr(self, key) is None]
            if missing:
                raise InvalidTransferParams(
                    f"kv_transfer_params: do_remote_prefill is true but {', '.join(missing)} "
                    "missing; pass through every key the prefill engine returned"
                )
        if self.remote_block_ids == ():
            raise InvalidTransferParams(
                "kv_transfer_params['remote_block_ids']: [] holds no cache group; expected "
                + _ACCEPTED["remote_block_ids"]
            )
        if self.transfer_mode is not None and self.transfer_mode != TRANSFER_MODE:
            raise InvalidTransferParams(
                f"kv_transfer_params['transfer_mode']: {short_repr(self.transfer_mode)} is not "
                f"served; this connector only reads prefill's KV from decode ({TRANSFER_MODE!r}): "
                "send the request to engines configured for that mode"
            )
        for key in ("remote_engine_id", "remote_request_id", "remote_host"):
            text = getattr(self, key)
            if text is not None and not text.isascii():
                check_utf8(f"[{key!r}]", text)  # msgspec converts, never encodes, strings

    def awaited_lease(self) -> AwaitedLease | None:
        """Overlapped dispatch, decode: the prefill engine whose side channel will announce
        this request's lease under ``transfer_key``; None for any other params."""
        host, port, key = self.remote_host, self.remote_port, self.transfer_key
        if not self.do_remote_prefill or key is None:
            return None
        if host is None or port is None:  # __post_init__ refused these
            raise InvalidTransferParams("kv_transfer_params: a remote_* key is missing")
        return AwaitedLease(key, self.remote_engine_id, host, port)

    def remote_source(self) -> RemoteSource:
        """Where decode reads this request's KV from; only for do_remote_prefill params."""
        if not self.do_remote_prefill:
            raise InvalidTransferParams("kv_transfer_params: do_remote_prefill is not set")
        source = self._source(None)
        if source is None:  # __post_init__ refused these (narrowed for mypy)
            raise InvalidTransferParams("kv_transfer_params: a remote_* key is missing")
        return source

    def pull_source(self) -> RemoteSource | None:
        """Prefill (bidirectional mode): where an earlier turn's KV is held, or None.

        Params a decode engine returned at request_finished, passed back with the next turn:
        ``do_remote_decode`` with the decode engine's blocks and address. Params lacking any
        of them ask for no pull (a first turn). The expiry time is not trusted: the pull is
        lease-proven like any load, so a lapsed hold fails it and prefill recomputes.
        """
        if not self.do_remote_decode or not any(self.remote_block_ids or ()):
            return None
        return self._source(self.remote_num_tokens)

    def _source(self, remote_num_tokens: int | None) -> RemoteSource | None:
        """The remote_* keys as a RemoteSource; None when one of them is missing."""
        engine_id, host, port = self.remote_engine_id, self.remote_host, self.remote_port
        request_id, block_ids = self.remote_request_id, self.remote_block_ids
        if engine_id is None or host is None or port is None or request_id is None:
            return None
        if block_ids is None:
            return None
        return RemoteSource(
            engine_id,
            host,
            port,
            1 if self.tp_size is None else self.tp_size,
            request_id,
            block_ids,
            boot_id=self.remote_boot_id or "",
            lease_id=self.remote_lease_id or "",
            remote_num_tokens=remote_num_tokens,
        )


class AwaitedLease(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Overlapped dispatch, decode: which transfer to wait for, and whose side channel
    announces its lease (the router's transfer_key, remote_engine_id, remote_host, remote_port;
    without remote_engine_id, the engine serving that side channel)."""

    transfer_key: str
    engine_id: str | None  # None: whichever engine serves host:port (learned from its Hello)
    host: str
    port: int


# Overlapped dispatch: decode's params name prefill's side channel and the key, never the
# lease (the announcement carries it); with the lease's keys they would say two things.
_REQUIRED_FOR_AWAITING = ("remote_host", "remote_port")
_ANNOUNCED_ONLY = ("remote_request_id", "remote_block_ids", "remote_boot_id", "remote_lease_id")


def _check_overlap_keys(params: KVTransferParams) -> None:
    """transfer_key's joint rules; raises InvalidTransferParams naming the keys."""
    if not (params.do_remote_decode or params.do_remote_prefill):
        raise InvalidTransferParams(
            "kv_transfer_params: transfer_key is set but neither do_remote_decode nor "
            "do_remote_prefill is true; send the key to prefill with do_remote_decode and to "
            "decode with do_remote_prefill (docs/overlap.md)"
        )
    if not params.do_remote_prefill:
        return
    missing = [key for key in _REQUIRED_FOR_AWAITING if getattr(params, key) is None]
    if missing:
        raise InvalidTransferParams(
            f"kv_transfer_params: do_remote_prefill with transfer_key but {', '.join(missing)} "
            "missing; name the prefill engine and its side channel the key was sent to "
            "(docs/overlap.md)"
        )
    present = [key for key in _ANNOUNCED_ONLY if getattr(params, key) is not None]
    if present:
        raise InvalidTransferParams(
            f"kv_transfer_params: transfer_key with {', '.join(present)}; decode learns the "
            "lease from prefill's side channel under transfer_key: send either the key "
            "(overlapped) or prefill's returned params (sequential), not both"
        )


_REQUIRED_FOR_PREFILL = (
    "remote_engine_id",
    "remote_request_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
)


def _without_none(hint: Any) -> Any:
    """``X | None`` -> X (a null value counts as absent); X -> X."""
    if get_origin(hint) in (Union, UnionType):
        return next(arg for arg in get_args(hint) if arg is not type(None))
    return hint


_FIELD_HINTS = get_type_hints(KVTransferParams, include_extras=True)
# key -> its type (None stripped: a null value counts as absent) and what it accepts
_KEY_TYPES: dict[str, Any] = {
    name: _without_none(hint) for name, hint in _FIELD_HINTS.items() if name != "ignored_keys"
}
_ACCEPTED: dict[str, str] = {
    name: next(meta.description for meta in value_type.__metadata__ if meta.description)
    for name, value_type in _KEY_TYPES.items()
}


def parse_kv_transfer_params(raw: Mapping[Any, Any] | None) -> KVTransferParams | None:
    """Validate ``raw``; None or {} -> None. Raises InvalidTransferParams naming the bad key.

    A plain dict of known keys with well-typed values (what prefill returns) is accepted by
    one msgspec convert; anything else, refusals included, takes the key-by-key path, which
    decides alike and names what is wrong.
    """
    if type(raw) is dict and raw:
        params = _convert_whole(raw)
        if params is not None:
            return params
    return _parse_key_by_key(raw)


def _convert_whole(raw: dict[Any, Any]) -> KVTransferParams | None:
    """``raw`` as KVTransferParams in one convert (every rule, ``__post_init__``'s too), or None
    to leave it to the key-by-key path: unknown keys, nulls for flags, a string port, a flat
    block list and any refusal go the long way."""
    if "ignored_keys" in raw:  # a router's key of that name is unknown to us, not our field
        return None
    try:
        return msgspec.convert(raw, KVTransferParams)
    except (msgspec.ValidationError, UnicodeEncodeError):  # a lone surrogate in a key
        return None


def _parse_key_by_key(raw: Mapping[Any, Any] | None) -> KVTransferParams | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise InvalidTransferParams(
            f"kv_transfer_params must be a JSON object, got {type(raw).__name__} {short_repr(raw)}"
        )
    if not raw:
        return None
    check_transportable(raw)
    fields: dict[str, Any] = {}
    ignored: list[str] = []
    for key, value in raw.items():
        if key not in _KEY_TYPES:
            ignored.append(key)
        elif value is not None:
            fields[key] = _convert_key(key, value)
    return KVTransferParams(**fields, ignored_keys=tuple(sorted(ignored)))  # the joint rules


def raw_flag(raw: object, key: Literal["do_remote_prefill", "do_remote_decode"]) -> bool:
    """Does the unvalidated params object say ``key: true``, literally? The one reading of a
    raw dict outside the parse: a JSON ``true`` only ("yes" or 1 is not a flag here)."""
    if type(raw) is dict:  # the usual case, without isinstance against an ABC
        return raw.get(key) is True
    return isinstance(raw, Mapping) and raw.get(key) is True


def validate_block_groups(block_ids: BlockIds | None, num_groups: int) -> None:
    """Raise InvalidTransferParams unless remote_block_ids has exactly ``num_groups`` groups."""
    if block_ids is None or len(block_ids) == num_groups:
        return
    raise InvalidTransferParams(
        f"kv_transfer_params['remote_block_ids']: {len(block_ids)} cache group(s) given, this "
        f"engine has {num_groups}; both engines must serve the same model and cache configuration"
    )


def params_for_decode(
    *,
    engine_id: str,
    request_id: str,
    block_ids: Sequence[Sequence[int]],
    host: str,
    port: int,
    tp_size: int,
    num_tokens: int | None = None,
    boot_id: str = "",
    lease_id: str = "",
) -> dict[str, Any]:
    """The kv_transfer_params prefill returns for the decode engine (JSON-serialisable).

    ``num_tokens``, when given, is sent as remote_num_tokens: the tokens whose KV the blocks
    hold (vLLM's decode and routers read it). ``boot_id`` and ``lease_id`` (when given) name
    the side channel's boot and the lease, for decode's proof that its READs were covered.
    """
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": [list(block_ids[0])]  # one group: no comprehension
        if len(block_ids) == 1
        else [list(group) for group in block_ids],
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
        "transfer_mode": TRANSFER_MODE,
    }
    if num_tokens is not None:
        params["remote_num_tokens"] = num_tokens
    if boot_id:
        params["remote_boot_id"] = boot_id
    if lease_id:
        params["remote_lease_id"] = lease_id
    return params


def params_for_prefill(
    *,
    engine_id: str,
    request_id: str,
    block_ids: Sequence[Sequence[int]],
    host: str,
    port: int,
    tp_size: int,
    num_tokens: int,
    expiry_s: float,
    boot_id: str = "",
    lease_id: str = "",
) -> dict[str, Any]:
    """The kv_transfer_params a decode engine returns (bidirectional mode) for the next turn.

    The router passes them with the next turn to a prefill engine, which pulls the KV of the
    first ``num_tokens`` tokens (prompt and answer so far) from these held blocks. vLLM 0.33's
    keys: ``do_remote_decode`` true (the next turn is still decoded remotely), decode's
    address, blocks, ``remote_num_tokens`` and ``remote_blocks_expiry_time`` (``expiry_s``,
    this engine's monotonic clock); ours add the lease and boot ids the pull's proof names.
    """
    params = params_for_decode(
        engine_id=engine_id,
        request_id=request_id,
        block_ids=block_ids,
        host=host,
        port=port,
        tp_size=tp_size,
        num_tokens=num_tokens,
        boot_id=boot_id,
        lease_id=lease_id,
    )
    params["do_remote_prefill"], params["do_remote_decode"] = False, True
    params["remote_blocks_expiry_time"] = expiry_s
    return params


def _convert_key(key: str, value: object) -> Any:
    """One key's value converted to its field's type; two lenient forms first: a decimal
    string port (some routers forward it so; vLLM accepts it) and a flat block-id list (one
    cache group)."""
    value_type = _KEY_TYPES[key]
    if key == "remote_port" and isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    flat = key == "remote_block_ids" and isinstance(value, list) and value
    if flat and not isinstance(value[0], list):  # type: ignore[index]
        value_type = _BlockGroup
    try:
        converted = msgspec.convert(value, value_type)
    except msgspec.ValidationError as exc:
        detail = str(exc).replace("`$", "`" + key)
        raise InvalidTransferParams(
            f"kv_transfer_params[{key!r}]: value {short_repr(value)} is not accepted ({detail}); "
            f"expected {_ACCEPTED[key]}"
        ) from None
    return (converted,) if value_type is _BlockGroup else converted


# JSON-like data that can travel on: one bounded walk that names where a problem is.


def check_transportable(raw: Mapping[Any, Any]) -> None:
    """Raise InvalidTransferParams unless ``raw`` is JSON-like data that can travel on: string
    keys only, nesting at most MAX_DEPTH, every string UTF-8 encodable. Without it a deep list
    or a lone surrogate in any key raises RecursionError or UnicodeEncodeError far from the
    request."""
    if _is_plain(raw):  # the common case, checked without building paths
        return
    stack: list[tuple[str, object, int]] = [("", raw, 0)]
    while stack:
        path, value, depth = stack.pop()
        if isinstance(value, str):
            check_utf8(path, value)
        elif isinstance(value, Mapping | list | tuple):
            if depth > MAX_DEPTH:
                raise InvalidTransferParams(
                    f"kv_transfer_params{path}: nested more than {MAX_DEPTH} levels deep; "
                    "send flat JSON values (block ids are a list of lists of integers)"
                )
            if not isinstance(value, Mapping):
                stack.extend(
                    (f"{path}[{index}]", item, depth + 1) for index, item in enumerate(value)
                )
                continue
            for key, item in value.items():
                if not isinstance(key, str):
                    raise InvalidTransferParams(
                        f"kv_transfer_params{path}: key {short_repr(key)} is not a string; "
                        "kv_transfer_params must be a JSON object"
                    )
                check_utf8(f"{path} key", key)
                stack.append((f"{path}[{short_repr(key)}]", item, depth + 1))


def _is_plain(raw: Mapping[Any, Any]) -> bool:
    """True when ``raw`` passes every rule of check_transportable; False sends the caller
    to the slower walk that names where the problem is. Integers (block ids) cost one check."""
    stack: list[tuple[object, int]] = [(raw, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if not _is_utf8(value):
                return False
            continue
        if isinstance(value, Mapping):
            if depth > MAX_DEPTH or not all(type(key) is str and _is_utf8(key) for key in value):
                return False
            value = list(value.values())
        elif isinstance(value, list | tuple):
            if depth > MAX_DEPTH:
                return False
        else:
            continue
        if set(map(type, value)) - _SCALARS:  # block id lists: one C-level pass
            stack.extend((item, depth + 1) for item in value if type(item) not in _SCALARS)
    return True


_SCALARS = frozenset({int, float, bool, type(None)})


def _is_utf8(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_utf8(path: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidTransferParams(
            f"kv_transfer_params{path}: {short_repr(text)} is not valid Unicode (a lone surrogate "
            f"{short_repr(text[exc.start : exc.end])} at index {exc.start}); send UTF-8 text"
        ) from None


def short_repr(value: object) -> str:
    """A repr of at most 80 characters for error messages; never raises (deep lists, ints
    of 5000 digits, lone surrogates)."""
    try:
        text = _SHORT.repr(value)
    except (RecursionError, ValueError):
        text = f"<{type(value).__name__}>"
    return clipped(text, 80)


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 3, 60, 60, 40
