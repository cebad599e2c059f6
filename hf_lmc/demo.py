"""``hf-lmc demo``: the main job, offline, on an embedded default.

Takes one small GPT-2 pair trained on the shipped Shakespeare plays from two seeds (the pair
the package ships, unpacked into the zoo cache; trained afresh with ``train=True`` or other
``steps``), merges it with weight matching, measures the barrier of vanilla averaging and of
the aligned path on held-out plays, and writes the merged model (card and plot included).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from . import zoo
from .hub import command_markdown
from .linalg import single_threaded
from .options import DemoOptions, EvalOptions
from .outputs import check_output_path, check_replaceable, mark
from .pipeline import MergeResult, merge

#: What ``hf-lmc demo`` replaces without ``--overwrite``: its own earlier output (a merge it wrote
#: and then marked as the demo's), never another merge or folder.
DEMO_KINDS = ("demo",)


@dataclass(frozen=True)
class DemoResult:
    merge: MergeResult
    model_a: Path
    model_b: Path
    train_loss: tuple[float, float]
    seconds: float
    #: Whether the pair came from the package (unpacked) rather than trained on this machine.
    shipped: bool = False


# The demo's models are tiny: every operation is too small for a thread pool to pay for handing it
# out, and on a machine other work keeps busy each one also waits for every thread of the pool to
# be scheduled, which made the loss along the path several times slower than one thread alone.
@single_threaded
def run_demo(
    output: str | Path = DemoOptions.model_fields["output"].default,
    *,
    steps: int | None = None,
    eval_chars: int = DemoOptions.model_fields["eval_chars"].default,
    cache: Path | None = None,
    progress: bool = True,
    train: bool = False,
) -> DemoResult:
    """Run the demo and return what it measured. The pair is the one the package ships unless
    ``train`` (train it here from its seeds) or ``steps`` (train a shorter run: quick tests)."""
    start = time.perf_counter()
    output = Path(output)
    check_output_path(output, "output")
    check_replaceable(
        output, "output", kinds=DEMO_KINDS
    )  # re-running replaces its own earlier output, and no other folder
    entry = (
        zoo.ZOO["gpt2"] if steps is None else zoo.ZOO["gpt2"].scaled(steps=steps, warmup=min(50, max(1, steps // 10)))
    )
    a, b = zoo.pair(entry, cache=cache, progress=progress, shipped=not train)
    result = merge(
        a,
        b,
        output,
        method="weight",
        eval_data=zoo.held_out(entry, size=eval_chars),
        eval_options=EvalOptions(batch_size=16),
        overwrite=True,
        progress=progress,
        # the card: the members and data by their zoo names (not cache folders), and the command that made it
        labels=("zoo:gpt2/seed0", "zoo:gpt2/seed1"),
        eval_data_name="zoo:shakespeare (two held-out plays)",
        made_with=command_markdown(_demo_command(output, steps, eval_chars, train)),
    )
    mark(output, "demo")
    shipped = zoo.was_shipped(a) and zoo.was_shipped(b)
    return DemoResult(result, a, b, (zoo.train_loss(a), zoo.train_loss(b)), time.perf_counter() - start, shipped)


def _demo_command(output: Path, steps: int | None, eval_chars: int, train: bool = False) -> list[str]:
    """The ``hf-lmc demo`` command line that runs the demo with these settings again."""
    words = ["hf-lmc", "demo"]
    if str(output) != DemoOptions.model_fields["output"].default:
        words += ["--output", str(output)]
    if train:
        words += ["--train"]
    if steps is not None:
        words += ["--steps", str(steps)]
    if eval_chars != DemoOptions.model_fields["eval_chars"].default:
        words += ["--eval-chars", str(eval_chars)]
    return words
