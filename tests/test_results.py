"""The tables a user reads are the records' tables: the README's results table and docs/results.md
are what ``python -m benchmarks.tables`` builds from ``benchmarks/results/``, and a changed
record makes them out of date."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from benchmarks import tables

ROOT = Path(__file__).parent.parent


def test_the_readme_and_the_results_page_are_what_the_records_give():
    """Fails when a record was added or changed without ``python -m benchmarks.tables``, or a
    generated table was edited by hand."""
    assert tables.main(["--check"]) == 0


def _copy(tmp_path: Path) -> tuple[Path, Path]:
    root, results = tmp_path / "root", tmp_path / "results"
    (root / "docs").mkdir(parents=True)
    shutil.copy(ROOT / "README.md", root / "README.md")
    shutil.copy(ROOT / "docs" / "results.md", root / "docs" / "results.md")
    shutil.copytree(tables.RESULTS, results)
    return root, results


def test_a_changed_record_makes_the_check_fail(tmp_path, capsys):
    root, results = _copy(tmp_path)
    argv = ["--root", str(root), "--results", str(results)]
    assert tables.main([*argv, "--check"]) == 0
    path = next(
        p
        for p in sorted(results.glob("suite-*.json"))
        if json.loads(p.read_text())["settings"]["tier"] == "cpu"
        and not json.loads(p.read_text())["settings"]["fitting"]["sampled"]
    )
    record = json.loads(path.read_text())
    record["pairs"][0]["barriers"]["dual"] += 0.5
    path.write_text(json.dumps(record))
    assert tables.main([*argv, "--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    assert tables.main(argv) == 0  # regenerated
    assert tables.main([*argv, "--check"]) == 0
    assert (root / "README.md").read_text() != (ROOT / "README.md").read_text()


def test_the_newest_record_of_a_method_wins_and_the_others_keep_theirs(tmp_path):
    """A later run of one method replaces that method's figures alone; the table names both files."""
    root, results = _copy(tmp_path)
    for path in results.glob("*.json"):
        path.unlink()
    settings = {"tier": "cpu", "fitting": tables.DEFAULT_FITTING, "learn_changed": {}}

    def record(date, barriers):
        pairs = [
            {"family": "gpt2", "name": name, "varies": "", "barriers": values, "seconds": {}}
            for name, values in barriers.items()
        ]
        return {
            "benchmark": "suite",
            "date": date,
            "commit": "abc",
            "machine": "m",
            "settings": settings,
            "pairs": pairs,
        }

    older = record(
        "2026-01-01T00:00:00+00:00", {"p": {"vanilla": 2.0, "dual": 0.4}, "q": {"vanilla": 1.0, "dual": 0.2}}
    )
    newer = record("2026-02-01T00:00:00+00:00", {"p": {"dual": 0.1}, "q": {"dual": 0.3}})
    (results / "suite-a.json").write_text(json.dumps(older))
    (results / "suite-b.json").write_text(json.dumps(newer))
    table = tables.readme_table(tables.merged(tables.load(results)), root)
    assert "| average | 1.500 ± 0.707 | 2.000 | 1.00 |" in table
    assert "| dual | 0.200 ± 0.141 | 0.300 | 0.17 (0.30) |" in table
    assert "suite-a.json" in table and "suite-b.json" in table


def test_a_strong_scaling_run_is_read_against_its_own_rounds_one_process_step(tmp_path):
    """With ``--rounds`` a machine that slows between rounds slows both of a round's runs: each
    run's ratio is taken within its round, and the cell gives the rounds' median and range."""

    def row(mode, processes, step, round_):
        return {
            "shape": "wide",
            "mode": mode,
            "processes": processes,
            "tree": "this",
            "step_s": step,
            "build_s": step / 2,
            "gathers_s": 0.0,
            "round": round_,
        }

    record = {
        "benchmark": "strong_scaling",
        "date": "2026-01-01T00:00:00+00:00",
        "commit": "abc",
        "machine": "m",
        "settings": {},
        "rows": [row("one", 1, 4.0, 0), row("paired", 2, 2.0, 0), row("one", 1, 8.0, 1), row("paired", 2, 4.8, 1)],
    }
    path = tmp_path / "strong_scaling-a.json"
    path.write_text(json.dumps(record))
    section = "\n".join(tables.scaling_section([(path, record)], tmp_path))
    assert "| wide | 2: paired | 3.400 | 0.55× (0.50–0.60) | 50% | 0% |" in section
    assert "| wide | 1: one | 6.000 | 1.00× (1.00–1.00) |" in section
