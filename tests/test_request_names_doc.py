"""docs/architecture.md's "One request's names" table stays true (issue 22 item 3).

Each cell names where one value of a request lives in the module(s) its column header names:
a kv_transfer_params key (a KVTransferParams field), ``Record.field.field`` (each step a field
of the previous one's type, or a method), or ``function(parameter)``. A rename that forgets the
table fails here, naming the cell.
"""

from __future__ import annotations

import importlib
import inspect
import re
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from connector.params import KVTransferParams

DOC = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
NAME = re.compile(r"(?P<path>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\((?P<param>\w+)\))?")


def _section(title: str) -> str:
    start = DOC.index(f"## {title}\n")
    end = DOC.find("\n## ", start + 1)
    return DOC[start : end if end != -1 else len(DOC)]


def _table() -> tuple[list[str], list[list[str]]]:
    rows = [line for line in _section("One request's names").splitlines() if line.startswith("|")]
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    return cells[0], cells[2:]  # header, body (row 1 is the --- rule)


def _modules(header: str) -> list[types.ModuleType]:
    paths = re.findall(r"`([\w/]+)\.py`", header)
    return [importlib.import_module(path.replace("/", ".")) for path in paths]


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _field_type(owner: type, name: str) -> Any:
    """The type of field ``name`` of record ``owner`` (None stripped), or None if it has none."""
    # Names a module imports for annotations only (under TYPE_CHECKING) resolve through the
    # other modules the table names.
    hints = typing.get_type_hints(owner, localns=_TABLE_TYPES)
    if name not in hints:
        return None
    hint = hints[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def _resolve(modules: list[types.ModuleType], name: str) -> str | None:
    """None if ``name`` exists in one of ``modules``, else why not."""
    match = NAME.fullmatch(name)
    if match is None:
        return f"{name!r} is not a name the table can hold"
    head, *steps = match["path"].split(".")
    found = [getattr(module, head) for module in modules if hasattr(module, head)]
    if not found:
        return f"{head} is in none of {[module.__name__ for module in modules]}"
    target = found[0]
    for step in steps:
        if not isinstance(target, type):
            return f"{name}: {step} follows a value that is not a record"
        field_type = _field_type(target, step)
        if field_type is not None:
            target = field_type
        elif callable(getattr(target, step, None)):
            target = getattr(target, step)
        else:
            return f"{name}: {target.__name__} has no field or method {step}"
    param = match["param"]
    if param is not None and param not in inspect.signature(target).parameters:
        return f"{name}: {match['path']} takes no parameter {param}"
    return None


def _cells() -> list[tuple[str, str, str]]:
    """(value, column header, name) for every name in the table's body."""
    header, body = _table()
    return [
        (row[0], header[column], name)
        for row in body
        for column, cell in enumerate(row[1:], start=1)
        for name in _names(cell)
    ]


CELLS = _cells()
_TABLE_TYPES = {
    name: value
    for column in _table()[0][1:]
    for module in _modules(column)
    for name, value in vars(module).items()
    if isinstance(value, type)
}


def test_the_table_spans_the_path_from_the_params_to_the_nixl_call() -> None:
    header, body = _table()
    assert "`connector/params.py` key" in header[1] and "nixl_api.py" in header[-1]
    assert all(len(row) == len(header) for row in body), "a row with a missing cell"
    values = {row[0] for row in body}
    assert {"prefill's request id", "prefill's blocks, per cache group"} <= values


def test_every_params_key_of_a_load_has_a_row() -> None:
    header, body = _table()
    keys = {name for row in body for name in _names(row[1])}
    fields = set(KVTransferParams.__struct_fields__) - {
        "do_remote_decode",
        "do_remote_prefill",
        "transfer_mode",
        "remote_blocks_expiry_time",
        "ignored_keys",
    }
    assert fields - keys == set(), "a key a load reads is missing from the table"


@pytest.mark.parametrize(
    ("value", "header", "name"), CELLS, ids=[f"{value}: {name}" for value, _, name in CELLS]
)
def test_every_name_exists_where_its_column_says(value: str, header: str, name: str) -> None:
    if "connector/params.py" in header:  # a kv_transfer_params key
        assert name in KVTransferParams.__struct_fields__, f"{value}: no key {name}"
        return
    why = _resolve(_modules(header), name)
    assert why is None, f"docs/architecture.md, One request's names, {value}: {why}"
