"""``hf-lmc demo``: the main job, offline, on an embedded default.

Takes one small GPT-2 pair trained on the shipped Shakespeare plays from two seeds (the pair
the package ships, unpacked into the zoo cache; trained afresh with ``train=True`` or other
``steps``), merges it with weight matching, measures the barrier of the plain average and of
the aligned path on held-out plays, and writes the merged model (card and plot included).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hf_lmc.commands.common import say
from hf_lmc.config.options import (
    DemoOptions,
    EvalOptions,
)
from hf_lmc.io import zoo
from hf_lmc.io.hub import command_markdown
from hf_lmc.io.outputs import check_output_path, check_replaceable, mark
from hf_lmc.merging.pipeline import MergeResult, merge
from hf_lmc.utils import allocator
from hf_lmc.utils.linalg import single_threaded

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
        words += ["--train-steps", str(steps)]
    if eval_chars != DemoOptions.model_fields["eval_chars"].default:
        words += ["--eval-chars", str(eval_chars)]
    return words


# -- the command ------------------------------------------------------------------------------


def write_plays(folder: str | Path) -> list[Path]:
    """Write the shipped Shakespeare plays as UTF-8 text into ``folder`` (made if missing):
    :data:`PLAYS_FILES`, the plays the demo's pair trained on and the two it holds out, each play
    followed by a blank line. A file already there with that text is kept; any other is refused.
    Returns the files."""
    from hf_lmc.io.outputs import write_new_text

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    texts = dict(zip(PLAYS_FILES, zoo.shakespeare()))
    written = []
    for name, plays in texts.items():
        write_new_text(folder / name, "\n\n".join(play.rstrip("\n") for play in plays) + "\n", "write_plays")
        written.append(folder / name)
    return written


#: The files ``hf-lmc demo --write-plays DIR`` writes, in the order :func:`hf_lmc.io.zoo.shakespeare`
#: returns its plays: the training plays, then the held-out ones the examples evaluate on.
PLAYS_FILES = ("train.txt", "plays.txt")


def main(args: argparse.Namespace) -> int:
    from hf_lmc.io.outputs import check_output_path, check_replaceable
    from hf_lmc.utils.progress import silenced

    if args.write_plays is not None:  # the examples' data, and nothing else
        train, held_out = write_plays(args.write_plays)
        say(f"wrote {train} (the plays the demo's pair trained on) and {held_out} (two held-out plays)")
        return 0

    check_output_path(args.output, "output")  # refused before torch loads; run_demo checks again
    check_replaceable(args.output, "output", kinds=("demo",))  # as run_demo: its own earlier output only
    if not silenced():  # what the next seconds (or minutes) are spent on, before the imports take the first of them
        print(f"hf-lmc demo: {_demo_plan(args)}", file=sys.stderr)
    allocator.small_blocks_from_the_heap()  # its tiny models' thousands of MiB-sized temporaries
    cache = None if args.cache_dir is None else Path(args.cache_dir)
    result = run_demo(args.output, steps=args.steps, eval_chars=args.eval_chars, cache=cache, train=args.train)
    a, b = result.train_loss
    origin = "shipped with hf_lmc; --train trains it here" if result.shipped else "trained here"
    print(f"GPT-2 pair trained from seeds 0 and 1 ({origin}; final training loss {a:.3f} / {b:.3f} nats per character)")
    print(f"  {result.model_a}\n  {result.model_b}")
    print(f"\nheld-out loss along the path (two unseen plays):\n\n{result.merge.barrier.table()}\n")
    print(f"merged model, card and plot written to {result.merge.output} ({result.seconds:.0f} s)")
    return 0


#: Rough seconds one training step of the demo's GPT-2 takes on one CPU core, and the demo's
#: merge and loss along the path with the imports (benchmarks/demo_time.py measures both).
_DEMO_STEP_SECONDS, _DEMO_MERGE_SECONDS = 0.25, 20


def _demo_plan(args: argparse.Namespace) -> str:
    """One line on what ``hf-lmc demo`` is about to do and roughly how long it takes."""
    merging = f"with weight matching and measuring the loss along the path (about {_DEMO_MERGE_SECONDS} s in all)"
    if not args.train and args.steps is None:
        return f"merging the GPT-2 pair shipped with hf_lmc {merging}"
    steps = 600 if args.steps is None else args.steps  # the zoo's gpt2 entry (hf_lmc.io.zoo is not imported yet)
    minutes = max(1, round(steps * _DEMO_STEP_SECONDS / 60))
    return f"training two GPT-2 models of {steps} steps unless cached (about {minutes} min each; a bar shows each), then merging them {merging}"
