"""What each kind of symmetry buys a data-free or data-driven matcher on one suite pair, as a record.

Weight matching (or ``--method activation``) searches a group made of kinds of symmetry
(:data:`hf_lmc.symmetry.sample.KINDS`: the residual rotation, head permutations, the per-head
query-key and value-output maps, MLP permutations and scalings). This measures the pair's
barrier with the whole group, with each kind left out in turn, and with permutations alone
(Theus et al.'s and git-re-basin's group): a kind whose absence raises the barrier is one the
matcher gains from; one whose absence lowers it is one the matcher solves badly on this pair.
The pair's members, held-out data and fitting data are the suite's (``benchmarks/suite.py``),
so the whole group's figure is the suite's own.

    python -m benchmarks.symmetry_ablation --pair paper-vit-a --max-steps 3000
    python -m benchmarks.symmetry_ablation --pair suite-vit-b --method activation
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from hf_lmc.config.options import EvalOptions
from hf_lmc.evaluation.barriers import barrier
from hf_lmc.symmetry.sample import PRESETS

from . import suite
from .record import new_record, settings_of, write


def groups() -> dict[str, str | frozenset[str]]:
    """The groups measured, by name: the whole group, the whole group less each kind, and
    permutations alone."""
    full = PRESETS["full"]
    return (
        {"full": "full"} | {f"without {kind}": full - {kind} for kind in sorted(full)} | {"permutation": "permutation"}
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", required=True, metavar="NAME", help="a pair of any tier, e.g. paper-vit-a")
    parser.add_argument(
        "--method", default="weight", choices=("weight", "activation"), help="the matcher (default: weight)"
    )
    parser.add_argument(
        "--max-steps", type=int, default=None, help="the members' training cap the pair was measured at (paper tier)"
    )
    parser.add_argument("--json", default=None, metavar="FILE", help="where to write the record")
    args = parser.parse_args(argv)
    record = new_record("symmetry_ablation", settings_of(args))
    pair = suite._capped(suite.pair_named(args.pair), args.max_steps)
    folders, evaluation, fitting = suite.pair_data(pair)
    rows = []
    for name, symmetries in groups().items():
        torch.manual_seed(0)
        start = time.perf_counter()
        result = barrier(
            *folders,
            evaluation,
            methods=("average", args.method) if not rows else (args.method,),
            symmetries=symmetries,
            fit_data=fitting if args.method == "activation" else None,
            eval_options=EvalOptions(batch_size=16),
            progress=False,
        )
        if not rows:
            record["average"] = result.barriers["average"]
        row = {
            "group": name,
            "kinds": sorted(PRESETS[symmetries] if isinstance(symmetries, str) else symmetries),
            "barrier": result.barriers[args.method],
            "seconds": time.perf_counter() - start,
        }
        rows.append(row)
        print(
            f"{args.pair} {args.method}, {name}: barrier {row['barrier']:.4f} ({row['seconds']:.0f} s)", file=sys.stderr
        )
    record |= {"pair": args.pair, "family": pair.family, "data": suite.zoo.data_text(pair.entry), "groups": rows}
    print(f"written to {write(record, args.json)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
