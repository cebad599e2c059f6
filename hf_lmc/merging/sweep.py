"""Running a recipe: every (group of models, method) is one merge, and one summary covers them all.

A recipe is a list of merges: each (group, method) becomes one :class:`hf_lmc.config.options.MergeRequest`
(:func:`run_request`) that :func:`hf_lmc.merging.pipeline.run` carries out. Models are resolved once per recipe (zoo members trained or read from
the cache, PEFT adapters folded into their base model), data sets are loaded once, and every
merge, model card and summary is written into a staging folder that is renamed onto
``output.dir`` once every run has been tried, and nothing is pushed to the Hub until then.

A run that fails (a model with a NaN weight, models that cannot be merged, a file missing) is
recorded in the summary with its error, what it half-wrote is removed, and the sweep goes on
with the next run; ``output.fail_fast`` stops it at the first failure instead. Either way the
merges that finished and the summary are moved into place (and pushed), and the main process
then raises :class:`RecipeFailedError`. An interrupt (Ctrl-C, SIGTERM) keeps nothing.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import logging
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from peft import PeftModel

from hf_lmc.canonical.adapters import read_config
from hf_lmc.canonical.widths import check_mergeable
from hf_lmc.config.methods import METHODS
from hf_lmc.config.options import (
    EVAL_OPTIONS,
    FIT_OPTIONS,
    PATH_POINTS,
    MergeRequest,
    escape_controls,
)
from hf_lmc.config.recipe import (
    SUMMARY,
    ZOO_PREFIX,
    DataSection,
    ModelRef,
    Recipe,
    RecipeError,
    RecipeModelError,
    check_outputs,
    load_recipe,
    parse_zoo_member,
)
from hf_lmc.evaluation.batches import SAMPLED, DataError, read_text_file
from hf_lmc.io import zoo
from hf_lmc.io.export import PROCESSOR_FILES
from hf_lmc.io.hub import (
    NoModelAtRevisionError,
    check_push,
    names_local_path,
    no_model_message,
    not_found_error,
    push_folder,
    pushed_repo,
    resolve_checkpoint,
    shown_settings,
)
from hf_lmc.io.inherit import copy_model_file
from hf_lmc.io.loading import load_model
from hf_lmc.io.outputs import (
    discard,
    mark,
    move_into_place,
    staging_folder,
)
from hf_lmc.merging import pipeline
from hf_lmc.utils.devices import computed_on_main, launched_count, launched_processes, wait_for_others
from hf_lmc.utils.progress import bar as progress_bar

logger = logging.getLogger(__name__)


class RunFailedError(ValueError):
    """One run of a recipe failed on what it read or wrote (its models, data, disk or the Hub);
    the message names the run. A recipe that cannot run as written is a :class:`RecipeError`."""


class RecipeFailedError(RunFailedError):
    """Runs of a recipe failed, and the recipe kept what it finished: the merges that succeeded
    are in ``output.dir`` (and pushed) with the summary, which records each failure with its
    error. ``result`` is the :class:`RecipeResult` as written; the message names the first failure."""

    def __init__(self, message: str, result: RecipeResult):
        super().__init__(message)
        self.result = result


#: A run's status in the summary: merged, failed (with its error), or not run because an
#: earlier run failed under ``output.fail_fast``.
OK, FAILED, SKIPPED = "ok", "failed", "skipped"


@dataclass(frozen=True)
class RunResult:
    """One merge of a recipe and the barriers measured on its path (empty without ``eval``); a
    run that failed has ``status`` :data:`FAILED` and its one-line ``error``, one never started
    (``output.fail_fast``) :data:`SKIPPED`."""

    group: str
    method: str
    models: list[str]
    folder: Path
    barriers: dict[str, float] = field(default_factory=dict)
    url: str | None = None
    status: str = OK
    error: str | None = None

    @property
    def barrier(self) -> float | None:
        """The barrier of the run's own method (``None`` without ``eval`` or when it failed)."""
        return self.barriers.get(self.method)

    @property
    def ok(self) -> bool:
        """Whether the run merged (its folder is in the recipe's output)."""
        return self.status == OK


@dataclass(frozen=True)
class RecipeResult:
    """Where a recipe's output went, and one row per run."""

    output: Path
    runs: list[RunResult]
    title: str = "hf-lmc recipe"
    recipe: dict[str, Any] = field(default_factory=dict)  # the validated recipe, defaults filled in (for summary.json)
    wrote: bool = True  # False on every launched process but the main one, which writes (and reports) the output

    @property
    def failed(self) -> list[RunResult]:
        """The runs that failed (not those skipped after one did)."""
        return [run for run in self.runs if run.status == FAILED]

    def table(self) -> str:
        """Markdown: barrier per group of models (rows) and method (columns), the average first;
        a run that failed, or was skipped after one failed (``output.fail_fast``), shows its status
        in its cell."""
        unfinished = {(run.group, run.method): run.status for run in self.runs if not run.ok}
        methods = list(dict.fromkeys(m for run in self.runs for m in run.barriers))
        if not methods and not unfinished:
            return "no barriers measured (add an eval section to the recipe)"
        methods = list(dict.fromkeys([*methods, *(run.method for run in self.runs)]))
        methods.sort(key=lambda m: m != "average")
        rows = ["| models | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
        for group in dict.fromkeys(run.group for run in self.runs):
            measured = {}
            for run in (r for r in self.runs if r.group == group):
                for method, value in run.barriers.items():
                    measured.setdefault(method, value)
            cells = [unfinished.get((group, m)) or (f"{measured[m]:.4f}" if m in measured else "—") for m in methods]
            rows.append(f"| {group} | " + " | ".join(cells) + " |")
        if not any(run.barriers for run in self.runs):
            rows.append("\nno barriers measured (add an eval section to the recipe)")
        return "\n".join(rows)

    def records(self) -> list[dict[str, Any]]:
        """One flat record per run (the JSON and CSV summaries): a failed run has its status,
        its error and no folder."""
        out = []
        for run in self.runs:
            vanilla = run.barriers.get("average")
            ratio = run.barrier / vanilla if run.barrier is not None and vanilla and vanilla > 0 else None
            out.append(
                {
                    "group": run.group,
                    "method": run.method,
                    "status": run.status,
                    "models": run.models,
                    "folder": str(run.folder) if run.ok else None,
                    "barrier": run.barrier,
                    "average_barrier": vanilla,
                    "ratio_to_average": ratio,
                    "url": run.url,
                    "error": _shareable(run.error) if run.error else None,
                }
            )
        return out


def run_recipe(
    recipe: Recipe | str | Path | Mapping[str, Any],
    *,
    overrides: Mapping[str, Any] | None = None,
    progress: bool = True,
    api=None,
) -> RecipeResult:
    """Execute a recipe (a :class:`Recipe`, a YAML path or a mapping) and return its summary.

    ``overrides`` maps dotted keys to values (``{"zoo.steps": 50}``) before validation. The
    merged models land in ``output.dir`` (``<group>/<method>/`` for a sweep, ``<method>/``
    otherwise) beside ``summary.md``, ``summary.json`` and ``summary.csv``. ``api`` stands in for
    ``huggingface_hub.HfApi`` when pushing.

    When runs fail, the merges that finished and the summary (which records each failure) are
    written all the same, and :class:`RecipeFailedError` is raised, its ``result`` the summary;
    under a launcher the main process raises it, the others return their result (``wrote`` false).
    """
    given = recipe
    if not isinstance(recipe, Recipe) or overrides:
        recipe = load_recipe(recipe.model_dump() if isinstance(recipe, Recipe) else recipe, overrides)
    started = launched_count()
    if recipe.launch.processes and recipe.launch.processes != started:
        path = str(given) if isinstance(given, (str, Path)) else "RECIPE.yaml"
        raise RecipeError(
            f"launch.processes: the recipe runs as {recipe.launch.processes} processes, this launch started {started}; "
            f"start it with {recipe.launch.command(path) or f'hf-lmc run {path}'}"
        )
    processes = launched_processes()  # under torchrun / accelerate launch: one process writes (see pipeline.run)
    main = processes is None or processes.is_main_process
    final = Path(recipe.output.dir)
    check_outputs(recipe, given)
    if recipe.output.push_to_hub and main:  # a push that cannot succeed is found before the first merge
        targets = [recipe.output.push_to_hub.format(group=g, method=m) for g, m, _ in recipe.runs()]
        for target in {t.partition("/")[0] if "/" in t else "": t for t in targets}.values():  # one per namespace
            user = check_push(target, api=api)
        if "/" not in recipe.output.push_to_hub:  # a bare name (push_to_hub: true) is the token's user's
            output = recipe.output.model_copy(update={"push_to_hub": pushed_repo(recipe.output.push_to_hub, user)})
            recipe = recipe.model_copy(update={"output": output})
    # Data problems surface before any model is trained, downloaded or aligned.
    needs_data = any(METHODS[m].needs_data for m in recipe.method)
    fit_data = load_data(recipe.data, "train") if recipe.data is not None and needs_data else None
    eval_data = load_data(recipe.eval.data, "test") if recipe.eval is not None else None

    made_with = _recipe_markdown(recipe, given)
    wait_for_others(processes)  # every process has checked the recipe before the main one stages anything
    staging = computed_on_main(lambda: staging_folder(final))  # every process names the main one's staging folder
    planned = recipe.runs()
    try:
        with tempfile.TemporaryDirectory(prefix="hf-lmc-adapters-") as scratch:
            resolver = _ModelResolver(recipe, Path(scratch), progress)
            runs: list[RunResult] = []
            bar = progress_bar(planned, desc="recipe runs", unit="merge", show=progress)
            for group, method, refs in bar:
                bar.set_postfix_str(f"{group} / {method}")
                logger.info("run %s / %s: %s", group, method, ", ".join(ref.label for ref in refs))
                folder = recipe.run_folder(group, method)
                barriers, error = {}, None
                try:
                    # zoo members: trained once, then read from the cache
                    sources = _resolved(resolver, refs, processes)
                    request = run_request(
                        recipe, method, sources, staging / folder, fit_data, eval_data, folder
                    ).model_copy(
                        update={
                            "labels": tuple(s.label if s.relabel else None for s in sources),
                            "made_with": made_with,
                            # the card names the run's Hub repo, or its folder in output.dir, not the staging folder
                            "repo_hint": (recipe.output.push_to_hub or "").format(group=group, method=method)
                            or (Path(final.name) / folder).as_posix(),
                        }
                    )
                    merged = pipeline.run(request, progress=progress)
                    barriers = dict(getattr(merged.barrier, "barriers", None) or {})  # none without eval
                    if main:
                        _relabel_card(staging / folder, {str(s.reference): s.label for s in sources if s.relabel})
                except Exception as err:  # any failure of one run is recorded, and the sweep goes on
                    logger.debug("run %s / %s failed", group, method, exc_info=True)  # the traceback, under -vv
                    error = _run_error(err).replace(str(staging), str(final))  # the output, not its staging
                error = _agreed(processes, error)  # the main process's outcome is every process's
                labels = [ref.label for ref in refs]
                if error is None:
                    runs.append(RunResult(group, method, labels, folder, barriers))
                    continue
                runs.append(RunResult(group, method, labels, folder, status=FAILED, error=error))
                if main:
                    _remove_unfinished(staging, folder)
                    then = "output.fail_fast: the recipe stops" if recipe.output.fail_fast else "the recipe goes on"
                    logger.warning("run %s / %s failed (%s): %s", group, method, then, error)
                if recipe.output.fail_fast:
                    runs += [
                        RunResult(g, m, [ref.label for ref in r], recipe.run_folder(g, m), status=SKIPPED)
                        for g, m, r in planned[len(runs) :]
                    ]
                    break
        targets = {run.folder: _push_target(recipe, run) for run in runs if run.ok}
        result = RecipeResult(final, runs, recipe.name or "hf-lmc recipe", recipe.model_dump(mode="json"))
        if not main:  # the main process finishes, moves and pushes
            processes.wait_for_everyone()
            return dataclasses.replace(result, wrote=False)
        for run in runs:  # cards name the final folder (or Hub repo), not the staging one
            if run.ok:
                shown = targets[run.folder] or (Path(final.name) / run.folder).as_posix()  # no path of this machine
                _relabel_card(staging / run.folder, {str(staging / run.folder): shown})
        write_summary(result, staging)
        move_into_place(staging, final, kind="recipe", overwrite=recipe.output.overwrite, what="output.dir")
    except BaseException:
        if main:
            discard(staging)
        raise
    if recipe.output.push_to_hub and any(run.ok for run in runs):
        pushed = [
            dataclasses.replace(
                run, url=push_folder(final / run.folder, targets[run.folder], private=recipe.output.private, api=api)
            )
            if run.ok
            else run
            for run in runs
        ]
        result = dataclasses.replace(result, runs=pushed)
        write_summary(result, final)
        mark(final, "recipe")
    wait_for_others(processes)
    if result.failed:
        first, merged_count = result.failed[0], sum(run.ok for run in result.runs)
        more = f" (and {len(result.failed) - 1} more failed run(s))" if len(result.failed) > 1 else ""
        raise RecipeFailedError(
            f"{first.group} / {first.method}: {first.error}{more}; {merged_count} of {len(result.runs)} run(s) merged, "
            f"each failure recorded in {final / SUMMARY}.md",
            result,
        )
    return result


def _resolved(resolver: _ModelResolver, refs: Sequence[ModelRef], processes) -> list[_Source]:
    """The run's models as the merge reads them, resolved by the main process first (zoo members
    are trained once, then read from the cache by the others). The processes meet once, whatever
    the main process met: its failure is every process's, so that none goes on into the merge alone."""
    if processes is None:
        return [resolver(ref) for ref in refs]
    sources, failure = None, None
    if processes.is_main_process:
        try:
            sources = [resolver(ref) for ref in refs]
        except Exception as err:  # noqa: BLE001 (raised below, once the others have it)
            failure = err
    error = _agreed(processes, None if failure is None else _run_error(failure))
    if failure is not None:
        raise failure
    if error is not None:
        raise RunFailedError(error)
    return sources if sources is not None else [resolver(ref) for ref in refs]


def _agreed(processes, value):
    """``value`` as the main process has it, on every launched process (a collective: every
    process calls it); in a one-process run, ``value`` itself."""
    return value if processes is None else computed_on_main(lambda: value)


def _run_error(err: BaseException) -> str:
    """A failed run's error as the summary records it: one line, control characters escaped, and
    the kind of error named where it is not one hf_lmc words for users (a ValueError or OSError)."""
    text = str(err).strip() or type(err).__name__
    if not isinstance(err, (ValueError, OSError)):
        text = f"{type(err).__name__}: {text}"
    return escape_controls(text, 2000)


#: An absolute local path in a message (``/...`` or ``~/...``), up to the quote, space or
#: punctuation that ends it.
_LOCAL_PATH = re.compile(r"(?<![\w.~/-])~?/[^\s'\"`,;:()\[\]{}<>]+")


def _shareable(text: str) -> str:
    """``text`` (a run's error) as a summary records it: every absolute local path reduced to its
    last part, as the cards name local models (:func:`hf_lmc.io.hub.shown_reference`), so that a
    summary shared or committed does not carry the layout of this machine."""
    return _LOCAL_PATH.sub(lambda found: Path(found.group()).name or found.group(), text)


def _remove_unfinished(staging: Path, folder: Path) -> None:
    """Remove what a failed run left in the recipe's staging folder (a folder this run made and
    holds): its run folder, and the group folder above it once that is empty, so that the marker
    written at the end accounts for everything in the output (an empty folder it does not list
    would make ``output.overwrite`` refuse the output later)."""
    shutil.rmtree(staging / folder, ignore_errors=True)
    for parent in (staging / folder).parents:
        if parent == staging or not parent.is_relative_to(staging):
            break
        with contextlib.suppress(OSError):  # not empty: another run's folder is in it
            parent.rmdir()


def _recipe_markdown(recipe: Recipe, given) -> str:
    """The card's Reproduce text of a recipe's merges: the recipe as it ran (overrides applied,
    defaults left out), and the command that runs it."""
    text = yaml.safe_dump(shown_settings(recipe.model_dump(mode="json", exclude_defaults=True)), sort_keys=False)
    name = Path(given).name if isinstance(given, (str, Path)) else "recipe.yaml"
    return (
        f"It was made by the recipe `{name}`, shown as it ran (`--set` changes applied, defaults left out, local paths "
        f"reduced to their last part); save it and run `hf-lmc run {name}`:\n\n```yaml\n{text}```"
    )


def run_request(
    recipe: Recipe,
    method: str,
    sources: Sequence[_Source],
    output: Path,
    fit_data,
    eval_data,
    folder: Path | None = None,
) -> MergeRequest:
    """The one merge of ``sources`` by ``method`` that ``recipe`` asks for, written to ``output``
    (pushed later, once every run has succeeded); ``folder`` is the run's folder in the recipe's
    output, which names its training state under ``accelerate.checkpoint_dir``."""
    weights = recipe.alpha_or_weights(len(sources))
    if len(sources) == 2:
        weights = (1 - weights, weights)
    out = recipe.output
    accelerate = recipe.accelerate
    if accelerate.checkpoint_dir is not None:  # one folder of training state per merge
        accelerate = accelerate.model_copy(
            update={"checkpoint_dir": str(Path(accelerate.checkpoint_dir) / (folder or output.name))}
        )
    return MergeRequest(
        models=[s.reference for s in sources],
        revisions=[s.revision for s in sources],
        output=output,
        weights=weights,
        method=method,
        symmetries=recipe.symmetries,
        device=recipe.device,
        data=fit_data,
        data_options=recipe.data.options(FIT_OPTIONS) if recipe.data else FIT_OPTIONS,
        learn=recipe.learn,
        accelerate=accelerate,
        eval_data=eval_data,
        eval_options=recipe.eval.data.options(EVAL_OPTIONS) if recipe.eval else EVAL_OPTIONS,
        alphas=recipe.eval.alphas if recipe.eval else PATH_POINTS,
        dtype=out.dtype,
        shard_size=out.shard_size,
        inherit_from_a=out.inherit_from_a,
        tokenizer_from=out.tokenizer_from,
        eval_data_name=_data_name(recipe.eval.data) if recipe.eval else None,
    )


def _data_name(section: DataSection) -> str:
    """How a card's ``model-index`` names a recipe's data: a ``dataset`` as given (a Hub id is
    named as one), files and zoo data as local data."""
    if section.dataset is not None:
        return section.dataset
    if section.files is not None:
        return ", ".join(shown_settings(section.files))
    return f"zoo:{section.zoo} (text shipped with hf_lmc)" if section.zoo is not None else SAMPLED


def write_summary(result: RecipeResult, folder: Path) -> None:
    """``summary.md`` (the barrier table), ``summary.json`` and ``summary.csv`` (one row per run,
    with its status: ok, failed with its error, or skipped), each written to a temporary file and
    renamed, so a reader never sees half a file. The recipe is recorded with local paths by their
    last part, like the cards: a summary shared or committed does not carry the layout of this
    machine."""
    records = result.records()
    markdown = (
        f"# {result.title}\n\nLoss barrier per group of models and method (lower is flatter).\n\n{result.table()}\n\n"
    )
    markdown += "\n".join(
        f"- `{r['group']}` / `{r['method']}`: {_outcome(r)} ({', '.join(r['models'])})" for r in records
    )
    markdown += "\n"
    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=list(records[0]) if records else ["group"])
    writer.writeheader()
    writer.writerows({**r, "models": " ".join(r["models"])} for r in records)
    summary = {
        "title": result.title,
        "runs": records,
        "recipe": shown_settings(result.recipe),
    }  # no path of this machine
    for suffix, text in (("md", markdown), ("json", json.dumps(summary, indent=2) + "\n"), ("csv", table.getvalue())):
        target = folder / f"{SUMMARY}.{suffix}"
        partial = target.with_name(f".{target.name}.tmp")
        partial.write_text(text, encoding="utf-8")
        partial.replace(target)


def _outcome(record: Mapping[str, Any]) -> str:
    """What became of a run, as ``summary.md`` lists it: its folder, or its status and error."""
    if record["status"] == OK:
        return f"`{record['folder']}`"
    return f"**{record['status']}**" + (f": {record['error']}" if record["error"] else "")


# -- data ------------------------------------------------------------------------------------


def load_data(section: DataSection, default_split: str):
    """The data of ``section`` in a form :func:`hf_lmc.evaluation.batches.load_batches` reads (loaded once
    per recipe; tokenisation follows per merge, with model A's tokenizer)."""
    if section.sampled:
        return SAMPLED
    split = section.split or default_split
    if section.zoo is not None:
        if section.zoo == "digits":
            return zoo.digits()[0 if split == "train" else 1]
        if split == "train":
            return zoo.shakespeare()[0]
        size = (section.samples or 256) * (section.seq_len or 128)
        return zoo.held_out("gpt2", size=max(4096, size))  # excerpts spread over both held-out plays
    if section.files is not None:
        return _files(section.files, split)
    if section.name is None and Path(section.dataset).exists():
        return section.dataset  # a text file / folder or a dataset saved with save_to_disk: load_batches reads it
    import datasets

    try:
        return datasets.load_dataset(section.dataset, section.name, split=split)
    except Exception as err:  # datasets raises many types; the user needs one clear line
        config = f" (configuration {section.name})" if section.name else ""
        raise DataError(
            f"cannot load dataset {section.dataset!r}{config}, split {split!r}: {_first_line(err)}"
        ) from err


_DATASET_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def _files(files: list[str], split: str):
    paths = [Path(f) for f in files]
    missing = next((p for p in paths if not p.exists()), None)
    if missing is not None:
        raise DataError(f"no such data file: {missing}")
    suffixes = {p.suffix.lower() for p in paths if p.is_file()}
    if suffixes & set(_DATASET_BUILDERS):
        builders = {_DATASET_BUILDERS.get(s) for s in suffixes}
        if len(builders) != 1 or None in builders or any(p.is_dir() for p in paths):
            raise DataError(
                f"files mixes kinds ({', '.join(sorted(suffixes))}); list .json/.jsonl, .csv or .parquet files of one kind"
            )
        import datasets

        try:
            return datasets.load_dataset(builders.pop(), data_files=[str(p) for p in paths], split="train")
        except Exception as err:
            raise DataError(f"cannot read {', '.join(files)}: {_first_line(err)}") from err
    if len(paths) == 1:
        return str(paths[0])  # a .txt file, a folder of them, or a .pt tensor file
    if any(p.is_dir() or p.suffix.lower() != ".txt" for p in paths):
        raise DataError("several files must all be .txt files; list one folder or one .pt file on its own")
    return [read_text_file(p) for p in paths]


# -- models ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Source:
    reference: str  # what the merge reads: a Hub id or a local folder
    revision: str | None
    label: str  # how the recipe named it
    relabel: bool  # the card should name ``label`` instead of ``reference`` (a cache or scratch folder)


class _ModelResolver:
    """Turns recipe models into what :func:`merge` reads, once each: zoo members are trained (or
    read from the zoo cache), adapters are folded into their base model in ``scratch``."""

    def __init__(self, recipe: Recipe, scratch: Path, progress: bool):
        self.recipe, self.scratch, self.progress = recipe, scratch, progress
        self.done: dict[ModelRef, _Source] = {}

    def __call__(self, ref: ModelRef) -> _Source:
        if ref not in self.done:
            self.done[ref] = self._resolve(ref)
        return self.done[ref]

    def _resolve(self, ref: ModelRef) -> _Source:
        if ref.path.startswith(ZOO_PREFIX):
            source = _Source(str(self._zoo_member(ref.path)), None, ref.path, True)
        else:
            source = _Source(ref.path, ref.revision, ref.path, False)
        if ref.adapter is None:
            return source
        folder = self.scratch / f"{len(self.done)}-{Path(ref.path).name}+{Path(ref.adapter).name}"
        fold_adapter(
            source.reference, ref.adapter, folder, revision=source.revision, adapter_revision=ref.adapter_revision
        )
        return _Source(str(folder), None, ref.label, True)

    def _zoo_member(self, reference: str) -> Path:
        name, seed = parse_zoo_member(reference)
        entry, steps = zoo.ZOO[name], self.recipe.zoo.steps
        if steps is not None:
            entry = entry.scaled(steps=steps, warmup=min(entry.warmup, max(1, steps // 10)))
        cache = Path(self.recipe.zoo.cache) if self.recipe.zoo.cache else None
        return zoo.train(entry, seed, cache=cache, progress=self.progress)


def fold_adapter(
    model: str | Path,
    adapter: str | Path,
    output: Path,
    *,
    revision: str | None = None,
    adapter_revision: str | None = None,
) -> Path:
    """Merge a PEFT adapter into its base model (``merge_and_unload``) and save the result as a
    stock checkpoint in ``output``, with the base's tokenizer / processor files and card (for its
    license), so the merge pipeline reads it like any other model."""
    base = load_model(model, revision)
    try:
        adapter_folder = resolve_checkpoint(adapter, adapter_revision)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"PEFT adapter: {err}") from err
    try:
        folded = PeftModel.from_pretrained(base.model, str(adapter_folder)).merge_and_unload()
    except Exception as err:  # peft and the Hub raise many types; the user needs one clear line
        raise ValueError(f"cannot apply PEFT adapter {adapter} to {model}: {_first_line(err)}") from err
    folded.save_pretrained(output)
    for name in (*PROCESSOR_FILES, "README.md") if base.folder is not None else ():
        copy_model_file(base.folder, name, output / name)  # regular files inside the base's folder only
    return output


# -- output ----------------------------------------------------------------------------------


def _push_target(recipe: Recipe, run: RunResult) -> str | None:
    template = recipe.output.push_to_hub
    return template.format(group=run.group, method=run.method) if template else None


def _relabel_card(folder: Path, names: Mapping[str, str]) -> None:
    """Have the model card name models and folders as the recipe does: zoo members and folded
    adapters by their recipe name rather than a cache or scratch folder, the merge by its final
    folder or Hub repo rather than the staging folder."""
    card = folder / "README.md"
    if not names or not card.is_file():
        return
    text = card.read_text(encoding="utf-8")
    for old in sorted(names, key=len, reverse=True):
        text = text.replace(old, names[old])
    card.write_text(text, encoding="utf-8")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# -- the configs of a recipe's models, compared before any run (``hf-lmc recipe check``) --


def unpinned_models(recipe: Recipe) -> list[str]:
    """The recipe's Hub models (and adapters) read at no pinned revision, each once, with the key
    that holds it: what they merge changes when the repo's default branch does, and some repos keep
    no model there at all (PolyPythia's checkpoints live on ``step…`` branches)."""
    entries = recipe.sweep if recipe.sweep is not None else [None]
    found: dict[str, str] = {}
    for index, (entry, (_, refs)) in enumerate(zip(entries, recipe.groups)):
        for k, ref in enumerate(refs):
            key = f"sweep[{index}].models[{k}]" if entry is not None else f"models[{k}]"
            for path, revision, name in (
                (ref.path, ref.revision, "revision"),
                (ref.adapter, ref.adapter_revision, "adapter_revision"),
            ):
                if path is None or path.startswith(ZOO_PREFIX) or revision is not None or "@" in path:
                    continue
                if not names_local_path(path) and path not in found:
                    found[path] = f"{key}.{name}"
    return [
        f"{path} is read at the Hub's default branch, not a pinned revision: set {key}" for path, key in found.items()
    ]


def check_models(recipe: Recipe, given=None) -> list[str]:
    """Compare the configs of each group's models with the check the merge runs on them before it
    reads a weight (:func:`hf_lmc.canonical.widths.check_mergeable`), reading ``config.json`` alone: a local
    folder's directly, a Hub model's from the Hub cache or downloaded alone, a zoo member's made
    from its entry (a model with an ``adapter`` by its base model's). A group no merge covers, or a
    config the merge could not read either, raises :class:`RecipeModelError`, one line naming the
    recipe ``given``, the group or key, and the models. A config that is not at hand here is left out of the comparison, not refused (the
    recipe may be meant for another machine): returns one line per reason saying which models'
    configs were not compared, empty when every one was."""
    where = str(given) if isinstance(given, (str, Path)) else "recipe"
    reader = _ConfigReader(where)
    entries = recipe.sweep if recipe.sweep is not None else [None]
    for index, (entry, (group, refs)) in enumerate(zip(entries, recipe.groups)):
        keys = [f"sweep[{index}].models[{k}]" if entry is not None else f"models[{k}]" for k in range(len(refs))]
        found = [(ref, config) for ref, key in zip(refs, keys) if (config := reader(ref, key)) is not None]
        if len(found) < 2:
            continue
        names = [_model_name(ref) for ref, _ in found]
        what = f"sweep entry {group!r}" if entry is not None else "the models"
        try:
            widths = [
                note
                for (_, config), name in zip(found[1:], names[1:])
                for note in check_mergeable(found[0][1], config, names[0], name)
            ]
            if widths and len(refs) > 2:  # as the merge refuses them (hf_lmc.merging.pipeline)
                raise ValueError(
                    f"models of different widths merge two at a time, got {len(refs)} models ({widths[0]})"
                )
        except ValueError as err:
            raise RecipeModelError(
                f"{where}: {what} ({', '.join(_model_name(ref) for ref in refs)}) cannot be merged: {err}"
            ) from None
    return reader.skipped()


def _model_name(ref: ModelRef) -> str:
    """A model as a message on this machine names it: its path as written (a local path in full)."""
    return ref.path + (f"@{ref.revision}" if ref.revision else "")


class _ConfigReader:
    """Reads each model's config once (``None`` where it cannot be read here), and records which
    were left out and why."""

    def __init__(self, where: str):
        self.where = where  # the recipe, as messages name it
        self.configs: dict[tuple[str, str | None], Any] = {}
        self.left_out: dict[str, list[str]] = {}
        self.unreachable: str | None = None  # why the Hub could not be reached, once it was not

    def __call__(self, ref: ModelRef, key: str):
        reference = (ref.path, ref.revision)
        if reference not in self.configs:
            self.configs[reference] = self._read(ref, key)
        return self.configs[reference]

    def skipped(self) -> list[str]:
        """One line per reason: the models whose configs were not compared."""
        return [
            f"configs not compared, {why}: {', '.join(dict.fromkeys(models))}" for why, models in self.left_out.items()
        ]

    def _leave_out(self, ref: ModelRef, why: str) -> None:
        self.left_out.setdefault(why, []).append(_model_name(ref))

    def _read(self, ref: ModelRef, key: str):
        if ref.path.startswith(ZOO_PREFIX):
            return zoo.build_config(zoo.ZOO[parse_zoo_member(ref.path)[0]])
        try:
            folder = self._folder(ref, key)
            if folder is None:
                return None
            return read_config(folder)
        except RecipeError:
            raise
        except (ValueError, OSError) as err:  # the file or the repo is named in the message
            raise RecipeModelError(f"{self.where}: {key}: {err}") from None

    def _folder(self, ref: ModelRef, key: str) -> Path | None:
        """The folder holding ``ref``'s config.json, or ``None`` (recorded) where it is not at hand."""
        path = Path(ref.path)
        if path.is_dir():
            return path
        if path.exists():
            raise FileNotFoundError(f"{ref.path} is a file; name the model folder that holds config.json")
        if names_local_path(ref.path):
            self._leave_out(ref, "no such folder here")
            return None
        repo_id, at, pinned = ref.path.partition("@")  # org/model@rev, as the merge reads it
        revision = ref.revision
        if at:
            if not pinned or (revision is not None and revision != pinned):
                raise RecipeError(
                    f"{self.where}: {key}: {ref.path} names revision {pinned!r} but revision {revision!r} is set; "
                    "give one"
                )
            revision = pinned
        return self._hub_folder(ref, repo_id, revision)

    def _hub_folder(self, ref: ModelRef, repo_id: str, revision: str | None) -> Path | None:
        """The Hub cache's folder of ``repo_id``'s config.json: cached, or downloaded alone (no
        weight, no tokenizer) while the Hub can be reached."""
        from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
        from huggingface_hub.errors import (
            EntryNotFoundError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        try:
            cached = try_to_load_from_cache(repo_id, "config.json", revision=revision)
        except HFValidationError as err:
            raise FileNotFoundError(f"{ref.path} is neither a local folder nor a Hub repo id ({err})") from None
        if isinstance(cached, str):
            return Path(cached).parent
        if constants.HF_HUB_OFFLINE:
            self._leave_out(ref, "not in the Hub cache and HF_HUB_OFFLINE is set")
            return None
        if self.unreachable is not None:  # one try per check: each one offline costs seconds of retries
            self._leave_out(ref, self.unreachable)
            return None
        try:
            return Path(hf_hub_download(repo_id, "config.json", revision=revision)).parent
        except (RepositoryNotFoundError, RevisionNotFoundError) as err:  # as the merge would say (hf_lmc.io.hub)
            raise not_found_error(ref.path, "folder", revision, err) from None
        except EntryNotFoundError as err:
            if not isinstance(err, LocalEntryNotFoundError):  # the Hub answered: no config.json at that revision
                raise NoModelAtRevisionError(no_model_message(repo_id, revision, "no config.json")) from None
            self.unreachable = f"not in the Hub cache and the Hub could not be reached ({type(err).__name__})"
        except OSError as err:  # no network, or the Hub's other errors (a server error, a timeout)
            self.unreachable = f"not in the Hub cache and the Hub could not be reached ({type(err).__name__})"
        self._leave_out(ref, self.unreachable)
        return None
