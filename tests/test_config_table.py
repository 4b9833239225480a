"""scripts/config_table.py: docs/vllm.md's table from the configuration tier's outcomes."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.config_table import (
    BEGIN,
    DEFAULT_DOC,
    END,
    differences,
    render,
    replace_between_markers,
    table_rows,
)

ROOT = Path(__file__).resolve().parents[1]

OUTCOMES = [
    {"configuration": "hybrid TP1", "case": "c", "connector": "nixlpd", "passed": 6, "failed": 0},
    {"configuration": "hybrid TP1", "case": "c", "connector": "vllm", "passed": 4, "failed": 2},
    {
        "configuration": "MLA",
        "case": "m",
        "connector": "vllm",
        "passed": 0,
        "failed": 0,
        "refused": "no | MLA here",
    },
]


def test_rows_put_ours_and_vllms_side_by_side_and_show_refusals() -> None:
    table = render(OUTCOMES, ["r.json"])

    lines = table.splitlines()
    assert lines[2] == (
        "| hybrid TP1 | c | pass (6/6 token-identical) | FAIL (2 of 6 failed or differed) |"
    )
    assert lines[3] == "| MLA | m | not run | refused: no \\| MLA here |"


def test_a_case_judged_by_another_connector_names_its_oracle() -> None:
    mla = {"configuration": "MLA", "case": "m", "passed": 8, "failed": 0}
    outcomes = [
        {**mla, "connector": "nixlpd", "oracle": "vLLM's connector", "verified_loads": 16},
        {**mla, "connector": "vllm", "is_oracle": True},
    ]

    [row] = render(outcomes, ["mla.json"]).splitlines()[2:3]

    assert row == (
        "| MLA | m | pass (8/8 token-identical to vLLM's connector; 16 loads digest-verified) "
        "| the oracle (8/8 served) |"
    )


def test_table_replaces_only_what_lies_between_the_markers() -> None:
    readme = f"intro\n{BEGIN}\nold table\n{END}\noutro\n"

    updated = replace_between_markers(readme, "new")

    assert updated == f"intro\n{BEGIN}\nnew\n{END}\noutro\n"


def test_readme_without_markers_is_an_error() -> None:
    with pytest.raises(ValueError, match="config-table"):
        replace_between_markers("no markers", "new")


def test_the_document_the_script_writes_by_default_holds_one_marker_pair() -> None:
    text = (ROOT / DEFAULT_DOC).read_text()

    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"{DEFAULT_DOC}: one table, one pair"
    assert text.index(BEGIN) < text.index(END)


def test_check_tells_our_column_changing_from_vllms_alone() -> None:
    documented = render(OUTCOMES, ["r.json"])
    ours_failed = [{**OUTCOMES[0], "passed": 5, "failed": 1}, *OUTCOMES[1:]]
    vllm_passed = [OUTCOMES[0], {**OUTCOMES[1], "passed": 6, "failed": 0}, OUTCOMES[2]]

    assert differences(documented, render(OUTCOMES, ["other.json"])) == ([], [])
    ours, theirs = differences(documented, render(ours_failed, ["r.json"]))
    assert len(ours) == 1 and ours[0].startswith("hybrid TP1 / c:") and theirs == []
    ours, theirs = differences(documented, render(vllm_passed, ["r.json"]))
    assert ours == [] and len(theirs) == 1 and theirs[0].startswith("hybrid TP1 / c:")


def test_check_counts_a_row_missing_from_the_run_as_ours() -> None:
    documented = render(OUTCOMES, ["r.json"])

    ours, _ = differences(documented, render(OUTCOMES[:2], ["r.json"]))

    assert ours == ["MLA / m: documented ('not run', 'refused: no \\\\| MLA here'), this run None"]


def test_the_documented_table_parses_into_its_rows() -> None:
    rows = table_rows((ROOT / DEFAULT_DOC).read_text())

    assert rows, "docs/vllm.md's configuration table has no rows"
    assert all(len(cells) == 2 for cells in rows.values())
