"""Validate a request's kv_transfer_params (an untrusted dict from a client or router).

Keys (the same ones vLLM's NixlConnector uses, so existing routers work):

    do_remote_decode   bool   router -> prefill: keep the KV for a decode engine
    do_remote_prefill  bool   router -> decode: the prompt's KV is on a prefill engine
    remote_engine_id   str    prefill engine id (non-empty)
    remote_request_id  str    the prefill side's request id (non-empty)
    remote_block_ids   list   prefill's logical block ids per cache group: a list of lists of
                              non-negative ints, or a flat list of ints meaning one group
    remote_host        str    prefill side channel host (non-empty)
    remote_port        int    prefill side channel port, 1..65535
    tp_size            int    prefill tensor-parallel size, >= 1

A key whose value is null counts as absent (routers such as vLLM's toy proxy send
``"remote_engine_id": null`` alongside ``do_remote_decode``). With ``do_remote_prefill`` every
remote_* key and ``tp_size`` is required. Unknown keys are tolerated (routers add their own)
and listed in ``KVTransferParams.ignored_keys`` so the caller can log them; they never fail a
request. Anything else raises InvalidTransferParams naming the key and the value seen.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from connector.errors import InvalidTransferParams
from connector.metadata import BlockIds, RemoteSource

MAX_BLOCK_ID = 2**31 - 1

_NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
_BlockId = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_ID)]


class KVTransferParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Validated kv_transfer_params. With do_remote_prefill, every remote_* field is set."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_block_ids: BlockIds | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int | None = None
    ignored_keys: tuple[str, ...] = ()  # unknown keys seen in the dict (tolerated, for logging)

    def remote_source(self) -> RemoteSource:
        """Where decode reads this request's KV from; only for do_remote_prefill params."""
        if not self.do_remote_prefill:
            raise InvalidTransferParams("kv_transfer_params: do_remote_prefill is not set")
        # parse_kv_transfer_params guarantees these are set when do_remote_prefill is.
        return RemoteSource(
            engine_id=_required(self.remote_engine_id, "remote_engine_id"),
            host=_required(self.remote_host, "remote_host"),
            port=_required(self.remote_port, "remote_port"),
            tp_size=_required(self.tp_size, "tp_size"),
            request_id=_required(self.remote_request_id, "remote_request_id"),
            block_ids=_required(self.remote_block_ids, "remote_block_ids"),
        )


# key -> (msgspec type, accepted values for the error message)
_KEY_RULES: dict[str, tuple[Any, str]] = {
    "do_remote_decode": (bool, "true or false"),
    "do_remote_prefill": (bool, "true or false"),
    "remote_engine_id": (_NonEmptyStr, "a non-empty string"),
    "remote_request_id": (_NonEmptyStr, "a non-empty string"),
    "remote_block_ids": (list[Any], "a list of block-id lists, one per cache group"),
    "remote_host": (_NonEmptyStr, "a non-empty host name or IP address"),
    "remote_port": (
        Annotated[int, msgspec.Meta(ge=1, le=65535)],
        "an integer TCP port in 1..65535",
    ),
    "tp_size": (Annotated[int, msgspec.Meta(ge=1, le=65536)], "an integer >= 1"),
}
_REQUIRED_FOR_PREFILL = (
    "remote_engine_id",
    "remote_request_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
    "tp_size",
)


def parse_kv_transfer_params(raw: Mapping[Any, Any] | None) -> KVTransferParams | None:
    """Validate ``raw``; None or {} -> None. Raises InvalidTransferParams naming the bad key."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise InvalidTransferParams(
            f"kv_transfer_params must be a JSON object, got {type(raw).__name__} {_show(raw)}"
        )
    if not raw:
        return None
    fields: dict[str, Any] = {}
    ignored: list[str] = []
    for key, value in raw.items():
        if not isinstance(key, str):
            raise InvalidTransferParams(f"kv_transfer_params: key {_show(key)} is not a string")
        if key not in _KEY_RULES:
            ignored.append(key)
        elif value is not None:
            fields[key] = _convert_key(key, value)
    if fields.get("do_remote_decode") and fields.get("do_remote_prefill"):
        raise InvalidTransferParams(
            "kv_transfer_params: do_remote_decode and do_remote_prefill are both true; a request "
            "goes to a prefill engine (do_remote_decode) or a decode engine (do_remote_prefill)"
        )
    if fields.get("do_remote_prefill"):
        missing = [key for key in _REQUIRED_FOR_PREFILL if key not in fields]
        if missing:
            raise InvalidTransferParams(
                f"kv_transfer_params: do_remote_prefill is true but {', '.join(missing)} "
                "missing; pass through every key the prefill engine returned"
            )
    return KVTransferParams(**fields, ignored_keys=tuple(sorted(ignored)))


def validate_block_groups(params: KVTransferParams, num_groups: int) -> None:
    """Raise InvalidTransferParams unless remote_block_ids has exactly ``num_groups`` groups."""
    if params.remote_block_ids is None:
        return
    seen = len(params.remote_block_ids)
    if seen != num_groups:
        raise InvalidTransferParams(
            f"kv_transfer_params['remote_block_ids']: {seen} cache group(s) given, this engine "
            f"has {num_groups}; both engines must serve the same model and cache configuration"
        )


def params_for_decode(
    *,
    engine_id: str,
    request_id: str,
    block_ids: BlockIds,
    host: str,
    port: int,
    tp_size: int,
) -> dict[str, Any]:
    """The kv_transfer_params prefill returns for the decode engine (JSON-serialisable)."""
    return {
        "do_remote_prefill": True,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": [list(group) for group in block_ids],
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
    }


def _convert_key(key: str, value: object) -> Any:
    value_type, accepted = _KEY_RULES[key]
    try:
        converted = msgspec.convert(value, value_type)
    except msgspec.ValidationError as exc:
        raise _bad_value(key, value, exc, accepted) from None
    if key == "remote_block_ids":
        return _convert_block_ids(converted)
    return converted


def _convert_block_ids(groups: list[Any]) -> BlockIds:
    accepted = "a list of lists of block ids (integers in 0..2**31-1), or a flat list of ids"
    if not groups:
        raise InvalidTransferParams(
            "kv_transfer_params['remote_block_ids']: [] holds no cache group; expected " + accepted
        )
    shape: Any = list[list[_BlockId]] if isinstance(groups[0], list) else list[_BlockId]
    try:
        converted = msgspec.convert(groups, shape)
    except msgspec.ValidationError as exc:
        raise _bad_value("remote_block_ids", groups, exc, accepted) from None
    if shape == list[_BlockId]:
        return (tuple(converted),)
    return tuple(tuple(group) for group in converted)


def _bad_value(key: str, value: object, exc: msgspec.ValidationError, accepted: str) -> Exception:
    detail = str(exc).replace("`$", "`" + key)
    return InvalidTransferParams(
        f"kv_transfer_params[{key!r}]: value {_show(value)} is not accepted ({detail}); "
        f"expected {accepted}"
    )


def _required(value: Any, key: str) -> Any:
    if value is None:
        raise InvalidTransferParams(f"kv_transfer_params: {key} is missing")
    return value


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
