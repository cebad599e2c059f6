"""The barrier table: every zoo pair, vanilla averaging vs every alignment method (docs/design.md §1).

For each pair of independently trained zoo models (different init and data order), evaluates
held-out loss on an 11-point alpha grid for each method, prints a markdown table (barrier,
ratio to vanilla, accuracy at alpha = 0.5 for ViT) and saves one PNG per pair with the loss
along the path. ``weight (perm.)`` restricts weight matching to permutations, to show which
symmetry class carries the alignment. Activation matching calibrates on 200 training batches;
learned and dual matching train 200 steps on them (16 sequences / images each, Adam lr 3e-3,
half the lambda draws near the path's worst point) from the weight-matching solution. Each row
seeds torch's global RNG with ``--seed`` first (the lambda draws and input noise), so a row is
reproducible whatever other rows run.

    python benchmarks/barriers.py                       # all pairs (trains them on first use)
    python benchmarks/barriers.py --pairs gpt2 vit --plots-dir /tmp/plots
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import hf_lmc
from hf_lmc import zoo
from hf_lmc.barriers import BarrierResult, plot
from hf_lmc.options import OBJECTIVES, PERMUTATIONS, EvalOptions, LearnOptions

#: (label, method, symmetries) rows per pair.
METHODS = (
    ("average", "average", "full"),
    ("weight (perm.)", "weight", "permutation"),
    ("weight", "weight", "full"),
    ("activation", "activation", "full"),
    ("learned", "learned", "full"),
    ("dual", "dual", "full"),
)


HEADER = [
    "| pair | method | loss A / B | loss at α=0.5 | barrier | ratio to average | acc. at α=0.5 |",
    "|---|---|---|---|---|---|---|",
]


def measure(
    name: str,
    progress: bool,
    methods: list[str],
    learn: LearnOptions,
    pair: tuple[Path, Path] | None = None,
    seed: int = 0,
) -> BarrierResult:
    """Every row of ``methods`` on zoo ``name``'s pair (or on ``pair``, two folders of that family)."""
    a, b = pair or zoo.pair(name, progress=progress)
    data = zoo.held_out(name)
    fit = zoo.fit_batches(name, learn.steps)  # training split: calibration (activation) and training (learned, dual)
    options = EvalOptions(batch_size=16)
    combined = None
    for label, method, symmetries in METHODS:
        if label not in methods:
            continue
        start = time.perf_counter()
        torch.manual_seed(seed)
        result = hf_lmc.barrier(
            a,
            b,
            data,
            methods=(method,),
            symmetries=symmetries,
            eval_options=options,
            fit_data=fit,
            learn=learn,
            progress=False,
        )
        print(
            f"{name} {label}: barrier {result.barriers[method]:.3f} ({time.perf_counter() - start:.0f} s)",
            file=sys.stderr,
        )
        if combined is None:
            combined = BarrierResult(result.alphas)
        combined.losses[label] = result.losses[method]
        if method in result.accuracies:
            combined.accuracies[label] = result.accuracies[method]
    print(f"{name}: training loss {zoo.train_loss(a):.3f} / {zoo.train_loss(b):.3f}", file=sys.stderr)
    return combined


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # the zoo table: one pair per family (two widths: benchmarks/widths.py; doubled width: learned_curve.py)
    default = [name for name in zoo.ZOO if name not in {*zoo.NARROW.values(), *zoo.WIDE.values()}]
    parser.add_argument(
        "--pairs",
        nargs="+",
        default=default,
        choices=list(zoo.ZOO),
        help=f"zoo pairs to measure (default: {' '.join(default)})",
    )
    parser.add_argument(
        "--plots-dir", type=Path, default=Path("benchmarks/plots"), help="where the PNGs go (default: benchmarks/plots)"
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=[m[0] for m in METHODS],
        choices=[m[0] for m in METHODS],
        help="rows to measure (default: all)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=200,
        help="learned / dual training steps, also the number of calibration batches (default: 200)",
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="learned / dual learning rate (default: 3e-3)")
    parser.add_argument(
        "--permutations",
        default="fixed",
        choices=PERMUTATIONS,
        help="learned / dual: how the unit and head permutations train (default: fixed)",
    )
    parser.add_argument(
        "--objective",
        default="labels",
        choices=list(OBJECTIVES),
        help="learned / dual: train toward the labels or the endpoints' mixed predictions (default: labels)",
    )
    parser.add_argument(
        "--worst-fraction",
        type=float,
        default=LearnOptions().worst_fraction,
        help=f"learned / dual: share of lambda draws near the path's current worst point (default: {LearnOptions().worst_fraction})",
    )
    parser.add_argument(
        "--input-noise",
        type=float,
        default=LearnOptions().input_noise,
        help=f"learned / dual, image pairs only: std of Gaussian noise on the training images (default: {LearnOptions().input_noise})",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of each row's lambda draws and input noise (default: 0)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args()
    args.plots_dir.mkdir(parents=True, exist_ok=True)

    rows = list(HEADER)
    for name in args.pairs:
        learn = LearnOptions(
            steps=args.steps,
            lr=args.lr,
            permutations=args.permutations,
            objective=args.objective,
            worst_fraction=args.worst_fraction,
            input_noise=args.input_noise if zoo.ZOO[name].model_type == "vit" else 0.0,
        )
        result = measure(name, not args.quiet, args.methods, learn, seed=args.seed)
        path = plot(result, args.plots_dir / f"{name}.png", title=f"zoo {name}: held-out loss along the path")
        print(f"{name}: plot in {path}", file=sys.stderr)
        rows += table_rows(name, result)
    print("\n".join(rows))


def table_rows(name: str, result: BarrierResult) -> list[str]:
    """One markdown row per method (columns of :data:`HEADER`)."""
    middle = len(result.alphas) // 2
    vanilla = result.barriers.get("average")
    rows = []
    for label, value in result.barriers.items():
        losses = result.losses[label]
        acc = result.accuracies.get(label)
        rows.append(
            f"| {name} | {label} | {losses[0]:.3f} / {losses[-1]:.3f} | {losses[middle]:.3f} | {value:.3f} | "
            f"{f'{value / vanilla:.2f}' if vanilla else '—'} | {f'{acc[middle]:.3f}' if acc else '—'} |"
        )
    return rows


if __name__ == "__main__":
    main()
