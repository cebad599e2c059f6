"""Peak memory of a dual-matching step against the vocabulary: what the loss holds.

A learned or dual step's loss applies the head of the point on the path (and, for the ensemble
objective, each endpoint's head) to every position: whole, that is several tokens x vocabulary
tensors, which at a 128k vocabulary outweigh everything else a small model's step holds. Since
``hf_lmc.evaluation.head_loss`` the loss takes the head a slice of positions at a time. This
builds two LLaMA-shaped models narrow enough that the vocabulary dominates (hidden 256, 2 layers,
4 heads on 2 KV heads, MLP 688, float32, random weights), and measures, each in its own process,
one :class:`hf_lmc.DualMatcher` step per objective (the second of two; forward and backward)
on the command line's default fitting batch (32 sequences of 128 tokens), and, for reference,
one forward and backward of the stock model with its own loss, the held-out evaluation of one
batch (:func:`hf_lmc.evaluation.loss.evaluate`, no gradient), and activation matching on one
calibration batch (whose forward runs the base model alone since 2026-11-29: "loss sliced" reads
"yes"). Memory is the step's peak RSS less the resident memory before it (models, endpoints,
transforms).

    python benchmarks/loss_memory.py                          # vocabularies 32000 and 128256
    python benchmarks/loss_memory.py --vocab 50304 --batch 8

It uses the public API only, so the same script measures another checkout of hf_lmc, run from
that checkout's folder (the step processes import from the working directory first):
``cd /path/to/checkout && PYTHONPATH=. python /path/to/this/loss_memory.py``. The "loss sliced"
column says which code ran: the before and after of slicing the loss (docs/decisions.md#d-sliced-loss).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

try:  # run as a module (python -m benchmarks.loss_memory) or as a script
    from benchmarks.record import new_record, settings_of, write
except ImportError:  # pragma: no cover - script form
    from record import new_record, settings_of, write

CHILD = r"""
import json, re, sys, time, ctypes, gc
import torch, transformers as tf
from hf_lmc import DualMatcher

mode, vocab, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def rss(field="VmRSS"):
    return int(re.search(field + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
config = tf.LlamaConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=688, vocab_size=vocab, max_position_embeddings=seq, tie_word_embeddings=False)
torch.manual_seed(0)
ids = torch.randint(0, vocab, (batch, seq))
model_a = tf.LlamaForCausalLM(config).eval()
if mode == "stock":
    step = lambda: model_a(input_ids=ids, labels=ids, use_cache=False).loss.backward()
elif mode == "evaluate":
    import hf_lmc.evaluation.loss as evaluation
    step = lambda: evaluation.evaluate(model_a, [{"input_ids": ids}])
elif mode == "activation":
    import inspect
    import hf_lmc
    from hf_lmc.matching import activation
    pair = [hf_lmc.canonicalize(model_a), hf_lmc.canonicalize(tf.LlamaForCausalLM(config).eval())]
    step = lambda: hf_lmc.ActivationMatcher([{"input_ids": ids}], progress=False).match(*pair)
else:
    model_b = tf.LlamaForCausalLM(config).eval()
    matcher = DualMatcher(model_a, model_b, init="identity", objective=mode)
    del model_a, model_b
    params = [p for p in matcher.parameters() if p.requires_grad]
    def step():
        matcher({"input_ids": ids}, alpha=0.5).backward()
        for p in params:
            p.grad = None
times = []
for i in range(2):
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    open("/proc/self/clear_refs", "w").write("5")  # the peak of this step alone
    before = rss()
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
if mode == "evaluate":
    sliced = hasattr(evaluation, "next_token_loss")
elif mode == "activation":
    sliced = "base_model(" in inspect.getsource(activation._record)
else:
    sliced = "hf_lmc.evaluation.head_loss" in sys.modules or "hf_lmc.matching.head_loss" in sys.modules
print(json.dumps({"wall": times[-1], "growth": rss("VmHWM") - before, "sliced": sliced}))
"""


LABELS = {
    "stock": "stock model fwd+bwd",
    "labels": "dual, labels",
    "ensemble": "dual, ensemble",
    "evaluate": "evaluate (no gradient)",
    "activation": "activation matching, one calibration batch",
}


def run(mode: str, vocab: int, batch: int, seq: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(vocab), str(batch), str(seq)],
        check=False,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--vocab", type=int, nargs="+", default=[32000, 128256], help="vocabulary sizes (default: 32000 128256)"
    )
    parser.add_argument(
        "--batch", type=int, default=32, help="sequences per batch (default: 32, the command line's fitting batch)"
    )
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default: 128)")
    parser.add_argument(
        "--measure", nargs="+", choices=list(LABELS), default=list(LABELS), help="what to measure (default: all)"
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the run's record to FILE (default: benchmarks/results/loss_memory-<date>.json)",
    )
    args = parser.parse_args()
    import torch

    tokens = args.batch * args.seq
    print(
        f"\nLLaMA, hidden 256, 2 layers, float32; {args.batch} x {args.seq} = {tokens} tokens; "
        f"{torch.get_num_threads()} thread(s) per step process\n"
    )
    print(
        "| vocabulary | step | loss sliced | time (s) | peak growth (GB) | one T x V float32 (GB) |\n|---|---|---|---|---|---|"
    )
    record = new_record("loss_memory", settings_of(args))
    record["steps"] = []
    for vocab in args.vocab:
        whole = tokens * vocab * 4 / 1e9
        for mode in args.measure:
            row = run(mode, vocab, args.batch, args.seq)
            record["steps"].append({"vocabulary": vocab, "step": LABELS[mode], **row})
            label = LABELS[mode]
            sliced = "—" if mode == "stock" else ("yes" if row["sliced"] else "no")
            print(
                f"| {vocab} | {label} | {sliced} | {row['wall']:.1f} | {row['growth'] / 1e9:.2f} | {whole:.2f} |",
                flush=True,
            )
    print(f"\nwritten to {write(record, args.json)}", file=sys.stderr)


if __name__ == "__main__":
    main()
