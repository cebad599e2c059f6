"""``benchmarks/levers.py``: levers measured side by side with the defaults, pair by pair, each
run a record, resumable, and reported against the defaults on the pairs both have."""

from __future__ import annotations

import json

from benchmarks import levers, merge_digests, suite


def _rows(report: list[str]) -> list[str]:
    """The table rows of a report, without headings and header lines."""
    return [line for line in report if line.startswith("| ") and not line.startswith(("| method", "|---"))]


def _stand_in(measured):
    def measure_pair(pair, labels, *, learn, fitting, **_):
        measured.append((pair.entry.name, learn.steps, tuple(labels)))
        barrier = 0.05 if learn.steps == 1000 else 0.07
        barrier += 0.001 if fitting.batch_size == 16 else 0.0
        return suite.PairResult(
            pair.family,
            pair.entry.name,
            pair.varies,
            dict.fromkeys(labels, barrier),
            dict.fromkeys(labels, 10.0),
            [],
            runs={
                label: {"stopped": "budget", "steps_to_final": learn.steps // 2, "seconds_to_final": learn.steps / 10}
                for label in labels
            },
        )

    return measure_pair


def test_levers_run_beside_the_defaults_resume_and_report(monkeypatch, tmp_path):
    measured = []
    monkeypatch.setattr(suite, "measure_pair", _stand_in(measured))
    monkeypatch.setattr(merge_digests, "digests", lambda scratch, names=None: {n: f"d {n}" for n in names})
    folder, results = tmp_path / "levers", tmp_path / "results"
    results.mkdir()
    argv = [
        "--tier",
        "ci",
        "--pairs",
        "ci-gpt2",
        "ci-vit",
        "--try",
        "steps=250",
        "batch_size=16",
        "--folder",
        str(folder),
    ]
    monkeypatch.setattr(levers, "RESULTS", results)
    levers.main(argv)
    assert [(name, steps) for name, steps, _ in measured] == [
        ("ci-gpt2", 1000),
        ("ci-gpt2", 250),
        ("ci-gpt2", 1000),
        ("ci-vit", 1000),
        ("ci-vit", 250),
        ("ci-vit", 1000),
    ]  # pair by pair, the defaults first: side by side
    saved = [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]
    assert len(saved) == 6 and all(set(one["digests"]) == {"dual", "dual-target"} for one in saved)
    assert sorted(one["settings"]["fitting"]["batch_size"] for one in saved) == [16, 16, 32, 32, 32, 32]
    levers.main(argv)
    assert len(measured) == 6  # recorded at today's code: nothing measured again
    rows = {line.split(" | ")[1]: line.rstrip(" |") for line in _rows(levers.report(folder, results))}
    assert rows["steps=250"].split(" | ")[2:8] == [
        "2",
        "0.0700 (0.0700)",
        "+0.0200 (+0.0200)",
        "125",
        "25",
        "0.25 (0.25)",
    ]
    assert rows["the defaults"].split(" | ")[2:4] == ["2", "0.0500 (0.0500)"]
    assert rows["batch_size=16"].split(" | ")[2:5] == ["2", "0.0510 (0.0510)", "+0.0010 (+0.0010)"]


def test_the_defaults_a_tiers_run_measured_are_not_measured_again(monkeypatch, tmp_path):
    """A suite run of the tier at today's code on this kind of machine has measured the defaults:
    a lever then runs alone beside them."""
    measured = []
    monkeypatch.setattr(suite, "measure_pair", _stand_in(measured))
    monkeypatch.setattr(merge_digests, "digests", lambda scratch, names=None: {n: f"d {n}" for n in names})
    folder, results = tmp_path / "levers", tmp_path / "results"
    monkeypatch.setattr(suite.record, "RESULTS", results)
    monkeypatch.setattr(levers, "RESULTS", results)
    results.mkdir()
    suite.main(["--tier", "ci", "--pairs", "ci-gpt2", "--methods", "dual"])  # the tier's own run, a record per pair
    assert measured == [("ci-gpt2", 1000, ("dual",))]
    levers.main(["--tier", "ci", "--pairs", "ci-gpt2", "--try", "steps=250", "--folder", str(folder)])
    assert measured[1:] == [("ci-gpt2", 250, ("dual",))]


def test_again_measures_the_defaults_beside_a_speed_only_change_and_reports_the_newest(monkeypatch, tmp_path):
    """A change that leaves the merges (their digests) alone keeps its old records current; with
    ``--again`` the defaults are measured anew beside the lever, and the report compares the
    lever with that newest measurement."""
    measured = []
    stand_in = _stand_in(measured)

    def measure_pair(pair, labels, *, learn, fitting, **kwargs):
        result = stand_in(pair, labels, learn=learn, fitting=fitting, **kwargs)
        for run in result.runs.values():
            run["seconds_to_final"] = 10.0 * len(measured)  # later runs slower: the newest is visible
        return result

    monkeypatch.setattr(suite, "measure_pair", measure_pair)
    monkeypatch.setattr(merge_digests, "digests", lambda scratch, names=None: {n: f"d {n}" for n in names})
    folder, results = tmp_path / "levers", tmp_path / "results"
    results.mkdir()
    monkeypatch.setattr(levers, "RESULTS", results)
    base = ["--tier", "ci", "--pairs", "ci-gpt2", "--folder", str(folder)]
    levers.main([*base, "--try", "steps=250"])
    levers.main([*base, "--again", "--try", "steps=250", "target_cache=0"])
    assert [(steps, len(labels)) for _, steps, labels in measured] == [(1000, 1), (250, 1), (1000, 1), (1000, 1)]
    rows = {line.split(" | ")[1]: line.rstrip(" |").split(" | ") for line in _rows(levers.report(folder, results))}
    assert rows["the defaults"][6] == "30"  # the third run's, not the first's
    assert rows["target_cache=0"][6] == "40" and rows["target_cache=0"][7] == "1.33 (1.33)"


def test_a_lever_is_compared_only_with_the_defaults_measured_on_its_kind_of_machine(monkeypatch, tmp_path):
    """Digests and seconds are one kind of machine's: the report makes a table per kind, and a
    lever measured on one kind is not set beside the defaults measured on another."""
    measured = []
    monkeypatch.setattr(suite, "measure_pair", _stand_in(measured))
    monkeypatch.setattr(merge_digests, "digests", lambda scratch, names=None: {n: f"d {n}" for n in names})
    folder, results = tmp_path / "levers", tmp_path / "results"
    results.mkdir()
    monkeypatch.setattr(levers, "RESULTS", results)
    levers.main(["--tier", "ci", "--pairs", "ci-gpt2", "--try", "steps=250", "--folder", str(folder)])
    for path in folder.glob("*steps=250.json"):  # the lever as if measured on another processor
        saved = json.loads(path.read_text())
        saved["machine"] = {**saved["machine"], "cpu": "another processor"}
        path.write_text(json.dumps(saved))
    report = levers.report(folder, results)
    assert sum(line.startswith("On ") for line in report) == 2
    rows = _rows(report)
    assert [row.split(" | ")[1] for row in rows] == ["steps=250", "the defaults"]  # the newest kind first
    assert rows[0].split(" | ")[4] == "—"  # no defaults on its kind: no change to show
