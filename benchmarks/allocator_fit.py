"""One learned run's time under glibc's malloc thresholds (docs/decisions.md#d-mmap-threshold).

The command line fixes glibc's mmap threshold at 1 MiB for streamed merges; a training loop
serves its blocks from the heap while it trains (``hf_lmc.utils.allocator.reused_memory``).
This times the same dual run of a ``cpu``-tier pair, each setting in a fresh process, in turn:

  * ``glibc``: nothing set, glibc's own growing threshold (the Python API);
  * ``1 MiB throughout``: the command line's threshold with the training loop leaving it
    (hf_lmc before the change);
  * ``command line``: the command line's threshold, the heap's while training (today's).

The barrier is the same under all three (the allocator changes no arithmetic); the seconds are
the training loop's, from its first step to its last.

    python -m benchmarks.allocator_fit                       # suite-gpt2-a, 300 steps, twice each
    python -m benchmarks.allocator_fit --pair suite-pythia-a --steps 1000 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from .record import new_record, settings_of, write

SETTINGS = ("glibc", "1 MiB throughout", "command line")

CHILD = r"""
import contextlib, json, sys, time
import torch
from benchmarks import suite, tiers
from hf_lmc.config.options import LearnOptions
from hf_lmc.learned.paths import DualMatcher
from hf_lmc.io.loading import load_model
from hf_lmc.utils import allocator

setting, name, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
pair = next(p for p in tiers.TIERS["cpu"] if p.entry.name == name)
folders, _, batches = suite.pair_data(pair)
models = [load_model(folder).model for folder in folders]
if setting != "glibc":
    allocator.return_freed_memory_promptly()
if setting == "1 MiB throughout":
    allocator.reused_memory = contextlib.nullcontext
torch.manual_seed(0)
path = DualMatcher(*models)
marks = []
path.fit(batches, steps=steps, target_barrier=0.0, progress=False, callback=lambda step, _: marks.append(time.perf_counter()))
print(json.dumps({"seconds": marks[-1] - marks[0], "steps": len(marks) - 1, "estimate": path.stopping.estimate}))
"""


def run(setting: str, pair: str, steps: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, setting, pair, str(steps)], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="suite-gpt2-a", help="a cpu-tier pair (default: suite-gpt2-a)")
    parser.add_argument("--steps", type=int, default=300, help="dual matching steps (default: 300)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each setting, interleaved (default: 2)")
    parser.add_argument("--json", default=None, metavar="FILE", help="where to write the record")
    args = parser.parse_args(argv)
    record = new_record("allocator_fit", settings_of(args))
    runs = {setting: [] for setting in SETTINGS}
    for _ in range(args.repeats):
        for setting in SETTINGS:  # interleaved: a machine that slows slows every setting
            runs[setting].append(run(setting, args.pair, args.steps))
            print(f"{setting}: {runs[setting][-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
    base = min(r["seconds"] for r in runs["glibc"])
    print("| setting | seconds (each run) | fastest ÷ glibc's | barrier estimate |")
    print("|---|---|---|---|")
    for setting, rows in runs.items():
        seconds = " / ".join(f"{r['seconds']:.1f}" for r in rows)
        print(f"| {setting} | {seconds} | {min(r['seconds'] for r in rows) / base:.2f} | {rows[0]['estimate']:.4f} |")
    record["runs"] = runs
    print(f"written to {write(record, args.json)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
