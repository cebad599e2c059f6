"""The tables a user reads are the records' tables: the README's results table and docs/results.md
are what ``python -m benchmarks.tables`` builds from ``benchmarks/results/``, and a changed
record makes them out of date."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from benchmarks import tables
from hf_lmc.config.options import LearnOptions
from hf_lmc.io import zoo

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
    assert (root / "docs" / "results.md").read_text() != (ROOT / "docs" / "results.md").read_text()


MACHINE = {"cpu": "cpu-x", "torch": "2.13.0"}
DIGESTS = {"average": "a1", "weight": "w1", "dual": "d1", "dual-target": "t1"}


def _suite_record(date, barriers, *, digests=DIGESTS, commit="abc", machine=MACHINE, **settings):
    return {
        "benchmark": "suite",
        "date": date,
        "commit": commit,
        "machine": machine,
        "settings": {"tier": "cpu", "fitting": tables.DEFAULT_FITTING, "learn_changed": {}} | settings,
        "pairs": [
            {"family": "gpt2", "name": name, "varies": "", "barriers": values, "seconds": {}}
            for name, values in barriers.items()
        ],
    } | ({"digests": digests} if digests is not None else {})


def _readme(results: Path, root: Path, *records: dict) -> str:
    for path in results.glob("*.json"):
        path.unlink()
    for i, record in enumerate(records):
        (results / f"suite-{i}.json").write_text(json.dumps(record))
    return tables.readme_table(tables.merged(tables.load(results)), root)


def test_runs_of_one_pair_at_a_time_combine_pair_by_pair_and_the_newest_wins(tmp_path):
    """Runs of some pairs of a tier, at one code, make one table: per pair and method the newest
    run's figure; the table says over how many pairs and names every file it used."""
    root, results = _copy(tmp_path)
    first = _suite_record("2026-01-01T00:00:00+00:00", {"p": {"vanilla": 2.0, "dual": 0.4}}, pairs=["p"])
    second = _suite_record("2026-01-02T00:00:00+00:00", {"q": {"vanilla": 1.0, "dual": 0.2}}, pairs=["q"])
    rerun = _suite_record("2026-01-03T00:00:00+00:00", {"p": {"dual": 0.1}}, pairs=["p"])
    table = _readme(results, root, first, second, rerun)
    assert "| average | 2 | 1.500 ± 0.707 | 2.000 | 1.00 |" in table
    assert "| dual | 2 | 0.150 ± 0.071 | 0.200 | 0.12 (0.20) |" in table
    assert "suite-0.json" not in table  # the README links the page; the page names the files
    page = tables.results_page(tables.load(results), root)
    current = page.split("## Stale")[0]
    assert "suite-0.json" in current and "suite-1.json" in current and "suite-2.json" in current


def test_a_figure_whose_code_changed_is_stale_and_never_averaged_in(tmp_path):
    """A later run whose merges give other digests makes today's code; an earlier figure of
    a changed method goes to the stale section, one of an unchanged method still counts."""
    root, results = _copy(tmp_path)
    old = _suite_record("2026-01-01T00:00:00+00:00", {"p": {"vanilla": 2.0, "dual": 0.4}}, pairs=["p"])
    changed = _suite_record(
        "2026-01-02T00:00:00+00:00",
        {"q": {"vanilla": 1.0, "dual": 0.2}},
        pairs=["q"],
        digests=DIGESTS | {"dual-target": "t2"},
    )
    table = _readme(results, root, old, changed)
    assert "| average | 2 | 1.500 ± 0.707 |" in table  # vanilla's digests are unchanged: both pairs
    assert "| dual | 1 | 0.200 ± 0.000 | 0.200 |" in table  # p's dual was made by other code
    page = tables.results_page(tables.load(results), root)
    stale = page.split("## Stale figures")[1]
    assert "| p |" in stale and "0.400" in stale and "0.400" not in page.split("## Stale figures")[0]


def test_digests_on_another_machine_leave_this_machines_figures_alone(tmp_path):
    """Digests are one machine's arithmetic: a run elsewhere neither stales nor is staled by them."""
    root, results = _copy(tmp_path)
    here = _suite_record("2026-01-01T00:00:00+00:00", {"p": {"vanilla": 2.0}}, pairs=["p"])
    there = _suite_record(
        "2026-01-02T00:00:00+00:00",
        {"q": {"vanilla": 1.0}},
        pairs=["q"],
        machine={"cpu": "cpu-y", "torch": "2.13.0"},
        digests={"average": "other"},
    )
    assert "| average | 2 | 1.500 ± 0.707 |" in _readme(results, root, here, there)


def test_a_record_without_digests_counts_through_a_digest_record_at_its_commit(tmp_path):
    """A record made at a clean commit where ``merge_digests`` ran on the same kind of machine has
    that record's digests; at a commit with none, or a dirty one, it cannot say and is stale."""
    root, results = _copy(tmp_path)
    digests = {
        "benchmark": "merge_digests",
        "date": "2026-01-01T00:00:00+00:00",
        "commit": "abc",
        "machine": MACHINE,
        "settings": {},
        "digests": DIGESTS,
    }
    (results / "merge_digests-0.json").write_text(json.dumps(digests))
    bare = _suite_record("2026-01-02T00:00:00+00:00", {"p": {"vanilla": 2.0}}, digests=None)
    dirty = _suite_record("2026-01-02T00:00:00+00:00", {"q": {"vanilla": 1.0}}, digests=None, commit="abc+")
    for path in results.glob("suite-*.json"):
        path.unlink()
    (results / "suite-0.json").write_text(json.dumps(bare))
    (results / "suite-1.json").write_text(json.dumps(dirty))
    table = tables.readme_table(tables.merged(tables.load(results)), root)
    assert "| average | 1 | 2.000 ± 0.000 |" in table


def test_transcribed_figures_are_archived_and_never_in_the_readme(tmp_path):
    root, results = _copy(tmp_path)
    copied = _suite_record("2026-01-01T00:00:00+00:00", {"p": {"vanilla": 2.0}}, digests=None) | {
        "transcribed_from": "notebook §1"
    }
    assert "No `cpu`-tier figure" in _readme(results, root, copied)
    page = tables.results_page(tables.load(results), root)
    assert "2.000" in page.split("\n## Archive")[1] and "2.000" not in page.split("\n## Archive")[0]


def test_a_default_changed_since_a_run_makes_it_a_variant(tmp_path):
    """A record spells out every learned-matching setting; one made when a default differed
    from today's is a variant, never the README's row."""
    root, results = _copy(tmp_path)
    today = LearnOptions().model_dump(mode="json")
    then = _suite_record(
        "2026-01-01T00:00:00+00:00", {"p": {"vanilla": 2.0, "dual": 0.4}}, learn=today | {"steps": today["steps"] + 1}
    )
    now = _suite_record("2026-01-02T00:00:00+00:00", {"q": {"vanilla": 1.0, "dual": 0.2}}, learn=today)
    table = _readme(results, root, then, now)
    assert "| dual | 1 | 0.200 ± 0.000 |" in table
    page = tables.results_page(tables.load(results), root)
    assert f"learn {{'steps': {today['steps'] + 1}}}" in page


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


def test_the_paper_tier_stands_beside_the_papers_figures_with_its_goals(tmp_path):
    """The paper tier's table states its budget, shows Theus et al.'s figure beside each row and
    says whether each goal is met, a miss included."""
    root, results = _copy(tmp_path)
    pairs = {
        "paper-gpt2": {"vanilla": 2.0, "weight": 0.5, "dual": 0.01},
        "paper-gpt2-2": {"vanilla": 2.0, "weight": 0.3, "dual": 0.02},
    }
    record = _suite_record("2026-01-01T00:00:00+00:00", pairs, tier="paper", max_steps=1500)
    _readme(results, root, record)
    page = tables.results_page(tables.load(results), root)
    rows = {line.split(" | ")[1]: line for line in page.splitlines() if line.startswith("| gpt2 (")}
    assert "0.34 ± 0.01" in rows["weight"] and "missed (0.20×)" in rows["weight"]
    assert "met (0.015)" in rows["dual"] and "(2)" in rows["dual"]
    assert "1500 of the paper's 20000 steps" in page


def _explained(pair: str, method: str, max_steps: int | None, qk: float) -> dict:
    return {
        "benchmark": "explain_pair",
        "date": "2026-01-02T00:00:00+00:00",
        "commit": "def",
        "machine": MACHINE,
        "settings": {"pair": pair, "method": method, "orders": 2, "max_steps": max_steps},
        "pair": pair,
        "orders": [["QK", "MLP"], ["MLP", "QK"]],
        "excess": {"average": 1.5, method: qk + 0.1},
        "by_kind": {"average": {"QK": 1.0, "MLP": 0.5}, method: {"QK": qk, "MLP": 0.1}},
    }


def test_a_missed_paper_goal_is_explained_on_its_worst_pair_at_the_same_cap(tmp_path):
    """Under a missed goal the page reads the worst pair's explain record made at the tier's
    training cap; with none at that cap, it gives the command that makes one."""
    root, results = _copy(tmp_path)
    pairs = {
        "paper-gpt2-a": {"vanilla": 2.0, "weight": 0.5, "dual": 0.01},  # the worst weight ratio
        "paper-gpt2-b": {"vanilla": 2.0, "weight": 0.3, "dual": 0.02},
    }
    record = _suite_record("2026-01-01T00:00:00+00:00", pairs, tier="paper", max_steps=1500)
    command = "explain_pair --pair paper-gpt2-a --method weight --max-steps 1500"
    _readme(results, root, record, _explained("paper-gpt2-a", "weight", None, 0.7))  # another cap: not it
    page = tables.results_page(tables.load(results), root)
    assert command in page and "QK +0.700" not in page
    assert "--method dual" not in page  # a met goal asks for nothing
    _readme(results, root, record, _explained("paper-gpt2-a", "weight", 1500, 0.3))
    page = tables.results_page(tables.load(results), root)
    assert command not in page and "QK +0.300, MLP +0.100" in page


def test_the_cpu_tier_reads_its_regression_guard_and_marks_a_miss(tmp_path):
    """The cpu tier's defaults say whether each bound of the regression guard holds, with the
    pair that sets it; a bound crossed is marked missed."""
    root, results = _copy(tmp_path)
    pairs = {
        "suite-gpt2-a": {"vanilla": 2.0, "weight": 0.5, "dual": 0.04},
        "suite-gpt2-b": {"vanilla": 1.0, "weight": 0.5, "dual": 0.14},
        "suite-gpt2-c": {"vanilla": 2.0, "weight": 0.5, "dual": 0.02},
    }
    record = _suite_record("2026-01-01T00:00:00+00:00", pairs)
    record["pairs"][2]["family"] = "llama"
    explained = {
        "benchmark": "explain_pair",
        "date": "2026-01-02T00:00:00+00:00",
        "commit": "def",
        "machine": MACHINE,
        "settings": {"pair": "suite-gpt2-b", "method": "dual", "orders": 2},
        "pair": "suite-gpt2-b",
        "orders": [["QK", "MLP"], ["MLP", "QK"]],
        "excess": {"average": 1.5, "dual": 0.12},
        "by_kind": {"average": {"QK": 1.0, "MLP": 0.5}, "dual": {"QK": 0.2, "MLP": -0.08, "embeddings": 0.0}},
        "parts": {"dual": {"patch embeddings": 0.01, "position embeddings": -0.01, "layer 0 QK": 0.2}},
    }
    _readme(results, root, record, explained)
    page = tables.results_page(tables.load(results), root)
    rows = {
        line.split(" | ")[0].removeprefix("| "): line
        for line in page.splitlines()
        if line.startswith(("| dual matching", "| weight matching"))
    }
    # the pair that misses is read group by group where an explain record has it
    assert "Where suite-gpt2-b's excess sits" in page and "QK +0.200, embeddings +0.000, MLP -0.080" in page
    assert "(embeddings: patch +0.010, position -0.010)" in page  # each input the embeddings add
    assert "layer 0 QK +0.200" in page  # the largest single group
    assert rows["dual matching, median pair"].endswith("| 0.040 | met |")
    assert rows["dual matching, worst pair"].endswith("| 0.140 (suite-gpt2-b) | **missed** |")
    assert rows["dual matching ÷ the average, every pair"].endswith("| 0.14× (suite-gpt2-b) | **missed** |")
    assert rows["weight matching ÷ the average, RoPE families, worst"].endswith("| 0.25× (suite-gpt2-c) | met |")


def test_the_paper_tier_names_the_data_its_pairs_were_trained_on(tmp_path):
    """Each row names what its pairs read: the data a record's pair names, or for a record made
    before pairs named it, what the zoo's entries read then (characters; unshifted digits)."""
    root, results = _copy(tmp_path)
    record = _suite_record("2026-01-01T00:00:00+00:00", {"paper-vit-a": {"vanilla": 1.0}}, tier="paper")
    record["pairs"][0] |= {"family": "vit", "data": "MNIST, shifted up to 2 px"}
    older = _suite_record("2026-01-01T00:00:00+00:00", {"paper-gpt2-a": {"vanilla": 2.0}}, tier="paper")
    _readme(results, root, record, older)
    rows = [line for line in tables.results_page(tables.load(results), root).splitlines() if line.startswith("| ")]
    assert any(row.startswith("| vit (MNIST, shifted up to 2 px; paper: CIFAR-10) | average") for row in rows)
    assert any(row.startswith("| gpt2 (Shakespeare's plays, by character; paper: Tiny Shakespeare)") for row in rows)
    plain = {"gpt2": zoo.ZOO["gpt2"], "vit": zoo.ZooEntry("v", "vit", {}, data="mnist")}
    assert tables.UNNAMED_DATA == {family: zoo.data_text(entry) for family, entry in plain.items()}


def test_a_resumed_run_counts_another_machines_figures_where_this_machine_vouches_for_their_commit(tmp_path):
    """Digests are one kind of machine's arithmetic: a figure made on another kind counts as
    today's for ``--resume`` only where a record made on this kind at the figure's commit gives
    today's digests; without one, or at a commit whose digests differ, it is measured again."""
    other = {"cpu": "cpu-y", "torch": "2.13.0"}
    theirs = _suite_record(
        "2026-01-01T00:00:00+00:00", {"p": {"vanilla": 2.0, "dual": 0.1}}, digests={"average": "y", "dual": "y"}
    ) | {"machine": other}
    settings = theirs["settings"]
    today = {"average": "a1", "dual": "d1", "dual-target": "t1"}
    records = [(tmp_path / "theirs.json", theirs)]
    assert tables.measured_today(records, settings, today, MACHINE) == set()  # nothing vouches for commit abc here
    vouch = {"benchmark": "merge_digests", "date": "2026-01-02T00:00:00+00:00", "commit": "abc", "machine": MACHINE}
    records.append((tmp_path / "vouch.json", vouch | {"digests": today}))
    assert tables.measured_today(records, settings, today, MACHINE) == {("p", "vanilla"), ("p", "dual")}
    records[-1] = (tmp_path / "vouch.json", vouch | {"digests": {**today, "dual": "d0"}})  # abc merged otherwise
    assert tables.measured_today(records, settings, today, MACHINE) == {("p", "vanilla")}
    assert tables.measured_today(records, settings, {"average": "y"}, other) == {("p", "vanilla")}  # its own kind


def test_a_partly_measured_tier_says_what_a_pair_costs_and_what_the_whole_tier_would(tmp_path):
    """Measuring and training time per pair, as recorded, and the whole tier at that pace."""
    root, results = _copy(tmp_path)
    record = _suite_record("2026-01-01T00:00:00+00:00", {"suite-gpt2-b": {"vanilla": 2.0, "dual": 0.1}})
    record["pairs"][0] |= {"seconds": {"vanilla": 60.0, "dual": 540.0}, "members": [{"seconds": 120}, {"seconds": 180}]}
    _readme(results, root, record)
    page = tables.results_page(tables.load(results), root)
    (line,) = [line for line in page.splitlines() if line.startswith("1 of the tier's 12 pairs")]
    assert "10 min per pair" in line and "members 5 min" in line and "about 3.0 h" in line


def test_each_tier_says_how_long_it_takes_and_how_to_time_it_on_a_gpu(tmp_path):
    """The tiers' times come from their records' seconds (members and methods, scaled to the
    whole tier); with no record made on a GPU, the page gives the command that measures one."""
    root, results = _copy(tmp_path)
    cpu = _suite_record("2026-01-01T00:00:00+00:00", {"suite-gpt2-a": {"vanilla": 2.0, "dual": 0.04}})
    cpu["pairs"][0]["seconds"] = {"vanilla": 60.0, "dual": 540.0}  # 10 min a pair, 12 pairs: 2.0 h
    _readme(results, root, cpu)
    page = tables.results_page(tables.load(results), root)
    rows = [line for line in page.splitlines() if line.startswith("| `cpu`")]
    assert rows == ["| `cpu` | 1 of 12 | 10 min | 2.0 h | ? cores (cpu-x) |"]
    assert tables.GPU_TIER_COMMAND in page
    gpu = _suite_record(
        "2026-01-02T00:00:00+00:00",
        {"paper-gpt2-a": {"vanilla": 2.0}},
        machine={"cpu": "cpu-y", "gpu": "NVIDIA H100", "torch": "2.13.0"},
        tier="paper",
    )
    gpu["pairs"][0]["seconds"] = {"vanilla": 30.0}
    _readme(results, root, cpu, gpu)
    page = tables.results_page(tables.load(results), root)
    assert any(line.startswith("| `paper` | 1 of 6 |") and "NVIDIA H100" in line for line in page.splitlines())
    assert tables.GPU_TIER_COMMAND not in page
