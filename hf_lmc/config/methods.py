"""The alignment methods, one registry entry each.

An entry says what a method needs (data, how many models), what it moves, which class fits it
(a matcher, or a trainable path that :class:`~hf_lmc.learned.TrainedMatcher` trains), and how
the model card and the README describe it. The command line's choices, the recipe schema's
enum, the README's methods table (``python -m hf_lmc.config.methods README.md`` writes it) and the
card's wording all read this table; :func:`hf_lmc.merging.alignment.matcher_for` builds the matcher an
entry names. Adding a method is adding an entry (and its matcher or path).

The module imports neither torch nor transformers, so ``hf-lmc --help`` can list the methods.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from hf_lmc.config.options import ParameterError, UsageError


@dataclass(frozen=True)
class Method:
    """One alignment method.

    Attributes:
        name: what the CLI, recipes and the API call it.
        needs_data: whether it reads data (calibration batches or training batches).
        multi: whether it merges more than two models.
        trained: whether its transforms are trained (soft permutations are hardened before export).
        moves: what it moves, two models / three or more.
        pair_class, many_class: the class in :mod:`hf_lmc.matching` or :mod:`hf_lmc.learned` that fits it for two
            models / for more (``None``: the method has no transforms, or no form for that
            count). A search method names its matcher; a trained method names its trainable
            path, which :class:`~hf_lmc.learned.TrainedMatcher` trains under the matcher
            contract (for more than two models in its simplex form, :class:`~hf_lmc.SimplexMatcher`).
        pair_card, many_card: how the model card says the models were aligned (two / more).
        when: when to choose it (the README's methods table).
    """

    name: str
    needs_data: bool
    multi: bool
    trained: bool
    moves: str
    pair_class: str | None
    many_class: str | None
    pair_card: str
    many_card: str
    when: str


METHODS: dict[str, Method] = {
    method.name: method
    for method in (
        Method(
            "average",
            needs_data=False,
            multi=True,
            trained=False,
            moves="nothing",
            pair_class=None,
            many_class=None,
            pair_card="",
            many_card="",
            when="the unaligned baseline: a plain weighted average of the stored weights",
        ),
        Method(
            "weight",
            needs_data=False,
            multi=True,
            trained=False,
            moves="B; with 3+ models every model (universe matching)",
            pair_class="WeightMatcher",
            many_class="UniverseMatcher",
            pair_card="model B was aligned to model A by data-free weight matching over its function-preserving symmetries, ",
            many_card="aligned to one shared reference by universe weight matching (each model matched without data, over "
            "its function-preserving symmetries, to the weighted average of the others as aligned so far, repeated until "
            "that average settled), ",
            when="the default: data-free, streamed layer by layer, fit for billion-parameter checkpoints",
        ),
        Method(
            "activation",
            needs_data=True,
            multi=False,
            trained=False,
            moves="B",
            pair_class="ActivationMatcher",
            many_class=None,
            pair_card="model B was aligned to model A by matching their activations on calibration data over the "
            "function-preserving symmetries, ",
            many_card="",
            when="the same structure with costs from activations, when calibration data is at hand",
        ),
        Method(
            "learned",
            needs_data=True,
            multi=True,
            trained=True,
            moves="B; with 3+ models all but the first",
            pair_class="LearnedMatcher",
            many_class="LearnedMatcher",
            pair_card="model B's symmetry transform was learned (from the weight-matching solution) to lower the loss "
            "along the linear path, ",
            many_card="aligned by universe weight matching, and then every model's but the first's symmetry transform was "
            "learned to lower the loss over the simplex the aligned models span (weights drawn from a Dirichlet "
            "distribution), ",
            when="to flatten the path beyond weight matching: B's transform trained on the loss along the path",
        ),
        Method(
            "dual",
            needs_data=True,
            multi=True,
            trained=True,
            moves="A and B; with 3+ models every model",
            pair_class="DualMatcher",
            many_class="DualMatcher",
            pair_card="both models' symmetry transforms were learned (dual matching, from the weight-matching solution) "
            "toward one shared low-loss linear path, ",
            many_card="aligned by universe weight matching, and then every model's symmetry transform was learned to lower "
            "the loss over the simplex the aligned models span (weights drawn from a Dirichlet distribution), ",
            when="the same with both transforms trained; for long schedules",
        ),
    )
}

NAMES = tuple(METHODS)


def method(name: str) -> Method:
    """The entry called ``name``; a one-line error listing the methods otherwise."""
    try:
        return METHODS[name]
    except KeyError:
        raise UsageError(f"unknown method {name!r}; choose from {', '.join(NAMES)}") from None


def check_method(name: str, data, count: int = 2, data_parameter: str = "data") -> Method:
    """The entry for ``name``; fails early, saying what to do, for an unknown method, a two-model
    method given ``count`` > 2 models, or a data method without data."""
    entry = method(name)
    if count > 2 and not entry.multi:
        multi = ", ".join(m.name for m in METHODS.values() if m.multi)
        raise UsageError(f"method {name!r} aligns two models; for {count} use one of {multi}")
    if entry.needs_data and data is None:
        raise ParameterError(
            f"method {name!r} learns from data: pass {{}} (a text file or folder, a datasets id, .pt tensors for ViT, "
            "or 'sampled' for text sampled from the language models themselves)",
            data_parameter,
        )
    return entry


TABLE_START, TABLE_END = "<!-- methods-table:start -->", "<!-- methods-table:end -->"


def markdown_table() -> str:
    """The README's methods table."""
    rows = ["| method | needs data | models | what moves | when to use |", "|---|---|---|---|---|"]
    for m in METHODS.values():
        data = ("yes (training)" if m.trained else "yes (calibration)") if m.needs_data else "no"
        rows.append(f"| `{m.name}` | {data} | {'2 or more' if m.multi else '2'} | {m.moves} | {m.when} |")
    return "\n".join(rows)


def with_table(document: str) -> str:
    """``document`` with the text between the table's markers replaced by :func:`markdown_table`."""
    head, start, rest = document.partition(TABLE_START)
    _, end, tail = rest.partition(TABLE_END)
    if not (start and end):
        raise ValueError(f"the document has no {TABLE_START} ... {TABLE_END} block")
    return f"{head}{start}\n{markdown_table()}\n{end}{tail}"


if __name__ == "__main__":  # python -m hf_lmc.config.methods [README.md]: print the table, or write it into the file
    if len(sys.argv) > 1:
        path = Path(sys.argv[1])
        path.write_text(with_table(path.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        sys.stdout.write(markdown_table() + "\n")
