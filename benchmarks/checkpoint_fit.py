"""One learned run's time and memory with every layer checkpointed and with ``"auto"``
(docs/decisions.md#d-checkpoint-auto).

A learned or dual path builds each layer's interpolated weights inside the layer's call;
``checkpoint_layers=True`` (the default before) runs every call under gradient checkpointing,
``"auto"`` (today's) only the layers that do not fit in 1 GiB at the call's batch, which at the
``cpu`` tier's sizes is none. This times the same dual run of each pair named, each setting in a
fresh process, interleaved, and reads the peak resident memory of each. The run's barrier
estimates and losses are the same under both settings (checkpointing recomputes the same
arithmetic): the record says whether they were, bit for bit.

    python -m benchmarks.checkpoint_fit                                    # four pairs, 300 steps, twice each
    python -m benchmarks.checkpoint_fit --pairs suite-gpt2-a --steps 1000 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from .record import new_record, settings_of, write

#: The settings compared, as ``checkpoint_layers`` takes them.
SETTINGS = {"every layer checkpointed": True, "auto": "auto"}

CHILD = r"""
import json, re, sys, time
import torch
from benchmarks import suite
from hf_lmc.learned.paths import DualMatcher
from hf_lmc.io.loading import load_model

setting, name, steps = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
folders, _, batches = suite.pair_data(suite.pair_named(name))
models = [load_model(folder).model for folder in folders]
torch.manual_seed(0)
path = DualMatcher(*models, checkpoint_layers=setting)
marks = []
losses = path.fit(batches, steps=steps, target_barrier=0.0, progress=False,
                  callback=lambda step, _: marks.append(time.perf_counter()))
peak = int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
curve = [estimate for _, _, estimate in path.stopping.curve]
print(json.dumps({"seconds": marks[-1] - marks[0], "steps": len(marks) - 1, "peak_bytes": peak,
                  "curve": curve, "losses": losses}))
"""


def run(setting, pair: str, steps: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(setting), pair, str(steps)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--pairs",
        nargs="+",
        default=["suite-gpt2-a", "suite-pythia-a", "suite-llama-a", "suite-vit-b"],
        help="cpu-tier pairs (default: one per family)",
    )
    parser.add_argument("--steps", type=int, default=300, help="dual matching steps (default: 300)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each setting, interleaved (default: 2)")
    parser.add_argument("--json", default=None, metavar="FILE", help="where to write the record")
    args = parser.parse_args(argv)
    record = new_record("checkpoint_fit", settings_of(args))
    runs = {pair: {label: [] for label in SETTINGS} for pair in args.pairs}
    for pair in args.pairs:
        for _ in range(args.repeats):
            for label, setting in SETTINGS.items():  # interleaved: a machine that slows slows both
                runs[pair][label].append(run(setting, pair, args.steps))
                print(f"{pair} {label}: {runs[pair][label][-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
    print("| pair | setting | seconds (each run) | median ÷ checkpointed | peak memory (GiB) | same run |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for pair, by_setting in runs.items():
        base = statistics.median(r["seconds"] for r in by_setting["every layer checkpointed"])
        reference = by_setting["every layer checkpointed"][0]
        for label, rows in by_setting.items():
            ratio = statistics.median(r["seconds"] for r in rows) / base
            same = all(r["curve"] == reference["curve"] and r["losses"] == reference["losses"] for r in rows)
            peak = max(r["peak_bytes"] for r in rows) / 2**30
            summary.setdefault(pair, {})[label] = {"ratio": ratio, "peak_gib": peak, "same_run": same}
            seconds = " / ".join(f"{r['seconds']:.1f}" for r in rows)
            print(f"| {pair} | {label} | {seconds} | {ratio:.2f} | {peak:.2f} | {'yes' if same else 'no'} |")
    for by_setting in runs.values():  # the losses are compared above; the record keeps the curves
        for rows in by_setting.values():
            for r in rows:
                r.pop("losses")
    record["runs"], record["summary"] = runs, summary
    print(f"written to {write(record, args.json)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
