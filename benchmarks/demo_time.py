"""How long ``hf-lmc demo`` makes a new user wait: from a fresh HOME, then the cached rerun.

Each run is the command line itself (``hf_lmc.cli.main``) in a process of its own whose HOME
is a new, empty folder shared by the runs of one benchmark:

  * ``fresh HOME``: nothing cached; the pair the package ships is unpacked into the zoo cache;
  * ``cached rerun``: the same command again, the pair in the cache;
  * ``--train`` adds ``hf-lmc demo --train`` on a third, empty HOME (the pair trained here: minutes).

The child times its stages by wrapping the functions that carry them out (the imports, the
pair, weight matching, the loss along the path, writing the merge) and reports them with its
wall and CPU seconds; the parent adds the interpreter's start. The record (date, commit,
machine, settings, seconds per stage, the barrier table printed) is written as JSON to
``benchmarks/results/demo_time-<date>.json`` (or ``--json``) and summed up as a table.

    python -m benchmarks.demo_time                 # fresh HOME, then the cached rerun
    python -m benchmarks.demo_time --train         # and training the pair here
    python -m benchmarks.demo_time --threads 2     # OMP_NUM_THREADS in the children (default: as inherited)
    taskset -c 0,1 python -m benchmarks.demo_time  # a 2-core machine on a bigger one
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .record import new_record, started, write

# The child: the stages' seconds from wrappers around the functions that do them.
CHILD = """
import json, resource, sys, time
start = time.perf_counter()
stages = {}

def timed(module, name, label):
    original = getattr(module, name)
    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            stages[label] = stages.get(label, 0.0) + time.perf_counter() - began
    setattr(module, name, wrapper)

from hf_lmc import cli
from hf_lmc.commands import demo
from hf_lmc.merging import pipeline
stages["imports"] = time.perf_counter() - start
timed(demo.zoo, "pair", "the pair (unpacked, cached or trained)")
timed(pipeline, "align", "weight matching")
timed(pipeline, "measure", "loss along the path")
timed(pipeline, "write", "writing the merge")
rc = cli.main(json.loads(sys.argv[1]))
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"rc": rc, "seconds": time.perf_counter() - start, "cpu_seconds": usage.ru_utime + usage.ru_stime, "stages": stages}))
"""


def run(name: str, argv: list[str], home: Path, threads: int | None) -> dict:
    """One demo in a child process with ``home`` as HOME; its seconds, stages and printed table."""
    environment = {**os.environ, "HOME": str(home), "TQDM_DISABLE": "1"}
    environment.pop("HF_LMC_CACHE", None)  # the cache under the fresh HOME
    if threads is not None:
        environment["OMP_NUM_THREADS"] = str(threads)
    began = time.perf_counter()
    before = os.times()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(argv)], env=environment, capture_output=True, text=True, check=False
    )
    after = os.times()
    seconds = time.perf_counter() - began
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{name}: the demo failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    record = json.loads(lines[-1])
    record["process_seconds"] = seconds  # with the interpreter's start
    record["process_cpu_seconds"] = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    record["table"] = [line for line in lines if line.startswith("|")]
    print(f"{name}: {seconds:.1f} s", file=sys.stderr)
    return {"run": name, "argv": argv, **record}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", action="store_true", help="also time hf-lmc demo --train on an empty HOME (minutes)")
    parser.add_argument(
        "--threads", type=int, default=None, metavar="N", help="OMP_NUM_THREADS in the children (default: as inherited)"
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="PATH",
        help="where to write the record (default: benchmarks/results/demo_time-<date>.json)",
    )
    args = parser.parse_args(argv)

    record = new_record(
        "demo_time",
        {"threads": args.threads or os.environ.get("OMP_NUM_THREADS"), "train": args.train, "progress_bars": False},
        date=started(),
    )
    record["runs"] = []
    with tempfile.TemporaryDirectory(prefix="hf-lmc-demo-time-") as scratch:
        scratch = Path(scratch)
        home = scratch / "home"
        home.mkdir()
        demo = ["demo", "--output", str(scratch / "out")]
        record["runs"].append(run("fresh HOME", demo, home, args.threads))
        record["runs"].append(run("cached rerun", demo, home, args.threads))
        if args.train:
            trained_home = scratch / "trained-home"
            trained_home.mkdir()
            record["runs"].append(run("--train, fresh HOME", [*demo, "--train"], trained_home, args.threads))
    path = write(record, args.json)

    stages = list(dict.fromkeys(stage for r in record["runs"] for stage in r["stages"]))
    info = record["machine"]
    print(
        f"hf-lmc demo on {info['cores']} cores ({info['cpu']}), load average {info['load_average'][0]:.1f} at the start, commit {record['commit']}\n"
    )
    print("| run | seconds (process) | CPU seconds | " + " | ".join(stages) + " |")
    print("|---|---|---|" + "---|" * len(stages))
    for r in record["runs"]:
        cells = " | ".join(f"{r['stages'][s]:.1f}" if s in r["stages"] else "—" for s in stages)
        print(f"| {r['run']} | {r['process_seconds']:.1f} | {r['process_cpu_seconds']:.1f} | {cells} |")
    print("\n" + "\n".join(record["runs"][0]["table"]))
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
