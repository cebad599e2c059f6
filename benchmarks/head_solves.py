"""Weight matching's per-head solves for one layer, on 1 thread against several side by side.

Each layer's QK and OV maps come from small float64 decompositions (Cholesky, ``eigh``, SVD of
``head_dim``² moments) that run on the CPU whatever ``--device`` weight matching uses, one
thread each. :func:`hf_lmc.utils.linalg.solve_side_by_side` runs up to ``torch.get_num_threads()`` of
them at once. This times one layer of Pythia-1B's attention (8 heads of 256, rotary 64, hidden
2048: 16 solves) on random moments and prints a markdown table.

    python benchmarks/head_solves.py                     # 1 thread and every core
    python benchmarks/head_solves.py --threads 1 2 4 16
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch

from hf_lmc.matching.solvers import Moments, match_gl_moments, match_rotary_moments
from hf_lmc.utils.linalg import solve_side_by_side

try:  # run as a module (python -m benchmarks.head_solves) or as a script
    from benchmarks.record import new_record, settings_of, write
except ImportError:  # pragma: no cover - script form
    from record import new_record, settings_of, write


def layer_jobs(hidden: int, heads: int, head_dim: int, rotary: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)

    def moments() -> Moments:
        return Moments.of(*(torch.randn(head_dim, hidden + 1, generator=g, dtype=torch.float64) for _ in range(4)))

    jobs = [partial(match_rotary_moments, moments(), rotary) for _ in range(heads)]
    return jobs + [partial(match_gl_moments, moments()) for _ in range(heads)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, len(os.sched_getaffinity(0))])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the run's record to FILE (default: benchmarks/results/head_solves-<date>.json)",
    )
    args = parser.parse_args()
    jobs = layer_jobs(hidden=2048, heads=8, head_dim=256, rotary=64)
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        solve_side_by_side(jobs)  # warm-up
        start = time.perf_counter()
        for _ in range(args.repeats):
            solve_side_by_side(jobs)
        rows.append((threads, (time.perf_counter() - start) / args.repeats))
    print(
        f"\nOne layer's per-head solves at Pythia-1B shape ({len(jobs)} solves), {len(os.sched_getaffinity(0))} cores, torch {torch.__version__}\n"
    )
    print("| threads | ms per layer | × one thread |")
    print("|---|---|---|")
    for threads, seconds in rows:
        print(f"| {threads} | {seconds * 1e3:.0f} | {rows[0][1] / seconds:.2f} |")
    record = new_record("head_solves", settings_of(args))
    record["solves"] = len(jobs)
    record["layers"] = [
        {"threads": threads, "seconds_per_layer": seconds, "speedup": rows[0][1] / seconds} for threads, seconds in rows
    ]
    print(f"\nwritten to {write(record, args.json)}", file=sys.stderr)


if __name__ == "__main__":
    main()
