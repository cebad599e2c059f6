"""Where a suite pair's barrier sits: ``hf-lmc explain`` on one pair of a tier, as a record.

A pair that misses a goal or the ``cpu`` tier's guard is read group by group: the midpoint's
excess of the average's path and of the path ``--method`` aligns, split into each group's part
(embeddings; per layer QK, OV, MLP; head) and averaged over ``--orders`` orders of moving the
groups (:func:`hf_lmc.evaluation.explain.explain`). The pair's members, held-out text and
fitting data are the suite's (``benchmarks/suite.py``), so the aligned path is the one the
suite's figure was measured on; the results tables show the record under the guard it explains.

    python -m benchmarks.explain_pair --pair suite-llama-b                 # dual, 2 orders
    python -m benchmarks.explain_pair --pair paper-gpt2-a --method learned --orders 4 --max-steps 3000
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from hf_lmc.config.options import EvalOptions
from hf_lmc.evaluation.explain import explain

from . import suite
from .record import new_record, settings_of, write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", required=True, metavar="NAME", help="a pair of any tier, e.g. suite-llama-b")
    parser.add_argument("--method", default="dual", help="the aligned path to explain (default: dual)")
    parser.add_argument("--orders", type=int, default=2, help="orders of moving the groups to average (default: 2)")
    parser.add_argument(
        "--max-steps", type=int, default=None, help="the members' training cap the pair was measured at (paper tier)"
    )
    parser.add_argument("--json", default=None, metavar="FILE", help="where to write the record")
    args = parser.parse_args(argv)
    record = new_record("explain_pair", settings_of(args))
    pair = suite._capped(suite.pair_named(args.pair), args.max_steps)
    folders, _, fitting = suite.pair_data(pair)
    torch.manual_seed(0)
    start = time.perf_counter()
    explanation = explain(
        str(folders[0]),
        str(folders[1]),
        suite.zoo.held_out(pair.entry),
        method=args.method,
        fit_data=fitting,
        eval_options=EvalOptions(batch_size=16, seq_len=pair.entry.seq_len),
        orders=args.orders,
        progress=False,
    )
    print(explanation.table())
    record |= {
        "pair": args.pair,
        "family": pair.family,
        "seconds": time.perf_counter() - start,
        **json.loads(explanation.to_json()),
    }
    print(f"written to {write(record, args.json)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
