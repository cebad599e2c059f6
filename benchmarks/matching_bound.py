"""How fast weight matching could be on this machine: its matrix products alone, timed at this
machine's measured matmul rates.

Weight matching's large products (docs/design.md §4) are fixed by the shape and the number of
sweeps, whatever the code around them does:

* per sweep and layer: the residual statistics (float32, every tensor's d x d product with B's
  layer maps applied), B's attention weights rotated by the residual map (float32), B's MLP
  weights rotated (the similarity dtype, bfloat16), the F x F unit similarity (bfloat16) and the
  head similarities (bfloat16);
* once: the embedding and head statistics, and B rotated at export (float32: the exported weights
  must carry no more rounding than their float16).

This prints each part's GFLOP and its seconds at the rates measured here, so a merge's wall time
can be read against the floor its arithmetic sets (and ``--average`` against a plain average's
time). Solves (SVDs, assignments, per-head maps), reads and writes come on top.

    python benchmarks/matching_bound.py --arch llama --sweeps 2 --average 12.5
    python benchmarks/matching_bound.py --arch pythia --sweeps 1
"""

from __future__ import annotations

import argparse
import time

import torch

try:  # run as a module (python -m benchmarks.matching_bound) or as a script
    from benchmarks.merge_speed import ARCHS
except ImportError:  # pragma: no cover - script form
    from merge_speed import ARCHS


def rate(dtype: torch.dtype, m: int = 2048, k: int = 5632, n: int = 2048, repeats: int = 3) -> float:
    """Measured GFLOP/s of an (m, k) @ (k, n) product in ``dtype`` (the best of ``repeats``)."""
    x, y = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    x @ y  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x @ y
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best / 1e9


def parts(config, sweeps: int) -> list[tuple[str, float, str]]:
    """(part, GFLOP, dtype) of weight matching's large products for ``config``."""
    d, layers, ffn = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    heads = config.num_attention_heads
    head_dim = d // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    gated = config.model_type == "llama"  # SwiGLU: gate, up, down; GPT-NeoX: up, down
    attention_rows = 2 * heads * head_dim + 2 * kv * head_dim  # q, o; k, v
    mlp_rows = (3 if gated else 2) * ffn
    vocab_rows = 2 * config.vocab_size  # untied embedding and head
    gflop = 2e-9 * d * d
    return [
        ("residual statistics, every sweep", sweeps * layers * gflop * (attention_rows + mlp_rows), "float32"),
        ("B's attention rotated, every sweep", sweeps * layers * gflop * attention_rows, "float32"),
        ("B's MLP rotated, every sweep", sweeps * layers * gflop * mlp_rows, "bfloat16"),
        ("MLP unit similarities, every sweep", sweeps * layers * 2e-9 * ffn * ffn * (mlp_rows // ffn) * d, "bfloat16"),
        (
            "head similarities, every sweep",
            sweeps * layers * 2e-9 * d * (2 * (heads * head_dim) ** 2 + 2 * (kv * head_dim) ** 2),
            "bfloat16",
        ),
        ("embedding and head statistics", gflop * vocab_rows, "float32"),
        ("B rotated at export", gflop * (layers * (attention_rows + mlp_rows) + vocab_rows), "float32"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=list(ARCHS), default="llama", help="the shape (default: llama)")
    parser.add_argument("--scale", type=float, default=1.0, help="as in merge_speed.py (default: 1)")
    parser.add_argument("--sweeps", type=int, default=2, help="weight-matching sweeps (default: 2)")
    parser.add_argument(
        "--average",
        type=float,
        default=None,
        help="a plain average's wall time here (s), to print the floor as a ratio",
    )
    args = parser.parse_args()

    make_config, _, name = ARCHS[args.arch]
    config = make_config(args.scale)
    rates = {"float32": rate(torch.float32), "bfloat16": rate(torch.bfloat16)}
    print(
        f"{name} shape, {args.sweeps} sweep(s), {torch.get_num_threads()} threads; "
        f"measured matmul rates: float32 {rates['float32']:.0f}, bfloat16 {rates['bfloat16']:.0f} GFLOP/s\n"
    )
    print("| part | GFLOP | dtype | seconds at the measured rate |")
    print("|---|---|---|---|")
    total = 0.0
    for part, gflop, dtype in parts(config, args.sweeps):
        seconds = gflop / rates[dtype]
        total += seconds
        print(f"| {part} | {gflop:.0f} | {dtype} | {seconds:.1f} |")
    ratio = f" = {total / args.average:.1f}× the average's {args.average:.1f} s" if args.average else ""
    print(f"| **all products** | | | **{total:.1f}**{ratio} |")


if __name__ == "__main__":
    main()
