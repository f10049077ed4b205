"""The benchmark reports' tables are the ones benchmarks/report.py writes from the committed results, and every
benchmark with a result has a report and a row in benchmarks/README.md's index."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def report():
    """benchmarks/report.py, with the benchmark scripts it imports taken out of sys.modules and sys.path after."""
    before = set(sys.modules)
    spec = importlib.util.spec_from_file_location("benchmark_report", BENCHMARKS / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    for name in set(sys.modules) - before:
        if Path(getattr(sys.modules[name], "__file__", None) or "/").parent == BENCHMARKS:
            del sys.modules[name]
    sys.path.remove(str(BENCHMARKS))


def test_committed_tables_match_their_results(report):
    files = report.report_files()
    assert report.update(files, write=False) == [], "run python benchmarks/report.py"
    assert set(report.TABLES) <= report.used_tables(files), "a generated table that no report shows"


def test_the_check_fails_on_an_altered_cell(report, tmp_path):
    original = (BENCHMARKS / "results" / "smet_memory.md").read_text()
    altered = original.replace("| 101.2 |", "| 101.3 |", 1)
    assert altered != original
    copy = tmp_path / "smet_memory.md"
    copy.write_text(altered)
    assert report.update([copy], write=False) == [f"{copy}: smet_memory"]
    assert copy.read_text() == altered  # the check writes nothing
    report.update([copy], write=True)
    assert copy.read_text() == original


def test_an_unknown_table_name_is_reported(report, tmp_path):
    copy = tmp_path / "report.md"
    copy.write_text("<!-- report: no_such_table -->\n| 1 |\n<!-- /report -->\n")
    assert report.update([copy], write=False) == [f"{copy}: no_such_table (unknown)"]


def test_markers_in_the_readme_and_docs_are_read(report):
    repo = BENCHMARKS.parent
    files = report.report_files()
    assert repo / "README.md" in files
    assert set((repo / "docs").glob("*.md")) <= set(files)


def test_every_benchmark_with_results_has_a_report_and_an_index_row(report):
    results = {p.stem for p in (BENCHMARKS / "results").glob("*.json")}
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")} - {"common", "report"}
    with_results = {s for s in scripts if report.results_of(s)}
    assert {name for s in with_results for name in report.results_of(s)} == results, "a result without its script"
    assert set(report.BENCHMARKS) == with_results
    assert set(report.MEASURED_AT) == {f"{name}.json" for name in results}
    index = (BENCHMARKS / "README.md").read_text()
    for stem in with_results:
        text = (BENCHMARKS / "results" / f"{stem}.md").read_text()
        assert f"<!-- report: {stem}.provenance -->" in text
        assert re.search(rf"^\| \[`{stem}\.py`\]\({stem}\.py\) \|.*\(results/{stem}\.md\)", index, re.MULTILINE), stem
