"""Which symmetry class carries weight matching? Drop one class at a time on a zoo pair.

For each variant of the searched group, prints the held-out loss of the α=0.5 merge, its excess
over the endpoints' mean loss, and the weight-space objective weight matching reached. Also
compares more coordinate-descent sweeps and float32 unit similarities with the defaults.

    python benchmarks/ablation.py llama pythia vit
"""

from __future__ import annotations

import argparse

import torch

from hf_lmc import zoo
from hf_lmc.canonical import canonicalize, interpolate, to_hf
from hf_lmc.evaluation import EvalOptions, evaluate, load_batches
from hf_lmc.loading import load_model
from hf_lmc.matching import WeightMatcher
from hf_lmc.symmetry import PRESETS

FULL = set(PRESETS["full"])
VARIANTS = {
    "full": ({}, FULL),
    "no residual rotation": ({}, FULL - {"residual"} | {"residual_permutation"}),
    "no QK maps": ({}, FULL - {"qk"}),
    "no OV maps": ({}, FULL - {"ov"}),
    "no head assignment": ({}, FULL - {"heads"}),
    "no MLP assignment": ({}, FULL - {"mlp"}),
    "permutations only": ({}, set(PRESETS["permutation"])),
    "full, sweeps to convergence": ({"tol": 0.0, "max_sweeps": 8}, FULL),
    "full, float32 similarities": ({"similarity_dtype": torch.float32}, FULL),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pairs", nargs="+", choices=list(zoo.ZOO), help="zoo pairs")
    parser.add_argument("--chars", type=int, default=8192, help="held-out characters for LMs (default: 8192)")
    args = parser.parse_args()
    print("| pair | variant | loss at α=0.5 | excess over endpoints | weight objective |")
    print("|---|---|---|---|---|")
    for name in args.pairs:
        folder_a, folder_b = zoo.pair(name, progress=False)
        a, b = load_model(folder_a), load_model(folder_b)
        batches = load_batches(
            zoo.held_out(name, size=args.chars), a.model.config, a.folder, EvalOptions(batch_size=16)
        )
        middle = (evaluate(a.model, batches).loss + evaluate(b.model, batches).loss) / 2
        ca, cb = canonicalize(a.model), canonicalize(b.model)
        for label, (options, kinds) in VARIANTS.items():
            matcher = WeightMatcher(kinds, progress=False, **options)
            aligned = matcher.match(ca, cb).to(torch.float32).apply(cb).materialize()
            loss = evaluate(to_hf(interpolate(ca, aligned, 0.5)), batches).loss
            print(f"| {name} | {label} | {loss:.3f} | {loss - middle:.3f} | {min(matcher.history):.4f} |", flush=True)


if __name__ == "__main__":
    main()
