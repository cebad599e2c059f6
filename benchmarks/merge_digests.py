"""Digests of the merged tensors, every method on the shipped zoo pair: merges stay byte-identical.

A refactor that should change nothing for users (issue 57) is checked by running this before and
after: each method merges the zoo's GPT-2 pair (the pair the package ships) through the command
line, with short learned budgets, and the SHA-256 of every written weight tensor's bytes is kept
(the model's weight files only: ``transforms.safetensors``, which aligned merges save beside the
weights, is left out). The record goes under ``benchmarks/results/``; ``--check FILE`` compares
against an earlier record and exits 1 on the first method whose merge differs. Digests are of one machine's arithmetic:
compare records made on the same machine and library versions.

The digests are also what the results tables read as "the code that produced a figure"
(docs/results.md): every suite record carries the digests of the runs behind the methods it
measured (:data:`SUITE_RUNS`), and a suite figure counts as today's only while its runs' digests
are those of the newest record that has them (``benchmarks/tables.py``, D-current-figures).

    python -m benchmarks.merge_digests                     # record
    python -m benchmarks.merge_digests --check benchmarks/results/merge_digests-<date>.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .record import new_record, write

#: (name, extra command-line arguments after the models and output): every method, two and three
#: models, the learned paths on short budgets so the record takes about a minute.
RUNS = (
    ("average", ["--method", "average"]),
    ("weight", ["--method", "weight"]),
    ("weight-permutation", ["--method", "weight", "--symmetries", "permutation"]),
    ("activation", ["--method", "activation", "--data", "{data}", "--max-batches", "4"]),
    ("learned", ["--method", "learned", "--data", "{data}", "--steps", "12", "--max-batches", "8", "--seed", "0"]),
    ("dual", ["--method", "dual", "--data", "{data}", "--steps", "12", "--max-batches", "8", "--seed", "0"]),
    ("dual-target", ["--method", "dual", "--data", "{data}", "--steps", "200", "--max-batches", "8", "--seed", "0"]),
    (
        "learned-permutations",
        [
            *(
                "--method",
                "learned",
                "--symmetries",
                "permutation",
                "--permutations",
                "ste",
                "--trained",
                "permutations",
            ),
            *("--data", "{data}", "--steps", "12", "--max-batches", "8", "--seed", "0"),
        ],
    ),
    ("universe-3", ["--method", "weight", "--third"]),
    (
        "learned-3",
        ["--method", "learned", "--third", "--data", "{data}", "--steps", "8", "--max-batches", "8", "--seed", "0"],
    ),
)

#: The runs behind each row of the benchmark suite (``benchmarks/suite.py``'s labels): a suite
#: figure is the code's of today while these runs' digests are.
SUITE_RUNS: dict[str, tuple[str, ...]] = {
    "vanilla": ("average",),
    "activation": ("activation",),
    "weight": ("weight",),
    "learned (perm. only)": ("learned-permutations",),
    "learned": ("learned",),
    "dual": ("dual", "dual-target"),
}


#: Safetensors files of a merged folder that are not its model's weights: the transforms an
#: aligned merge saves beside them (:data:`hf_lmc.symmetry.stored.TRANSFORMS_FILE`), left out of the digest.
NOT_WEIGHTS = ("transforms.safetensors",)


def tensor_digest(folder: Path) -> str:
    """SHA-256 over every tensor of the folder's weight files (its safetensors files but the saved
    transforms, :data:`NOT_WEIGHTS`, so records made before transforms were saved still compare):
    names, dtypes, shapes, bytes."""
    from safetensors import safe_open

    digest = hashlib.sha256()
    for path in sorted(p for p in folder.glob("*.safetensors") if p.name not in NOT_WEIGHTS):
        with safe_open(str(path), "pt") as handle:
            for name in sorted(handle.keys()):
                tensor = handle.get_tensor(name).contiguous()
                digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
                digest.update(tensor.view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return digest.hexdigest()


def digests(scratch: Path, names: Sequence[str] | None = None) -> dict[str, str]:
    """Run every merge of :data:`RUNS` (those called ``names`` when given) into ``scratch`` and
    return each one's tensor digest."""
    from hf_lmc import cli
    from hf_lmc.io import zoo

    a, b = zoo.pair("gpt2", progress=False)
    data = scratch / "plays.txt"
    data.write_text("\n".join(zoo.shakespeare()[0]))
    found = {}
    for name, extra in RUNS:
        if names is not None and name not in names:
            continue
        models = [str(a), str(b)]
        extra = [arg.replace("{data}", str(data)) for arg in extra]
        if "--third" in extra:
            extra.remove("--third")
            models.append(str(a))
        output = scratch / name
        code = cli.main(["merge", *models, "--output", str(output), "--quiet", *extra])
        if code not in (0, None):
            raise SystemExit(f"{name}: hf-lmc merge exited {code}")
        found[name] = tensor_digest(output)
        print(f"{name}: {found[name][:16]}", file=sys.stderr)
    return found


def for_labels(labels: Sequence[str]) -> dict[str, str]:
    """The digests of the runs behind the suite's rows ``labels`` (:data:`SUITE_RUNS`), made in a
    scratch folder: what a suite record carries as the code its figures came from."""
    names = sorted({name for label in labels for name in SUITE_RUNS.get(label, ())})
    if not names:
        return {}
    with tempfile.TemporaryDirectory(prefix="hf-lmc-digests-") as scratch:
        return digests(Path(scratch), names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", type=Path, default=None, metavar="FILE", help="compare with this earlier record")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="where to write the record")
    args = parser.parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    record = new_record("merge_digests", {"runs": {name: extra for name, extra in RUNS}})
    with tempfile.TemporaryDirectory(prefix="hf-lmc-digests-") as scratch:
        record["digests"] = digests(Path(scratch))
    if args.check is None:
        print(f"written to {write(record, args.json)}")
        return 0
    earlier = json.loads(args.check.read_text())["digests"]
    differ = [name for name, value in record["digests"].items() if earlier.get(name) != value]
    for name in record["digests"]:
        print(f"| {name} | {'same' if name not in differ else 'DIFFERS'} |")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
