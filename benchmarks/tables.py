"""The tables a user reads, built from the records under ``benchmarks/results/``.

Two places show results: the README's results table (between its ``results-table`` markers) and
``docs/results.md``, "what each method reaches today, per tier and family, and what it costs".
Both are generated here from the records the living benchmarks write (``benchmarks/record.py``),
so every number names the run that measured it: its file, date, commit and machine, and, for a
record copied from the archived notebook rather than run, the section it was transcribed from.

For the suite the newest record wins per tier, settings and method: a later run of one method
replaces that method's row and leaves the others to the runs that measured them. For the cost
benchmarks the newest record wins per benchmark and settings.

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

from .record import RESULTS
from .strong_scaling import MODES

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


def load(folder: Path = RESULTS) -> list[tuple[Path, dict]]:
    """Every record under ``folder``, oldest first."""
    records = [(path, json.loads(path.read_text())) for path in sorted(folder.glob("*.json"))]
    return sorted(records, key=lambda item: (_date(item[1]), item[0].name))


def _date(record: dict) -> datetime.datetime:
    return datetime.datetime.fromisoformat(record["date"])


def variant(settings: dict) -> tuple:
    """What a suite record's numbers depend on besides the method: tier, training cap,
    vocabulary, fitting data, the learned-matching settings changed from the defaults, and the
    families or pairs when a run measured only some of the tier's."""
    fitting = settings.get("fitting", DEFAULT_FITTING)
    families = settings.get("families")
    some = None if families is None or set(families) >= set(FAMILY_ORDER) else tuple(sorted(families))
    return (
        settings["tier"],
        settings.get("max_steps"),
        settings.get("vocab_size"),
        json.dumps(fitting, sort_keys=True),
        json.dumps(settings.get("learn_changed", {}), sort_keys=True),
        some,
        tuple(settings["pairs"]) if settings.get("pairs") else None,
    )


def describe(key: tuple) -> str:
    """A variant's heading: what differs from a plain run of its tier."""
    tier, max_steps, vocab_size, fitting, learn, families, pairs = key
    fitting, learn = json.loads(fitting), json.loads(learn)
    parts = [f"pairs {', '.join(pairs)}"] if pairs else []
    parts += [f"families {', '.join(f for f in FAMILY_ORDER if f in families)}"] if families else []
    parts += [f"members trained at most {max_steps} steps"] if max_steps else []
    parts += [f"a byte-level BPE of {vocab_size} tokens"] if vocab_size else []
    parts += ["fitting data sampled from the members (`--data sampled`)"] if fitting.get("sampled") else []
    parts += [f"{fitting['sequences']} fitting sequences"] if fitting.get("sequences") != 8192 else []
    parts += [f"fitting batches of {fitting['batch_size']}"] if fitting.get("batch_size") != 32 else []
    parts += [f"learn {learn}"] if learn else []
    return f"`{tier}` tier" + (": " + ", ".join(parts) if parts else ", the defaults")


def anchor(key: tuple, kind: str = "suite") -> str:
    """A variant's link target in docs/results.md, stable while its settings are: the tier and a
    tag per setting that differs (``suite-cpu``, ``suite-cpu-sampled``, ``triples-cpu``)."""
    tier, max_steps, vocab_size, fitting, learn, families, pairs = key
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
    tags += ["some-families"] if families else []
    tags += ["some-pairs"] if pairs else []
    return "-".join([kind, tier, *tags])


def is_plain(key: tuple) -> bool:
    """A variant at the defaults a user gets (a training cap aside: the paper tier runs capped on a CPU)."""
    _, _, vocab_size, fitting, learn, families, pairs = key
    plain_data = vocab_size is None and json.loads(fitting) == DEFAULT_FITTING and json.loads(learn) == {}
    return plain_data and families is None and pairs is None


def merged(records: Sequence[tuple[Path, dict]], field: str = "pairs") -> dict[tuple, dict]:
    """Per variant: per method the newest record that measured it, and each pair's barriers
    (``pairs``) or triples' excesses (``triples``) taken method by method from those records."""
    variants: dict[tuple, dict] = {}
    for path, record in records:  # oldest first: a later record replaces a method's figures
        key = variant(record["settings"])
        entry = variants.setdefault(key, {"sources": {}, "items": {}, "summaries": {}})
        methods = {label for item in record[field] for label in item["barriers"]} | set(record.get("summaries", {}))
        for label in methods:
            entry["sources"][label] = (path, record)
            entry["summaries"].pop(label, None)
            if label in record.get("summaries", {}):
                entry["summaries"][label] = record["summaries"][label]
            for item in entry["items"].values():  # a method's figures come from one record alone
                for values in (item["barriers"], item.get("mean_excess", {}), item["seconds"], item["runs"]):
                    values.pop(label, None)
        for item in record[field]:
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
            for label in item["barriers"]:
                kept["barriers"][label] = item["barriers"][label]
                if field == "triples":
                    kept["mean_excess"][label] = item["mean_excess"][label]
                if label in item.get("seconds", {}):
                    kept["seconds"][label] = item["seconds"][label]
                if label in item.get("runs", {}):  # a trained method's run: how it stopped, time to its final barrier
                    kept["runs"][label] = item["runs"][label]
    return variants


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


def source_note(sources: dict[str, tuple[Path, dict]], root: Path) -> str:
    """Which files a table's rows come from, with each run's date, commit and machine."""
    lines = []
    by_file: dict[Path, list[str]] = {}
    for label, (path, _) in sources.items():
        by_file.setdefault(path, []).append(label)
    for path, labels in sorted(by_file.items(), key=lambda item: item[0].name):
        record = sources[labels[0]][1]
        shown = [SHOWN.get(label, label) for label in (_order(labels) or labels)]
        lines.append(f"- {', '.join(shown)}: {_provenance(path, record, root)}")
    return "Source:\n\n" + "\n".join(lines)


def _provenance(path: Path, record: dict, root: Path) -> str:
    machine = record["machine"]
    if isinstance(machine, dict):
        machine = f"{machine.get('cores', '?')} cores ({machine.get('cpu', 'unknown processor')})" + (
            f", {machine['gpu']}" if machine.get("gpu") else ""
        )
    try:
        shown = path.resolve().relative_to(root.resolve())
    except ValueError:
        shown = Path("benchmarks/results") / path.name
    how = f"transcribed from {record['transcribed_from']}" if record.get("transcribed_from") else "run"
    return f"`{shown.as_posix()}` ({how}; {record['date'][:10]}, commit {record.get('commit') or 'not recorded'}, {machine})"


def readme_table(variants: dict[tuple, dict], root: Path) -> str:
    """The README's table: the `cpu` tier at the defaults, over all its pairs."""
    key = next((key for key in variants if key[0] == "cpu" and is_plain(key)), None)
    if key is None:
        return "No `cpu`-tier record at the defaults under `benchmarks/results/`."
    entry = variants[key]
    items = list(entry["items"].values())
    rows = ["| method | barrier, mean ± std | worst pair | ratio to average, mean (worst) |", "|---|---|---|---|"]
    for label in _order(entry["sources"]):
        summary = summary_of(entry, items, label)
        rows.append(f"| {SHOWN.get(label, label)} | {summary['spread']} | {summary['worst']} | {summary['ratio']} |")
    sources = "; ".join(_provenance(path, record, root) for path, record in _unique(entry["sources"].values()))
    return "\n".join(rows) + f"\n\n{len(items)} pairs{_summarised(entry)}. Source: {sources}."


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


def suite_section(key: tuple, entry: dict, root: Path) -> list[str]:
    """One variant of the suite: per family (and the language pairs, and all) every method's
    summary, then every pair's barriers."""
    items = _family_order(list(entry["items"].values()))
    labels = _order(entry["sources"])
    families = [family for family in FAMILY_ORDER if any(item["family"] == family for item in items)]
    groups = [(family, [item for item in items if item["family"] == family]) for family in families]
    if len(set(families) & set(LANGUAGE)) > 1 and "vit" in families:
        groups.append(("language", [item for item in items if item["family"] in LANGUAGE]))
    if len(families) > 1:
        groups.append(("all", items))
    out = [
        f'<a id="{anchor(key)}"></a>',
        "",
        f"### {describe(key)}",
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
    return [*out, *(["", f"— : not recorded{note}."] if note else []), "", source_note(entry["sources"], root), ""]


def triples_section(key: tuple, entry: dict, root: Path) -> list[str]:
    """One variant of the suite's triples: per method the excess at the worst grid point and its
    mean over the grid, each as mean ± std over the triples with the worst triple."""
    items = _family_order(list(entry["items"].values()))
    labels = _order(entry["sources"])
    out = [
        f'<a id="{anchor(key, "triples")}"></a>',
        "",
        f"### Triples, {describe(key)}",
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


def results_page(records: Sequence[tuple[Path, dict]], root: Path) -> str:
    """docs/results.md."""
    pairs = merged([(p, r) for p, r in records if r["benchmark"] == "suite"])
    triples = merged([(p, r) for p, r in records if r["benchmark"] == "suite_triples"], "triples")

    def ordered(variants):
        return sorted(variants, key=lambda key: (TIER_ORDER.index(key[0]), not is_plain(key), describe(key)))

    out = [
        "# Results",
        "",
        "<!-- Generated by `python -m benchmarks.tables` from benchmarks/results/*.json; do not edit by hand. -->",
        "",
        "What each method reaches today, per tier and family, and what it costs. Every table is built",
        "from the records under [`benchmarks/results/`](../benchmarks/results/) and names them; a",
        "record marked *transcribed* was copied from the archived notebook, not run again. Barriers are",
        "in nats on held-out data (lower is better): the largest excess of the merged model's loss over",
        "the line between the endpoints' on the 11-point α grid. The pairs and tiers are described in",
        "[`benchmarks/suite.py`](../benchmarks/suite.py); why each default is what it is, in",
        "[decisions.md](decisions.md). *learned (perm.)* is the row of records made before",
        "permutation-only learned matching existed (weight matching's start restricted to permutations,",
        "every group then trained); *learned (perm. only)* trains the permutations alone, Theus et al.'s",
        "row ([D-permutation-only](decisions.md#d-permutation-only)).",
        "",
        "## The benchmark suite",
        "",
    ]
    for key in ordered(pairs):
        out += suite_section(key, pairs[key], root)
    if triples:
        out += ["## Three models: the simplex of a triple", ""]
        for key in ordered(triples):
            out += triples_section(key, triples[key], root)
    adapters = adapter_sections(records, root)
    if adapters:
        out += ["## Adapters carried across", "", *adapters]
    costs = cost_sections(records, root)
    if costs:
        out += ["## What it costs", "", *costs]
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
    table = readme_table(merged([(p, r) for p, r in records if r["benchmark"] == "suite"]), root)
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
