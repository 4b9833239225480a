"""Is an untrusted kv_transfer_params dict JSON-like data that can travel on? And short reprs.

One bounded walk (string keys, nesting at most MAX_DEPTH, every string UTF-8 encodable) that
names where a problem is: without it a deep list or a lone surrogate in any key, known or not,
raises RecursionError or UnicodeEncodeError far from the request.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from typing import Any

from connector.errors import InvalidTransferParams

MAX_DEPTH = 32  # nesting levels below the params dict; ours need 2 (remote_block_ids groups)


def check_transportable(raw: Mapping[Any, Any]) -> None:
    """Raise InvalidTransferParams unless ``raw`` is JSON-like data that can travel on.

    One bounded walk over the whole dict: string keys only, nesting at most MAX_DEPTH, every
    string UTF-8 encodable. Without it a deep list or a lone surrogate in any key (known or
    not) raises RecursionError or UnicodeEncodeError later, far from the request.
    """
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
            stack.extend(_children(path, value, depth + 1))


def _is_plain(raw: Mapping[Any, Any]) -> bool:
    """True when ``raw`` passes every rule of _check_transportable; False sends the caller
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


def _children(
    path: str, value: Mapping[Any, Any] | list[Any] | tuple[Any, ...], depth: int
) -> list[tuple[str, object, int]]:
    if not isinstance(value, Mapping):
        return [(f"{path}[{index}]", item, depth) for index, item in enumerate(value)]
    children: list[tuple[str, object, int]] = []
    for key, item in value.items():
        if not isinstance(key, str):
            raise InvalidTransferParams(
                f"kv_transfer_params{path}: key {short_repr(key)} is not a string; "
                "kv_transfer_params must be a JSON object"
            )
        check_utf8(f"{path} key", key)
        children.append((f"{path}[{short_repr(key)}]", item, depth))
    return children


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
    return text if len(text) <= 80 else text[:77] + "..."


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 3, 60, 60, 40
