"""Strong scaling of a dual-matching step on CPU processes (gloo): 2 processes against 1 at one global batch.

Each configuration runs in its own launch (``torchrun``, one thread per process; 1 process:
plain ``python``), builds two random GPT-NeoX models of the shape in every process (the same
seeds: the same pair), and times :class:`hf_lmc.DualMatcher` steps (forward and backward of the
default objective, layer checkpointing) on the same global batch, split across the processes:

  * ``one``: 1 process, the step as it runs alone;
  * ``one, two at once``: two such 1-process steps at once, independent (nothing shared but the
    machine): their slowdown against ``one`` is the machine's own (shared caches and memory
    bandwidth, clocks under load), so half this row's ratio is the best a 2-process step can
    reach here, its work split perfectly;
  * ``whole``: 2 processes, endpoints whole in each, every process building all of every
    weight (``--no-shard-build``; the only multi-process step before the shared build);
  * ``whole, shared build``: endpoints whole, each process building its rows of every weight
    (a launch's default now): where that moves fewer bytes, the layers run tensor-parallel on
    the launch's batch (each linear at the process's rows, its outputs gathered), else
    all-gathers assemble the weights;
  * ``whole, shared build, weights gathered``: the same with the weights always gathered
    (``EndpointSharding(tensor_parallel=False)``: the shared build before tensor-parallel layers);
  * ``sharded``: endpoints' layers sharded (FSDP2), every process building everything
    (``--shard-endpoints --no-shard-build``; ``--shard-endpoints`` before);
  * ``sharded, shared build``: both (``--shard-endpoints`` now).

Per configuration: 2 warm-up steps, then ``--steps`` timed ones, each started together (a
barrier); a step's time is its slowest process's, and the figure is their median. The shares of
a step come from the interpolant's own clock (:class:`hf_lmc.learned.interpolant.BuildClock`):
``build`` is the time spent computing interpolated weights in forward and recomputation (their
backward, the maps' gradients, runs inside autograd and counts with the rest), ``gathers`` the
time blocked in the endpoints' gathers and the merged rows' all-gathers; the rest is the
tokens' compute, the build's backward, DDP's all-reduce and the optimizer-free remainder.

Shapes: ``160m`` is Pythia-160M's (hidden 768, 12 layers, 12 heads, FFN 3072, vocabulary
50304), batch 4 x 128 tokens; ``wide`` (hidden 1024, 4 layers, 16 heads, FFN 4096,
vocabulary 1024), batch 4 x 16 tokens, where the build dominates; ``cpu`` the ``cpu`` tier's
members' shape (hidden 128, 4 layers, 4 heads, FFN 512, vocabulary 512), batch 32 x 64 tokens.
With ``--baseline TREE`` (a checkout of an earlier commit, e.g. ``git worktree add /tmp/base
HEAD~1``) the 1-process step also runs with that tree's ``hf_lmc``, alternating with this one's,
so a change's effect at N = 1 is measured side by side in one run. With ``--rounds R`` every
shape's runs repeat R times in turn (one, baseline, each mode; then again), each row naming its
round, and a run's ratio is read against its own round's 1-process step: on a machine whose
speed drifts over minutes, runs compared within a round see the same machine.

    python -m benchmarks.strong_scaling                         # every shape
    python -m benchmarks.strong_scaling --shape wide --steps 6
    python -m benchmarks.strong_scaling --shape cpu --baseline /tmp/base
    python -m benchmarks.strong_scaling --shape wide 160m --rounds 3 --modes "whole, shared build"

Issue 59 item 4: at 2 processes, step time <= 0.6x the 1-process step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

try:  # run as a module (python -m benchmarks.strong_scaling) or as a script
    from benchmarks.record import new_record, settings_of, write
except ImportError:  # pragma: no cover - script form
    from record import new_record, settings_of, write

#: shape: (hidden, layers, heads, ffn, vocabulary, global batch, sequence length)
SHAPES = {
    "160m": (768, 12, 12, 3072, 50304, 4, 128),
    "wide": (1024, 4, 16, 4096, 1024, 4, 16),
    "cpu": (128, 4, 4, 512, 512, 32, 64),
}
MODES = (
    "one",
    "one, two at once",
    "whole",
    "whole, shared build",
    "whole, shared build, weights gathered",
    "sharded",
    "sharded, shared build",
)

CHILD = r"""
import gc, json, sys, time
import torch
import torch.distributed as dist
import transformers as tf
from accelerate import Accelerator
from hf_lmc import DualMatcher, EndpointSharding

hidden, layers, heads, ffn, vocab, batch, seq = (int(x) for x in sys.argv[1:8])
mode, steps = sys.argv[8], int(sys.argv[9])
accelerator = Accelerator(cpu=True)  # first: sharding needs the process group
config = tf.GPTNeoXConfig(
    hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=ffn,
    vocab_size=vocab, rotary_pct=0.25, max_position_embeddings=2048,
)
models = []
for seed in (0, 1):
    torch.manual_seed(seed)
    models.append(tf.GPTNeoXForCausalLM(config))
shard = not mode.startswith("one") and mode != "whole" and EndpointSharding(
    build="shared build" in mode, layers=mode.startswith("sharded"), tensor_parallel=False if "weights gathered" in mode else None
)
torch.manual_seed(0)
path = DualMatcher(*models, init="identity", shard_endpoints=shard)
del models
model = accelerator.prepare(path)
params = [p for p in path.parameters() if p.requires_grad]
ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
ids = ids.chunk(accelerator.num_processes)[accelerator.process_index]
clock = getattr(path.interpolant, "clock", None)  # None: a baseline tree from before the clock
rows = []
for step in range(2 + steps):
    if dist.is_initialized():
        dist.barrier()
    if clock is not None:
        clock.reset()
        clock.running = step >= 2
    start = time.perf_counter()
    accelerator.backward(model({"input_ids": ids}))
    for p in params:
        p.grad = None
    wall = time.perf_counter() - start
    rows.append({"wall": wall, "build": clock.build if clock else 0.0, "gathers": clock.gathers if clock else 0.0})
rows = rows[2:]
every = [None] * accelerator.num_processes
if dist.is_initialized():
    dist.all_gather_object(every, rows)
else:
    every = [rows]
if accelerator.is_main_process:
    print("RESULT " + json.dumps(every))
accelerator.wait_for_everyone()
# The groups destroyed once nothing holds them, so that gloo's workers are joined before the
# interpreter shuts down (left to it, one that is freeing a collective's tensors aborts the process).
accelerator.free_memory()
del model, path, params, clock
gc.collect()
if dist.is_initialized():
    dist.destroy_process_group()
"""


def run(shape: str, mode: str, steps: int, tree: Path) -> dict:
    """One configuration's steps: the median step (its slowest process) and its shares."""
    processes = 1 if mode == "one" else 2
    launch = (
        [sys.executable]
        if mode.startswith("one")
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    )
    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "ACCELERATE_USE_CPU": "true",
        "TQDM_DISABLE": "1",
        "PYTHONPATH": str(tree),
    }
    args = [str(x) for x in SHAPES[shape]] + [mode, str(steps)]
    launches = 2 if mode == "one, two at once" else 1  # two independent launches, started together
    every = []
    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch) / "child.py"
        script.write_text(CHILD)
        # Each launch's output to a file, not a pipe: a pipe read after another launch's could
        # fill and stall its writer mid-step, timing the wait.
        logs = [(Path(scratch) / f"out{i}", Path(scratch) / f"err{i}") for i in range(launches)]
        started = []
        try:
            for out, err in logs:
                with out.open("w") as stdout, err.open("w") as stderr:
                    started.append(
                        subprocess.Popen([*launch, str(script), *args], env=env, stdout=stdout, stderr=stderr, cwd=tree)
                    )
            for child, (out, err) in zip(started, logs):
                child.wait()
                lines = [line for line in out.read_text().splitlines() if line.startswith("RESULT ")]
                if child.returncode or not lines:
                    raise RuntimeError(f"{shape}, {mode}: exit {child.returncode}\n{err.read_text()[-3000:]}")
                every += json.loads(lines[-1].removeprefix("RESULT "))
        finally:
            for child in started:  # a launch left running when another failed
                if child.poll() is None:
                    child.kill()
                    child.wait()
    slowest = [max(process[i]["wall"] for process in every) for i in range(steps)]
    median = statistics.median(slowest)
    share = {
        k: statistics.median(process[i][k] for process in every for i in range(steps)) for k in ("build", "gathers")
    }
    return {
        "shape": shape,
        "mode": mode,
        "processes": processes,
        "step_s": median,
        "steps_s": slowest,
        "build_s": share["build"],
        "gathers_s": share["gathers"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), nargs="+", default=["wide", "160m", "cpu"])
    parser.add_argument(
        "--modes", choices=MODES, nargs="+", default=list(MODES), help="the runs to time (default: all)"
    )
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration (after 2 warm-up steps)")
    parser.add_argument(
        "--rounds", type=int, default=1, help="repeat every shape's runs this many times in turn (default: 1)"
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="TREE",
        help="a checkout of an earlier commit: its 1-process step is measured beside this tree's",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the run's record to FILE (default: benchmarks/results/strong_scaling-<date>.json)",
    )
    args = parser.parse_args()
    here = Path(__file__).resolve().parent.parent
    record = new_record("strong_scaling", settings_of(args))
    record["rows"] = rows = []
    print("| shape | processes: run | step (s) | vs 1 process | build (s) | gathers (s) |")
    print("|---|---|---|---|---|---|")
    for shape in args.shape:
        runs = [(mode, here) for mode in dict.fromkeys(["one", *args.modes])]
        if args.baseline is not None:
            runs.insert(1, ("one", args.baseline.resolve()))
        for round_ in range(args.rounds):
            one = None
            for mode, tree in runs:
                row = run(shape, mode, args.steps, tree) | {"tree": "baseline" if tree != here else "this"}
                rows.append(row | {"round": round_})
                if mode == "one" and tree == here:
                    one = row["step_s"]
                label = f"{row['processes']}: {mode}"
                label = label if row["tree"] == "this" else f"{label} (baseline tree)"
                print(
                    f"| {shape} | {label} | {row['step_s']:.3f} | {row['step_s'] / one:.2f}x | "
                    f"{row['build_s']:.3f} | {row['gathers_s']:.3f} |",
                    flush=True,
                )
    print(f"\nwritten to {write(record, args.json)}", file=sys.stderr)


if __name__ == "__main__":
    main()
