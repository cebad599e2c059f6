"""What a command costs before its own work starts: the interpreter and the imports, and loading a
model whole (the start-up that ``merge --dry-run`` and ``hf-lmc inspect`` add to their estimates,
:data:`hf_lmc.merging.pipeline._STARTUP_SECONDS` and ``_LOAD_SECONDS_PER_GB``).

Each figure is the median of ``--repeats`` runs, each in a fresh process:

  * ``imports``: ``python -c "import hf_lmc.cli, hf_lmc.merging.pipeline"``, interpreter start
    included (what every command that loads a model pays first);
  * ``load``: ``from_pretrained`` of a random GPT-2 of ``--layers`` layers and width
    ``--width`` saved as float32 safetensors (the OS's file cache warm, as after a download),
    in seconds per GB of weights.

The record is written to ``benchmarks/results/startup-<date>.json`` (or ``--json``).

    python -m benchmarks.startup
    taskset -c 0,1 python -m benchmarks.startup    # a 2-core machine on a bigger one
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .record import new_record, started, write

LOAD = """
import sys, time
from transformers import GPT2LMHeadModel
start = time.perf_counter()
GPT2LMHeadModel.from_pretrained(sys.argv[1])
print(time.perf_counter() - start)
"""


def _seconds(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--json", default=None, help="where to write the record")
    args = parser.parse_args(argv)
    date = started()
    record = new_record("startup", vars(args), date=date)
    imports = [
        _seconds([sys.executable, "-c", "import hf_lmc.cli, hf_lmc.merging.pipeline"]) for _ in range(args.repeats)
    ]
    with tempfile.TemporaryDirectory() as scratch:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=12)
        GPT2LMHeadModel(config).save_pretrained(scratch)
        size = sum(f.stat().st_size for f in Path(scratch).glob("*.safetensors"))
        loads = []
        for _ in range(args.repeats):
            done = subprocess.run(
                [sys.executable, "-c", LOAD, scratch], check=True, capture_output=True, text=True
            ).stdout.split()
            loads.append(float(done[-1]))
    record["imports_seconds"] = {"median": statistics.median(imports), "runs": imports}
    record["load"] = {
        "bytes": size,
        "median_seconds": statistics.median(loads),
        "runs": loads,
        "seconds_per_gb": statistics.median(loads) / (size / 1e9),
    }
    path = write(record, args.json)
    print(json.dumps({k: record[k] for k in ("imports_seconds", "load")}, indent=2))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
