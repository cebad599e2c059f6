"""``hf-lmc demo``: the main job, offline, on an embedded default.

Trains (or loads from the zoo cache) one small GPT-2 pair on the shipped Shakespeare plays from
two seeds, merges it with weight matching, measures the barrier of vanilla averaging and of the
aligned path on held-out plays, and writes the merged model (card and plot included).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from . import zoo
from .options import EvalOptions, OutputExistsError
from .pipeline import MergeResult, merge

MARKER = "hf_lmc_demo.json"  # identifies a folder a previous demo wrote (so re-running may replace it)


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
    if output.exists() and not (output / MARKER).is_file():
        raise OutputExistsError(f"{output} exists and was not written by hf-lmc demo; pass another {{}} to write elsewhere", "output")
    entry = zoo.ZOO["gpt2"] if steps is None else zoo.ZOO["gpt2"].scaled(steps=steps, warmup=min(50, max(1, steps // 10)))
    a, b = zoo.pair(entry, cache=cache, progress=progress)
    result = merge(
        a, b, output, method="weight",
        eval_data=zoo.held_out(entry, size=eval_chars), eval_options=EvalOptions(batch_size=16),
        overwrite=True, progress=progress,
    )
    (output / MARKER).write_text(json.dumps({"zoo": entry.name, "models": [str(a), str(b)]}, indent=2) + "\n")
    return DemoResult(result, a, b, (zoo.train_loss(a), zoo.train_loss(b)), time.perf_counter() - start)
