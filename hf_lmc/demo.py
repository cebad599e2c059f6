"""``hf-lmc demo``: the main job, offline, on an embedded default.

Trains (or loads from the zoo cache) one small GPT-2 pair on the shipped Shakespeare plays from
two seeds, merges it with weight matching, measures the barrier of vanilla averaging and of the
aligned path on held-out plays, and writes the merged model (card and plot included).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from . import zoo
from .options import EvalOptions
from .outputs import check_output_path, check_replaceable, mark
from .pipeline import MergeResult, merge


@dataclass(frozen=True)
class DemoResult:
    merge: MergeResult
    model_a: Path
    model_b: Path
    train_loss: tuple[float, float]
    seconds: float


def run_demo(
    output: str | Path = "hf-lmc-demo",
    *,
    steps: int | None = None,
    eval_chars: int = 16384,
    cache: Path | None = None,
    progress: bool = True,
) -> DemoResult:
    """Run the demo and return what it measured. ``steps`` shortens training (quick runs)."""
    start = time.perf_counter()
    output = Path(output)
    check_output_path(output, "output")
    check_replaceable(output, "output")  # re-running replaces a folder hf_lmc wrote, and no other
    entry = zoo.ZOO["gpt2"] if steps is None else zoo.ZOO["gpt2"].scaled(steps=steps, warmup=min(50, max(1, steps // 10)))
    a, b = zoo.pair(entry, cache=cache, progress=progress)
    result = merge(
        a, b, output, method="weight",
        eval_data=zoo.held_out(entry, size=eval_chars), eval_options=EvalOptions(batch_size=16),
        overwrite=True, progress=progress,
    )
    mark(output, "demo")
    return DemoResult(result, a, b, (zoo.train_loss(a), zoo.train_loss(b)), time.perf_counter() - start)
