"""The records say which code made a figure (``benchmarks/tables.py``): a suite figure counts as
today's while the merges behind it give the newest recorded digests. That holds only if a change
to what a method merges cannot land without a record of its new digests; this test is the
guard, against the newest digests recorded on a machine like this one (same processor, flags,
cores and torch: digests are one machine's arithmetic, so elsewhere it skips)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import merge_digests, record, tables

ROOT = Path(__file__).parent.parent

#: What two machines must share for their digests to compare (benchmarks/record.py's machine()).
SAME = ("cpu", "cpu_flags", "cores", "torch")


def _reference(here: dict) -> dict[str, str]:
    """The newest digest of every run among the records made on a machine like ``here``."""
    newest: dict[str, str] = {}
    for _, saved in tables.load():
        machine = saved.get("machine")
        like = isinstance(machine, dict) and all(machine.get(key) == here[key] for key in SAME)
        if like and isinstance(saved.get("digests"), dict):
            newest.update(saved["digests"])
    return newest


@pytest.mark.slow
def test_the_newest_recorded_digests_are_the_trees(tmp_path):
    here = record.machine()
    newest = _reference(here)
    if not newest:
        pytest.skip("no digests were recorded on a machine like this one")
    made = tmp_path / "digests.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # A fresh process, as the record's was: no state other tests leave behind (threads, dtypes).
    subprocess.run(
        [sys.executable, "-m", "benchmarks.merge_digests", "--json", str(made)], cwd=ROOT, env=env, check=True
    )
    found = {name: value for name, value in json.loads(made.read_text())["digests"].items() if name in newest}
    changed = sorted(name for name in found if found[name] != newest[name])
    assert not changed, (
        f"merges changed ({', '.join(changed)}): run python -m benchmarks.merge_digests and commit its record"
    )


def test_the_suite_rows_map_onto_digest_runs():
    names = {name for name, _ in merge_digests.RUNS}
    for runs in (*merge_digests.SUITE_RUNS.values(), *tables.TRIPLE_RUNS.values()):
        assert runs and set(runs) <= names
