"""Where dual matching's barrier stands after training at the defaults: on its own training
batches, on the slice of the fitting data held out for the stopping rule, and on the suite's
held-out plays (docs/benchmarks.md §0.1).

If the barrier were low on the training batches and high on held-out text, the fitting data
would limit it (overfitting); if it is high on the training batches too, the optimisation or
the symmetry group does.

    python -m benchmarks.fit_gap suite-gpt2-a suite-llama-b suite-pythia-b
"""

import sys
import time

import torch

from benchmarks import suite
from hf_lmc.matching import DualMatcher
from hf_lmc.matching.training import holdout_split
from hf_lmc.options import LearnOptions


def barrier_on(path: DualMatcher, batches) -> float:
    """The path's largest excess over the line on the 11-point grid, on ``batches``."""
    with torch.no_grad():
        path.locate_worst(batches)
    return float(path.grid_excess.max())


def main(names: list[str]) -> None:
    learn = LearnOptions()
    for name in names:
        pair = suite.pair_named(name)
        folders, evaluation, fitting = suite.pair_data(pair)
        evaluation = list(evaluation)[:16]
        batches, holdout = holdout_split(fitting)  # as TrainedMatcher splits them
        torch.manual_seed(0)
        start = time.perf_counter()
        path = DualMatcher(str(folders[0]), str(folders[1]))
        path.fit(
            batches,
            steps=learn.steps,
            lr=learn.lr,
            schedule=learn.schedule,
            warmup_steps=learn.warmup_steps,
            holdout=holdout,
            target_barrier=learn.target_barrier,
            progress=False,
        )
        print(
            f"| {name} | {barrier_on(path, batches[:16]):.3f} | {barrier_on(path, holdout):.3f} | "
            f"{barrier_on(path, evaluation):.3f} | {time.perf_counter() - start:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    print("| pair | 16 training batches | the held-out fitting batches | 16 batches of held-out plays | seconds |")
    print("|---|---|---|---|---|")
    main(sys.argv[1:])
