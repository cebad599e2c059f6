"""What ``hf-lmc inspect`` reads from weights alone, on pairs whose relation is known.

For each pair: the per-group cosine similarity of the canonical tensors (lowest and median),
the relative distance of the Gram matrices of the embedding and head rows (:mod:`hf_lmc.commands.inspect`), the relation
inspect reports, and the vanilla (plain average) barrier on held-out data, which says whether
a plain average would have done. The pairs:

* the zoo's independently trained pairs (seeds 0 and 1): the shipped ``gpt2`` pair and the
  suite's ``ci`` tier, one per family;
* twins: the ``gpt2`` zoo member moved by a random full symmetry, exported as a stock checkpoint;
* fine-tunes: the ``gpt2`` zoo member trained on with AdamW on training-split batches drawn in
  another order, measured after each of ``--steps`` (the zoo's learning rate; at a tenth of it,
  the first two counts).

The thresholds :data:`hf_lmc.commands.inspect.FINE_TUNE_COSINE` and :data:`hf_lmc.commands.inspect.SAME_GRAM`
were chosen between the groups this measures (docs/inspect.md).

    python -m benchmarks.inspect_similarity                  # writes benchmarks/results/inspect_similarity-<date>.json
    python -m benchmarks.inspect_similarity --steps 10 100
    python -m benchmarks.inspect_similarity --large           # inspect's time and memory at 1B parameters
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_lmc
from hf_lmc.commands.inspect import inspect_models
from hf_lmc.io import zoo

try:  # run as a module (python -m benchmarks.inspect_similarity) or as a script
    from benchmarks.record import new_record, settings_of, write
    from benchmarks.tiers import TIERS
except ImportError:  # pragma: no cover - script form
    from record import new_record, settings_of, write
    from suite import TIERS


def fine_tunes(folder: Path, into: Path, steps: list[int], lr: float, seed: int):
    """``folder``'s model trained on with AdamW on zoo gpt2 training batches (drawn in their own
    order), saved after each number of ``steps`` in turn: ``(steps, folder)`` pairs."""
    model = AutoModelForCausalLM.from_pretrained(folder).train()
    optimiser = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    batches = iter(zoo.fit_batches("gpt2", max(steps), batch_size=32, seed=seed))
    done = 0
    for target in sorted(steps):
        for _ in range(target - done):
            ids = next(batches)["input_ids"]
            model(input_ids=ids, labels=ids).loss.backward()
            optimiser.step()
            optimiser.zero_grad()
        done = target
        saved = into / f"tuned-{lr:g}-{target}"
        model.save_pretrained(saved)
        AutoTokenizer.from_pretrained(folder).save_pretrained(saved)
        yield target, saved


def twin(folder: Path, into: Path, seed: int) -> Path:
    """``folder``'s model moved by a random full symmetry, exported to its stock class."""
    canonical = hf_lmc.canonicalize(folder, dtype=torch.float32)
    moved = hf_lmc.random_symmetry(canonical.spec, seed=seed, dtype=torch.float32).apply(canonical)
    hf_lmc.to_hf(moved).save_pretrained(into)
    AutoTokenizer.from_pretrained(folder).save_pretrained(into)
    return into


#: A Pythia-1B-shaped model (as benchmarks/merge_speed.py's scale 1.0: one checkpoint 2 GB in float16).
PYTHIA_1B = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 8,
    "intermediate_size": 8192,
    "vocab_size": 50304,
    "rotary_pct": 0.25,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}

_TIMED = """
import json, sys, time
from hf_lmc.cli import _return_freed_memory_promptly
from hf_lmc.commands.inspect import inspect_models
_return_freed_memory_promptly()  # as hf-lmc inspect runs
start = time.perf_counter()
report = inspect_models(sys.argv[1:], progress=False)
seconds = time.perf_counter() - start
# VmHWM: this process's own peak (ru_maxrss would keep the forking parent's, models included)
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"seconds": seconds, "peak_rss_bytes": peak, "relation": report.relation,
                  "lowest_cosine": report.similarities[0].lowest}))
"""


def large(scratch: Path, noise: float) -> dict:
    """Inspect's time and peak memory on a Pythia-1B-shaped pair stored in float16, B being A plus
    ``noise`` times each tensor's RMS, in a fresh process with the command line's allocator setting
    (its peak is inspect's alone)."""
    import subprocess
    import sys

    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(**PYTHIA_1B)).to(torch.float16)
    model.save_pretrained(scratch / "a")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(noise * parameter.float().square().mean().sqrt().half() * torch.randn_like(parameter))
    model.save_pretrained(scratch / "b")
    parameters = sum(p.numel() for p in model.parameters())
    del model
    run = subprocess.run(
        [sys.executable, "-c", _TIMED, str(scratch / "a"), str(scratch / "b")],
        capture_output=True,
        text=True,
        check=True,
    )
    row = {"kind": "timing", "pair": f"pythia-1b shape, float16, B = A + {noise:g} RMS noise", "parameters": parameters}
    row |= json.loads(run.stdout.strip().splitlines()[-1])
    print(row, flush=True)
    return row


def measure(kind: str, name: str, a: Path, b: Path, held_out) -> dict:
    start = time.perf_counter()
    report = inspect_models([a, b])
    seconds = time.perf_counter() - start
    similarity = report.similarities[0]
    vanilla = hf_lmc.barrier(a, b, held_out, methods=("average",), progress=False).barriers["average"]
    row = {
        "kind": kind,
        "pair": name,
        "lowest_cosine": round(similarity.lowest, 4),
        "median_cosine": round(similarity.median, 4),
        "gram_distance": float(f"{similarity.gram:.3g}"),
        "relation": similarity.relation,
        "vanilla_barrier": round(vanilla, 4),
        "inspect_seconds": round(seconds, 2),
    }
    print(" | ".join(str(v) for v in row.values()), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--steps",
        type=int,
        nargs="+",
        default=[10, 100, 300],
        help="fine-tuning steps (the later rates: the first two)",
    )
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 3e-4], help="fine-tuning learning rates")
    parser.add_argument(
        "--large",
        action="store_true",
        help="only time inspect on a Pythia-1B-shaped pair (4 GB of disk, 5 GB of memory)",
    )
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="where to write the record")
    args = parser.parse_args()
    record = new_record("inspect_similarity", settings_of(args))
    if args.large:
        with tempfile.TemporaryDirectory() as scratch:
            record["rows"] = [large(Path(scratch), noise=0.01)]
        print(f"record written to {write(record, args.json)}")
        return
    rows = []
    print("kind | pair | lowest cosine | median cosine | Gram distance | relation | vanilla barrier | seconds")
    a, b = zoo.pair("gpt2", progress=False)
    rows.append(measure("independent", "zoo gpt2 seeds 0, 1", a, b, zoo.held_out("gpt2")))
    for pair in TIERS["ci"]:
        first, second = (zoo.train(pair.entry, seed, progress=False) for seed in (0, 1))
        rows.append(measure("independent", f"suite ci {pair.entry.name}", first, second, zoo.held_out(pair.entry)))
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        rows.append(
            measure("twins", "zoo gpt2 seed 0, moved", a, twin(a, scratch / "twin", seed=3), zoo.held_out("gpt2"))
        )
        for lr, counts in ((args.lrs[0], args.steps), *((lr, args.steps[:2]) for lr in args.lrs[1:])):
            for steps, tuned in fine_tunes(a, scratch, counts, lr, seed=7):
                rows.append(
                    measure(
                        "fine-tune", f"zoo gpt2 seed 0 + {steps} steps at lr {lr:g}", a, tuned, zoo.held_out("gpt2")
                    )
                )
    record["rows"] = rows
    print(f"record written to {write(record, args.json)}")


if __name__ == "__main__":
    main()
