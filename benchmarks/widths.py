"""Barriers between models of two widths vs one width, on the zoo (``hf_lmc.widths``).

For each family with a narrower zoo entry (``zoo.NARROW``: GPT-2 128 -> 96 wide, 4 -> 3
heads, MLP 512 -> 384; ViT 64 -> 48, 4 -> 3 heads, MLP 128 -> 96), three pairs of
independently trained models (different seeds: initialisation and data order):

* ``wide ↔ wide``: seeds 0 and 1 of the wide entry (the equal-width pair of benchmarks/barriers.py);
* ``wide ↔ narrow``: wide seed 1 (A) and narrow seed 0 (B), B embedded exactly into A's shape;
* ``narrow ↔ narrow``: seeds 0 and 1 of the narrow entry.

``average`` is the vanilla baseline: the stored weights for one width, the embedded (zero-padded)
canonical models with no alignment for two. Rows and settings are those of benchmarks/barriers.py
(learned matching: 200 steps, Adam lr 3e-3, from the weight-matching solution).

    python benchmarks/widths.py                          # gpt2 and vit (trains the narrow members on first use)
    python benchmarks/widths.py --families vit --pairs wide mixed --methods average weight
"""

from __future__ import annotations

import argparse

from barriers import HEADER, METHODS, measure, table_rows

from hf_lmc import zoo
from hf_lmc.options import LearnOptions
from hf_lmc.widths import spec_of

PAIRS = ("wide", "mixed", "narrow")


def pairs(family: str) -> dict[str, tuple[str, tuple[str, int], tuple[str, int]]]:
    """``kind -> (label, (entry, seed) of A, (entry, seed) of B)``."""
    narrow = zoo.NARROW[family]
    return {
        "wide": ("wide ↔ wide", (family, 0), (family, 1)),
        "mixed": ("wide ↔ narrow", (family, 1), (narrow, 0)),
        "narrow": ("narrow ↔ narrow", (narrow, 0), (narrow, 1)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--families",
        nargs="+",
        default=list(zoo.NARROW),
        choices=list(zoo.NARROW),
        help="zoo families (default: all with a narrow entry)",
    )
    parser.add_argument(
        "--pairs", nargs="+", default=list(PAIRS), choices=PAIRS, help="which pairs (default: all three)"
    )
    labels = [m[0] for m in METHODS]
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["average", "weight", "learned"],
        choices=labels,
        help="rows (default: average weight learned)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=200,
        help="learned matching steps, also the number of fitting batches (default: 200)",
    )
    args = parser.parse_args()
    rows = list(HEADER)
    for family in args.families:
        for label, (name_a, seed_a), (name_b, seed_b) in (pairs(family)[kind] for kind in args.pairs):
            folders = zoo.train(name_a, seed_a), zoo.train(name_b, seed_b)
            widths = " / ".join(str(spec_of(zoo.build_config(zoo.ZOO[name])).hidden_size) for name in (name_a, name_b))
            result = measure(family, False, args.methods, LearnOptions(steps=args.steps), pair=folders)
            rows += table_rows(f"{family} {label} (d {widths})", result)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
