"""docs/architecture.md names every module of the installed packages (issue 13 item 7).

A module the map leaves out is how planner_packed.py went unmentioned; a module that is gone
but still listed is how kernel_blocks.py was described as used. Names are matched in
backticks, as the map writes them: `name.py`, `dir/name.py`, or `name` in a (+ ...) list.
The map has one table per folder (issue 22 item 2), and each lists exactly its folder's modules.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
PROSE = re.sub(r"```.*?```", "", DOC, flags=re.DOTALL)  # code blocks would pair backticks wrong
QUOTED = set(re.findall(r"`([^`]+)`", PROSE))


def _named(path: Path) -> bool:
    relative = path.relative_to(ROOT).as_posix()
    names = {relative, path.name, path.stem, relative.split("/", 1)[1]}
    return any(name in QUOTED for name in names)


def test_every_module_is_on_the_map() -> None:
    modules = [
        path
        for package in ("connector", "scheduler", "worker")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.name != "__init__.py" and "__pycache__" not in path.parts
    ]
    missing = [path.relative_to(ROOT).as_posix() for path in modules if not _named(path)]
    assert missing == [], f"add to docs/architecture.md's module map: {missing}"


def test_every_listed_file_exists() -> None:
    listed = {
        name
        for name in QUOTED
        if re.fullmatch(r"(connector|scheduler|worker|examples)/[\w/]+\.py", name)
    }
    gone = sorted(name for name in listed if not (ROOT / name).is_file())
    assert gone == [], f"docs/architecture.md names files that do not exist: {gone}"


# A folder's table: a line naming one folder in backticks, in parentheses, then its rows.
FOLDER_HEADING = re.compile(r"^[A-Z][^(`]*\(`((?:connector|scheduler|worker)(?:/\w+)*)/`[^`)]*\):")


def _folder_tables() -> dict[str, set[str]]:
    """Folder -> the module names (stems) its table's first column lists."""
    section = DOC[DOC.index("## Module map") : DOC.index("## The request's journey")]
    tables: dict[str, set[str]] = {}
    folder = None
    for line in section.splitlines():
        heading = FOLDER_HEADING.match(line)
        if heading:
            folder = heading.group(1)
            tables[folder] = set()
        elif folder and line.startswith("| `"):
            first_cell = line.split("|")[1]
            tables[folder] |= {
                name.removesuffix(".py") for name in re.findall(r"`([^`]+)`", first_cell)
            }
        elif folder and not line.startswith("|") and line.strip():
            folder = None
    return tables


def test_each_folder_table_lists_exactly_that_folders_modules() -> None:
    tables = _folder_tables()
    expected = {"connector", "connector/observability", "connector/net", "connector/tools"}
    assert expected | {"scheduler", "worker"} <= set(tables)
    wrong = {}
    for folder, listed in tables.items():
        modules = {p.stem for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py"}
        if listed != modules:
            wrong[folder] = {"not in folder": listed - modules, "not in table": modules - listed}
    assert wrong == {}, f"docs/architecture.md's per-folder tables disagree with the tree: {wrong}"
