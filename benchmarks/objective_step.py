"""Seconds per learned-matching step under each objective, labels against ensemble.

The ensemble objective (the default since docs/benchmarks.md §0.12) adds a gradient-free
forward of each endpoint to every step; this measures what that costs on one pair per language
family of the suite's ``cpu`` tier, at the suite's fitting batches (32 sequences of 64 tokens),
on one thread: 20 steps after 5 of warm-up, each objective twice, alternating.

    python -m benchmarks.objective_step
"""

from __future__ import annotations

import time

import torch

from hf_lmc import canonicalize
from hf_lmc.loading import load_model
from hf_lmc.matching.learned import LearnedMatcher

from . import suite

PAIRS = ("suite-gpt2-a", "suite-pythia-b", "suite-llama-a")


def seconds_per_step(a, b, batches, objective: str, warmup: int = 5, steps: int = 20) -> float:
    """Mean seconds of a forward, backward and Adam step of ``LearnedMatcher`` over ``steps`` batches after ``warmup``."""
    torch.manual_seed(0)
    matcher = LearnedMatcher(a, b, objective=objective)
    optimizer = torch.optim.Adam([p for p in matcher.parameters() if p.requires_grad], lr=1e-3)
    for i, batch in enumerate(batches[: warmup + steps]):
        if i == warmup:
            start = time.perf_counter()
        loss = matcher(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    torch.set_num_threads(1)
    pairs = {pair.entry.name: pair for pair in suite.TIERS["cpu"]}
    print("| pair | labels (s per step) | ensemble (s per step) | ensemble / labels |\n|---|---|---|---|")
    for name in PAIRS:
        folders, _, batches = suite.pair_data(pairs[name])
        a, b = (canonicalize(load_model(folder).model) for folder in folders)
        times = {objective: [] for objective in ("labels", "ensemble")}
        for _ in range(2):
            for objective, measured in times.items():
                measured.append(seconds_per_step(a, b, batches, objective))
        labels, ensemble = (sum(t) / len(t) for t in times.values())
        print(f"| {name} | {labels:.3f} | {ensemble:.3f} | {ensemble / labels:.2f} |", flush=True)


if __name__ == "__main__":
    main()
