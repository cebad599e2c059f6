"""Kernels per learned step: the operators one training step dispatches, against a base step.

On a GPU a learned or dual step at small batch is bound by launches (and host syncs), not by
arithmetic: at Pythia-160M shape on an H100 the dual step took 0.37 s against the base model's
0.048 s (docs/benchmarks.md, cost of a step). What it launches does not depend on the width, so this counts,
on the CPU, the operators one step dispatches (forward, recomputation and backward, through a
``TorchDispatchMode``) for a GPT-NeoX of Pythia-160M's structure (12 layers, 12 heads, partial
rotary) at width 192, and times the step on one thread, where at this width it is bound by the
same per-operator overhead. Views (reshape, transpose, ...) launch no kernel and are counted
apart.

    python benchmarks/step_ops.py
    python benchmarks/step_ops.py --layers 24 --heads 16 --width 256   # Pythia-1.4B's structure
    python benchmarks/step_ops.py --objective labels                    # as docs/benchmarks.md §6.2 measured

The learned steps train toward the library's default objective unless ``--objective`` says
otherwise: ``ensemble`` adds a gradient-free forward of each endpoint to every step.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers as tf
from torch.utils._python_dispatch import TorchDispatchMode

from hf_lmc import DualMatcher, LearnedMatcher
from hf_lmc.options import OBJECTIVES, LearnOptions

# Operators that only re-describe memory (or allocate it uninitialised): no kernel launch.
VIEWS = frozenset(
    [
        "view",
        "_unsafe_view",
        "as_strided",
        "reshape",
        "permute",
        "transpose",
        "t",
        "expand",
        "select",
        "slice",
        "unsqueeze",
        "squeeze",
        "alias",
        "detach",
        "movedim",
        "narrow",
        "split",
        "unbind",
        "split_with_sizes",
        "view_as",
        "_reshape_alias",
        "lift_fresh",
        "empty",
        "empty_strided",
        "resolve_conj",
        "resolve_neg",
        "squeeze_",
        "unsqueeze_",
        "transpose_",
        "t_",
        "as_strided_",
    ]
)


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.kernels = self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.split("::")[-1] in VIEWS:
            self.views += 1
        else:
            self.kernels += 1
        return func(*args, **(kwargs or {}))


def matcher_step(matcher, ids):
    """One training step of ``matcher`` on the batch ``ids``: forward and backward."""
    return lambda: matcher({"input_ids": ids}).backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12, help="layers (default: 12, Pythia-160M)")
    parser.add_argument("--heads", type=int, default=12, help="attention heads (default: 12, Pythia-160M)")
    parser.add_argument("--width", type=int, default=192, help="hidden size (default: 192; counts do not depend on it)")
    parser.add_argument(
        "--objective",
        default=LearnOptions().objective,
        choices=OBJECTIVES,
        help="what the learned steps train toward (default: the library's, %(default)s; docs/benchmarks.md §6 before 2026-11-28: labels)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = tf.GPTNeoXConfig(
        hidden_size=args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.width,
        vocab_size=512,
        rotary_pct=0.25,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    a, b = tf.GPTNeoXForCausalLM(config).eval(), tf.GPTNeoXForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 32))
    steps = {
        "base model fwd+bwd": lambda: a(input_ids=ids, labels=ids, use_cache=False).loss.backward(),
        "dual (layer checkpointing)": matcher_step(DualMatcher(a, b, init="identity", objective=args.objective), ids),
        "one-sided (layer checkpointing)": matcher_step(
            LearnedMatcher(a, b, init="identity", objective=args.objective), ids
        ),
        'one-sided, `frame="both"`': matcher_step(
            LearnedMatcher(a, b, init="identity", frame="both", objective=args.objective), ids
        ),
    }
    rows = {}
    for label, step in steps.items():
        step()  # warm-up
        count = _Count()
        with count:
            step()
        start = time.perf_counter()
        for _ in range(10):
            step()
        rows[label] = (count.kernels, count.views, (time.perf_counter() - start) / 10)
    base_kernels, _, base_time = rows["base model fwd+bwd"]
    print(
        f"\nGPT-NeoX, {args.layers} layers, {args.heads} heads, width {args.width}, batch 2 x 32 tokens, objective {args.objective}, one CPU thread, torch {torch.__version__}\n"
    )
    print("| step | kernels (non-view ops) | × base | views | time (ms) | × base |")
    print("|---|---|---|---|---|---|")
    for label, (kernels, views, seconds) in rows.items():
        print(
            f"| {label} | {kernels} | {kernels / base_kernels:.1f} | {views} | {seconds * 1e3:.0f} | {seconds / base_time:.1f} |"
        )


if __name__ == "__main__":
    main()
