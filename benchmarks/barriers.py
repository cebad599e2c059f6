"""The barrier table: every zoo pair, vanilla averaging vs weight matching (DESIGN §1).

For each pair of independently trained zoo models (different init and data order), evaluates
held-out loss on an 11-point alpha grid for each method, prints a markdown table (barrier,
ratio to vanilla, accuracy at alpha = 0.5 for ViT) and saves one PNG per pair with the loss
along the path. ``weight (perm.)`` restricts weight matching to permutations, to show which
symmetry class carries the alignment.

    python benchmarks/barriers.py                       # all pairs (trains them on first use)
    python benchmarks/barriers.py --pairs gpt2 vit --plots-dir /tmp/plots
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import hf_lmc
from hf_lmc import zoo
from hf_lmc.barriers import BarrierResult, plot
from hf_lmc.evaluation import EvalOptions

#: (label, method, symmetries) rows per pair.
METHODS = (("average", "average", "full"), ("weight (perm.)", "weight", "permutation"), ("weight", "weight", "full"))


def measure(name: str, progress: bool) -> BarrierResult:
    a, b = zoo.pair(name, progress=progress)
    data = zoo.held_out(name)
    options = EvalOptions(batch_size=16)
    combined = None
    for label, method, symmetries in METHODS:
        result = hf_lmc.barrier(a, b, data, methods=(method,), symmetries=symmetries, eval_options=options, progress=False)
        if combined is None:
            combined = BarrierResult(result.alphas)
        combined.losses[label] = result.losses[method]
        if method in result.accuracies:
            combined.accuracies[label] = result.accuracies[method]
    print(f"{name}: training loss {zoo.train_loss(a):.3f} / {zoo.train_loss(b):.3f}", file=sys.stderr)
    return combined


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", nargs="+", default=list(zoo.ZOO), choices=list(zoo.ZOO), help="zoo pairs to measure (default: all)")
    parser.add_argument("--plots-dir", type=Path, default=Path("benchmarks/plots"), help="where the PNGs go (default: benchmarks/plots)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args()
    args.plots_dir.mkdir(parents=True, exist_ok=True)

    rows = ["| pair | method | loss A / B | loss at α=0.5 | barrier | ratio to average | acc. at α=0.5 |", "|---|---|---|---|---|---|---|"]
    for name in args.pairs:
        result = measure(name, progress=not args.quiet)
        path = plot(result, args.plots_dir / f"{name}.png", title=f"zoo {name}: held-out loss along the path")
        print(f"{name}: plot in {path}", file=sys.stderr)
        middle = len(result.alphas) // 2
        vanilla = result.barriers["average"]
        for label, value in result.barriers.items():
            losses = result.losses[label]
            acc = result.accuracies.get(label)
            rows.append(
                f"| {name} | {label} | {losses[0]:.3f} / {losses[-1]:.3f} | {losses[middle]:.3f} | {value:.3f} | "
                f"{value / vanilla:.2f} | {f'{acc[middle]:.3f}' if acc else '—'} |"
            )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
