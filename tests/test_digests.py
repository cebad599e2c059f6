"""The records say which code made a figure (``benchmarks/tables.py``): a suite figure counts as
today's while the merges behind it give the newest recorded digests. That holds only if a change
to what a method merges cannot land without a record of its new digests; this test is the
guard, on the kind of machine the newest digests were made on (digests are one machine's
arithmetic, so elsewhere it skips)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import merge_digests, record, tables


def _reference() -> tuple[dict, dict]:
    """The newest digest of every run made on this machine's kind, and the machine of the newest
    record that gave one."""
    here = {"machine": record.machine()}
    newest: dict[str, str] = {}
    made_on: dict = {}
    for _, saved in tables.load():
        if isinstance(saved.get("digests"), dict) and tables._machine_kind(saved) == tables._machine_kind(here):
            newest.update(saved["digests"])
            made_on = saved["machine"]
    return newest, made_on


@pytest.mark.slow
def test_the_newest_recorded_digests_are_the_trees(tmp_path):
    newest, made_on = _reference()
    here = record.machine()
    same = made_on and all(made_on.get(k) == here[k] for k in ("cpu", "cpu_flags", "cores", "torch"))
    if not same:
        pytest.skip("the newest digests were made on another kind of machine")
    threads = torch.get_num_threads()
    torch.set_num_threads(here["cores"])  # as the record's process ran: torch's default, one per core
    try:
        found = merge_digests.digests(tmp_path, sorted(newest))
    finally:
        torch.set_num_threads(threads)
    changed = sorted(name for name in found if found[name] != newest[name])
    assert not changed, (
        f"merges changed ({', '.join(changed)}): run python -m benchmarks.merge_digests and commit its record"
    )


def test_the_suite_rows_map_onto_digest_runs():
    names = {name for name, _ in merge_digests.RUNS}
    for runs in (*merge_digests.SUITE_RUNS.values(), *tables.TRIPLE_RUNS.values()):
        assert runs and set(runs) <= names
