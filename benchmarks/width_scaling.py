"""Barriers against width: the `cpu` tier's two-layer pairs at several widths, nothing else changed.

Issue 37 asks the defaults for a learned barrier of 0.02 nats at the `cpu` tier's median. Theus
et al. report 0.02 ± 0.00 for learned matching on their GPT-2 of width 256 trained 100 epochs
(Table 1); the `cpu` tier's pairs are 64 to 128 wide. Barriers after alignment are known to fall
with width for permutation matching; this script measures how the barrier of every method at
its defaults moves with width here, so that the tier's figures can be read against the paper's.

Each family's pair is the `cpu` tier's two-layer pair (``suite-gpt2-a``: 4 heads, tied, up to
2500 steps; ``suite-llama-a``: GQA 2:1, up to 1500 steps) with its width (and the MLP with it)
set to each of ``--widths``; heads, depth, data, training rule and the fitting and evaluation
data are the suite's. The width the tier uses is its own cached pair.

    python -m benchmarks.width_scaling                                  # gpt2 and llama, widths 64 128 256
    python -m benchmarks.width_scaling --families gpt2 --widths 64 128 256 512 --methods vanilla weight learned
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hf_lmc.options import LearnOptions

from . import suite

BASES = {"gpt2": "suite-gpt2-a", "llama": "suite-llama-a"}
WIDTH_KEY = {"gpt2": "n_embd", "llama": "hidden_size"}


def pair_at(family: str, width: int) -> suite.SuitePair:
    """The tier's two-layer pair of ``family`` with its width set to ``width`` (LLaMA's MLP at its
    8/3 rule; GPT-2's MLP is four times the width by default)."""
    base = suite.pair_named(BASES[family])
    if base.entry.config[WIDTH_KEY[family]] == width:
        return base
    config = dict(base.entry.config) | {WIDTH_KEY[family]: width}
    if family == "llama":
        config["intermediate_size"] = suite.llama_intermediate_size(width)
    entry = suite.zoo.ZooEntry(
        f"width-{family}-{width}",
        base.entry.model_type,
        config,
        steps=base.entry.steps,
        patience=base.entry.patience,
    )
    return suite.SuitePair(family, entry, f"{base.varies}; width {width}")


@dataclass
class WidthResult:
    """What the suite measured on one family's pair at one width."""

    width: int
    pair: suite.PairResult

    def record(self) -> dict:
        """The JSON record: the suite's, with the width."""
        return {"width": self.width, **self.pair.__dict__}

    @classmethod
    def from_record(cls, record: dict) -> WidthResult:
        fields = dict(record)
        return cls(fields.pop("width"), suite.PairResult(**fields))


def rows(results: Sequence[WidthResult], labels: Sequence[str]) -> list[str]:
    """One row per pair: the members' validation losses and every method's barrier (ratio to vanilla)."""
    out = [
        "| family | width | members: validation loss | " + " | ".join(labels) + " |",
        "|---|---|---|" + "---|" * len(labels),
    ]
    for width, r in sorted(
        ((w.width, w.pair) for w in results), key=lambda item: (list(BASES).index(item[1].family), item[0])
    ):
        losses = " / ".join(f"{m['validation_loss']:.3f}" for m in r.members if "validation_loss" in m)
        vanilla = r.barriers.get("vanilla")
        cells = []
        for label in labels:
            value = r.barriers.get(label)
            ratio = f" ({value / vanilla:.2f}×)" if value is not None and vanilla and label != "vanilla" else ""
            cells.append("—" if value is None else f"{value:.3f}{ratio}")
        out.append(f"| {r.family} | {width} | {losses} | " + " | ".join(cells) + " |")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=list(BASES), default=list(BASES))
    parser.add_argument("--widths", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--methods", nargs="+", choices=suite.LABELS, default=["vanilla", "weight", "learned"])
    parser.add_argument("--cache", type=Path, default=None, help="zoo cache folder (default: the zoo's)")
    parser.add_argument(
        "--json", type=Path, default=None, help="also write every number to this JSON file (rewritten after each pair)"
    )
    parser.add_argument(
        "--report",
        nargs="+",
        type=Path,
        default=None,
        metavar="JSON",
        help="print the table of results saved with --json",
    )
    args = parser.parse_args(argv)
    if args.report:
        results = [WidthResult.from_record(record) for path in args.report for record in json.loads(path.read_text())]
    else:
        results = []
        for family in args.families:
            for width in args.widths:
                result = suite.measure_pair(
                    pair_at(family, width), args.methods, cache=args.cache, progress=False, learn=LearnOptions()
                )
                results.append(WidthResult(width, result))
                print(f"{family} width {width}: {json.dumps(result.barriers)}", file=sys.stderr)
                if args.json:
                    args.json.write_text(json.dumps([r.record() for r in results], indent=2))
    print("\n".join(rows(results, [label for label in suite.LABELS if any(label in r.pair.barriers for r in results)])))


if __name__ == "__main__":
    main()
