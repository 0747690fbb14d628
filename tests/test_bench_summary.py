"""The benchmark summary keeps the product's verdicts apart from comparison rows.

A comparison row measures an alternative the product does not ship (the HTTP
service with FastAPI alone, no fast lane) against the same goal: its verdict is
bracketed and counted on its own, so a miss there never reads as a miss of the
product, and a miss of the product is never hidden among them.
"""

from __future__ import annotations

from bench.__main__ import summary
from bench.timing import Result


def _row(name: str, ratio: float, comparison: bool = False) -> Result:
    return Result(name, 1.0, ratio, 1.0, comparison=comparison)


def test_a_comparison_rows_verdict_is_bracketed_and_judged_against_the_same_goal() -> None:
    assert _row("fastapi_x", 1.2, comparison=True).verdict == "(MISS)"
    assert _row("fastapi_x", 0.8, comparison=True).verdict == "(PASS)"
    assert _row("x", 1.2).verdict == "MISS"
    assert _row("x", 1.0).verdict == "PASS"


def test_the_summary_counts_comparison_rows_apart_from_the_products() -> None:
    rows = [_row("http_a", 0.6), _row("http_b", 1.3),
            _row("fastapi_http_a", 1.4, comparison=True), _row("fastapi_http_b", 0.9, comparison=True),
            _row("fastapi_http_c", 1.1, comparison=True)]
    text = summary(rows, quick=False, elapsed=1.0)
    counts = next(line for line in text.splitlines() if " pass, " in line)
    assert counts.startswith("1 pass, 1 miss, 0 skipped")
    assert counts.endswith("1 within the goal, 2 over")
    table = {line.split()[0]: line.split()[6] for line in text.splitlines()
             if line.startswith(("http_", "fastapi_"))}
    assert table == {"http_a": "PASS", "http_b": "MISS", "fastapi_http_a": "(MISS)",
                     "fastapi_http_b": "(PASS)", "fastapi_http_c": "(MISS)"}


def test_a_summary_without_comparison_rows_says_nothing_of_them() -> None:
    text = summary([_row("write_1k", 0.8)], quick=True, elapsed=1.0)
    assert "1 pass, 0 miss, 0 skipped" in text
    assert "comparison" not in text
