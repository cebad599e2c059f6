"""The recipe schema: one YAML file describes a whole merge run, or a sweep of runs.

A recipe names the models (Hub ids, local folders or zoo members, with revisions and PEFT
adapters to fold in first), the method(s) and their options, the data, alpha or weights, the
evaluation grid, the output and the accelerate settings. It is validated here, before any work
starts, so a typo fails in a second with the key that holds it (``models[1].revision: ...``)
rather than an hour into a sweep; :func:`check_models` compares each group's configs as the merge
would (``hf-lmc recipe check``, no weight read). :mod:`hf_lmc.merging.sweep` executes a validated
:class:`Recipe`; ``hf-lmc recipe schema`` prints :meth:`Recipe.model_json_schema` for editors.

    models: [EleutherAI/pythia-70m-seed1@step143000, EleutherAI/pythia-70m-seed2@step143000]
    method: weight
    eval: {data: {dataset: Salesforce/wikitext, name: wikitext-103-raw-v1, samples: 256}}
    output: {dir: runs/pythia-70m}

Relative paths (models, data files, output) are read from the current directory, as on the
command line.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    Field,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from hf_lmc.config.methods import METHODS, NAMES
from hf_lmc.config.options import (
    DEFAULT_ALPHA,
    EVAL_OPTIONS,
    FIT_OPTIONS,
    PATH_POINTS,
    SYMMETRIES,
    AccelerateOptions,
    EvalOptions,
    LearnOptions,
    MergeRequest,
    Options,
    OutputExistsError,
    OutputOptions,
    PairOptions,
    ParameterError,
    RecipeRunOptions,
    UsageError,
    check_device,
    clipped,
    default_repo_name,
    flag_of,
)
from hf_lmc.config.zoo_entries import ZOO
from hf_lmc.evaluation.grids import check_alpha_grid
from hf_lmc.io.hub import shown_reference
from hf_lmc.io.outputs import (
    MARKER,
    check_apart,
    check_output_path,
    check_replaceable,
    clean_stale,
    is_empty_folder,
)

#: The summary files a recipe writes in ``output.dir`` (:mod:`hf_lmc.merging.sweep`), beside its run folders.
SUMMARY = "summary"
SUMMARY_FILES = tuple(f"{SUMMARY}.{suffix}" for suffix in ("md", "json", "csv"))
#: Names a run folder cannot take: they are files of ``output.dir`` (compared in lower case, as
#: a case-insensitive filesystem would).
RESERVED_NAMES = frozenset(name.lower() for name in (*SUMMARY_FILES, MARKER))

ZOO_PREFIX = "zoo:"
_ZOO_MEMBER = re.compile(r"zoo:([A-Za-z0-9_]+)/seed(\d+)")
_MISSING = object()

Method = Literal[NAMES]  # the registry's names (hf_lmc.config.methods)
#: The merge request's fields, whose defaults and descriptions the recipe's settings of the same
#: name take (a recipe lists its methods, and names its symmetry group by preset).
_REQUEST = MergeRequest.model_fields


class RecipeError(UsageError):
    """A recipe that cannot run: the message names the file and the offending key."""


_Section = Options  # frozen, and unknown keys are errors


def parse_zoo_member(reference: str) -> tuple[str, int]:
    """``"zoo:gpt2/seed0"`` -> ``("gpt2", 0)``: a member of the offline zoo (:mod:`hf_lmc.io.zoo`)."""
    match = _ZOO_MEMBER.fullmatch(reference)
    if not match:
        raise ValueError(f"a zoo model is written zoo:NAME/seedN (e.g. zoo:gpt2/seed0), got {reference!r}")
    if match.group(1) not in ZOO:
        raise ValueError(f"no zoo entry {match.group(1)!r}; choose from {', '.join(ZOO)}")
    return match.group(1), int(match.group(2))


class ModelRef(_Section):
    """One checkpoint. A plain string is shorthand for ``{path: ...}``."""

    path: str = Field(description="Hub id, local folder, or zoo member zoo:NAME/seedN (trained offline and cached)")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of path")
    adapter: str | None = Field(
        None, description="PEFT adapter (folder or Hub id) merged into the model before alignment"
    )
    adapter_revision: str | None = Field(None, description="Hub revision of adapter")

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        """Editors must accept the string shorthand too."""
        return {"anyOf": [{"type": "string", "description": "shorthand for {path: ...}"}, handler(core_schema)]}

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value):
        if isinstance(value, str):
            return {"path": value}
        if not isinstance(value, Mapping):
            raise ValueError(  # noqa: TRY004 (pydantic reports a validator's ValueError as a ValidationError; a TypeError escapes it)
                "give a Hub id, a local folder or zoo:NAME/seedN, or a mapping with path, revision, adapter"
            )
        return value

    @field_validator("path")
    @classmethod
    def _zoo_member(cls, path: str) -> str:
        if path.startswith(ZOO_PREFIX):
            parse_zoo_member(path)
        return path

    @model_validator(mode="after")
    def _revisions_need_the_hub(self):
        if self.path.startswith(ZOO_PREFIX) and self.revision is not None:
            raise ValueError("revision: a zoo model has no revisions; remove it")
        if self.adapter_revision is not None and self.adapter is None:
            raise ValueError("adapter_revision: set only with adapter")
        return self

    @property
    def label(self) -> str:
        """How the model is named in summaries and model cards: local paths by their final
        component (:func:`hf_lmc.io.hub.shown_reference`), Hub ids and zoo members as written."""
        name = shown_reference(self.path) + (f"@{self.revision}" if self.revision else "")
        return f"{name}+{shown_reference(self.adapter)}" if self.adapter else name


class DataSection(EvalOptions):
    """Where a data set comes from (exactly one of dataset, files, zoo, sampled) and how it is cut
    (the batching fields of :class:`hf_lmc.config.options.EvalOptions`)."""

    dataset: str | None = Field(
        None, description="a datasets id (e.g. Salesforce/wikitext) or a folder saved with save_to_disk"
    )
    files: list[str] | None = Field(
        None,
        description="local data: .txt files or folders of them, .json/.jsonl/.csv/.parquet with a text column, or one .pt tensor file (ViT)",
    )
    zoo: Literal["shakespeare", "digits"] | None = Field(
        None, description="the offline zoo's corpus: Shakespeare plays (LMs) or digits (ViT)"
    )
    sampled: Literal[True] | None = Field(
        None,
        description="fitting data only: text sampled from the language models being merged (samples: how many sequences, default 8192)",
    )
    batch_size: PositiveInt | None = Field(
        None,
        description=f"sequences (images) per batch (default: {FIT_OPTIONS.batch_size} for fitting data, {EVAL_OPTIONS.batch_size} for evaluation data)",
    )
    split: str | None = Field(
        None,
        description=f"split to read (default: {FIT_OPTIONS.split} for fitting data, {EVAL_OPTIONS.split} for evaluation data)",
    )
    samples: PositiveInt | None = Field(
        None, description="number of sequences (images for ViT), rounded up to whole batches (default: all)"
    )

    @model_validator(mode="after")
    def _one_source(self):
        given = [key for key in ("dataset", "files", "zoo", "sampled") if getattr(self, key) is not None]
        if len(given) != 1:
            found = f"got {' and '.join(given)}" if given else "got none"
            raise ValueError(f"give exactly one of dataset, files, zoo or sampled ({found})")
        if self.sampled and self.split is not None:
            raise ValueError("split: sampled data has no splits")
        if self.name is not None and self.dataset is None:
            raise ValueError("name: a dataset configuration needs dataset")
        if self.files is not None and not self.files:
            raise ValueError("files: list at least one file")
        if self.zoo is not None and self.split not in (None, "train", "test"):
            raise ValueError(f"split: the zoo corpus has splits train and test, got {self.split!r}")
        if self.samples is not None and self.max_batches is not None:
            raise ValueError("samples: give samples or max_batches, not both")
        return self

    def options(self, defaults: EvalOptions) -> EvalOptions:
        """How the pipeline batches this data: the recipe's fields, ``defaults``' batch size and
        split (:data:`~hf_lmc.config.options.FIT_OPTIONS` or :data:`~hf_lmc.config.options.EVAL_OPTIONS`) where it names none."""
        batch_size = self.batch_size or defaults.batch_size
        max_batches = self.max_batches if self.samples is None else math.ceil(self.samples / batch_size)
        return EvalOptions(
            batch_size=batch_size,
            seq_len=self.seq_len,
            max_batches=max_batches,
            split=self.split or defaults.split,
            name=self.name,
        )


class EvalSection(_Section):
    """Held-out loss along the path: the barrier table in each model card and in the summary."""

    data: DataSection = Field(description="held-out data (default split: test)")
    alphas: int | list[float] = Field(
        PATH_POINTS, description="points on the alpha grid, or the grid itself (from 0 to 1, increasing)"
    )

    @field_validator("data")
    @classmethod
    def _held_out(cls, value: DataSection) -> DataSection:
        if value.sampled:
            raise ValueError(
                "sampled: text sampled from the models is fitting data; the barrier needs held-out data of its own"
            )
        return value

    @field_validator("alphas", mode="before")
    @classmethod
    def _grid(cls, value):
        if isinstance(value, bool) or not isinstance(value, (int, list)):
            raise ValueError(  # noqa: TRY004 (pydantic reports a validator's ValueError as a ValidationError; a TypeError escapes it)
                f"give a number of points (e.g. {PATH_POINTS}) or a list of alphas from 0 to 1"
            )
        if isinstance(value, int):
            if value < 2:
                raise ValueError(f"the alpha grid needs at least 2 points, got {value}")
            return value
        try:
            return check_alpha_grid(value)  # a NaN or inf too: each is refused here, before any work
        except ParameterError as err:
            raise ValueError(err.named("the grid")) from None


class OutputSection(OutputOptions):
    """Where the merged models and the summary go, and how each is written
    (:class:`hf_lmc.config.options.OutputOptions`); with several runs, push_to_hub may hold {group} and {method}."""

    dir: str = Field(description="output folder: one merged model per run and summary.{md,json,csv}")
    fail_fast: bool = copy.copy(RecipeRunOptions.model_fields["fail_fast"])  # its one definition, as --fail-fast's

    @field_validator("dir")
    @classmethod
    def _own_folder(cls, value: str) -> str:
        if Path(value).name in ("", ".", ".."):
            raise ValueError(f"name a folder of its own (it is replaced as a whole), e.g. runs/my-merge, got {value!r}")
        return value


class LaunchSection(_Section):
    """How many processes the recipe is meant to run as (``torchrun`` / ``accelerate launch``)."""

    processes: PositiveInt | None = Field(
        None,
        description="processes to run as; hf-lmc run started as another number refuses and prints the launch command "
        "(default: whatever the launch gives)",
    )

    def command(self, recipe_path: str) -> str | None:
        """The command lines that start ``recipe_path`` as ``processes`` processes (``None``: one process)."""
        if not self.processes or self.processes == 1:
            return None
        n = self.processes
        return f"torchrun --nproc_per_node {n} -m hf_lmc run {recipe_path} (CPUs), or accelerate launch --num_processes {n} -m hf_lmc run {recipe_path} (GPUs)"


class ZooSection(_Section):
    """How zoo members (``zoo:NAME/seedN``) are trained when they are not cached yet."""

    steps: PositiveInt | None = Field(None, description="training steps per member (default: the zoo's own)")
    cache: str | None = Field(
        None, description="folder of trained zoo members (default: $HF_LMC_CACHE/zoo or ~/.cache/hf_lmc/zoo)"
    )


class SweepEntry(_Section):
    """One group of models of a sweep (e.g. one model size of a scaling run)."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        max_length=100,  # a folder name, with room for the hidden staging names beside it (255 bytes in all)
        description="label in the summary and output subfolder, e.g. 160m",
    )
    models: list[ModelRef] = Field(min_length=2, description="the models to merge: two, or more with weights")


_METHOD_SCHEMA = {"anyOf": [{"enum": list(NAMES)}, {"type": "array", "items": {"enum": list(NAMES)}, "minItems": 1}]}


class Recipe(_Section):
    """A merge run (``models``) or a sweep of runs (``sweep``), for each method in ``method``."""

    name: str | None = Field(None, description="title of the summary")
    models: list[ModelRef] | None = Field(None, min_length=2, description="the models to merge (give this or sweep)")
    sweep: list[SweepEntry] | None = Field(
        None,
        min_length=1,
        validate_default=True,
        description="groups of models merged one after another, e.g. the sizes of a scaling run",
    )
    method: Annotated[list[Method], WithJsonSchema(_METHOD_SCHEMA)] = Field(
        [_REQUEST["method"].default],
        description="alignment method, or a list of them (each is one run per group of models)",
    )
    symmetries: Literal[SYMMETRIES] = Field(
        _REQUEST["symmetries"].default, description=flag_of(_REQUEST["symmetries"]).help
    )
    device: str | None = Field(_REQUEST["device"].default, description=flag_of(_REQUEST["device"]).help)
    alpha: float | None = copy.copy(PairOptions.model_fields["alpha"])  # its one definition: default, bounds, help
    weights: list[float] | None = Field(
        _REQUEST["weights"].default, validate_default=True, description=_REQUEST["weights"].description
    )
    data: DataSection | None = Field(
        None,
        validate_default=True,
        description="fitting data of activation, learned and dual matching (default split: train)",
    )
    learn: LearnOptions = Field(LearnOptions(), description="learned and dual matching")
    accelerate: AccelerateOptions = Field(
        AccelerateOptions(), description="accelerate settings of the learned / dual training loop"
    )
    eval: EvalSection | None = Field(
        None, description="held-out evaluation: barrier per run (needed for barriers in the summary)"
    )
    output: OutputSection = Field(description="output folder, shards, dtype, Hub target")
    zoo: ZooSection = Field(ZooSection(), description="training of zoo:NAME/seedN members")
    launch: LaunchSection = Field(
        LaunchSection(), description="the processes the recipe runs as (learned and dual matching train on all)"
    )

    @field_validator("device")
    @classmethod
    def _device(cls, value):
        return check_device(value)

    @field_validator("method", mode="before")
    @classmethod
    def _methods(cls, value):
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not names:
            raise ValueError(f"give a method or a list of them, from {', '.join(NAMES)}")
        for name in names:
            if name not in METHODS:
                raise ValueError(f"unknown method {name!r}; choose from {', '.join(NAMES)}")
        if len(set(names)) != len(names):
            raise ValueError("a method is listed twice")
        return names

    @field_validator("sweep")
    @classmethod
    def _models_or_sweep(cls, sweep, info: ValidationInfo):
        models = info.data.get("models", _MISSING)
        if models is _MISSING:  # models itself is invalid and reported
            return sweep
        if (models is None) == (sweep is None):
            raise ValueError(
                "give models (one group of models) or sweep (a list of named groups), not "
                + ("both" if sweep else "neither")
            )
        if sweep is not None:
            names = [entry.name for entry in sweep]
            folded = [n.casefold() for n in names]  # one folder on a case-insensitive disk, one Hub repo
            duplicate = next((n for n, f in zip(names, folded) if folded.count(f) > 1), None)
            if duplicate is not None:
                others = [n for n, f in zip(names, folded) if f == duplicate.casefold() and n != duplicate]
                also = (
                    f" and {others[0]!r} (one folder where names ignore case, as on macOS, Windows and the Hub)"
                    if others
                    else ""
                )
                raise ValueError(
                    f"two entries are named {duplicate!r}{also}; names label the summary and the output folders"
                )
            reserved = next((n for n in names if n.lower() in RESERVED_NAMES), None)
            if reserved is not None:  # its folder would be the summary's file, found only after every merge
                raise ValueError(
                    f"an entry is named {reserved!r}, a file the recipe writes in output.dir; rename the entry"
                )
        return sweep

    @field_validator("weights")
    @classmethod
    def _weights_fit_the_models(cls, weights, info: ValidationInfo):
        groups = _groups_of(info.data)
        if weights is None:
            big = next(((name, len(models)) for name, models in groups if len(models) > 2), None)
            if big is not None and info.data.get("alpha") is not None:
                raise ValueError(f"{big[0]} has {big[1]} models: give weights (one per model) instead of alpha")
            return weights
        if info.data.get("alpha") is not None:
            raise ValueError("give alpha (two models) or weights, not both")
        if any(w < 0 or not math.isfinite(w) for w in weights):
            raise ValueError(f"weights must be non-negative, got {weights}")
        if abs(sum(weights) - 1.0) > 1e-6:
            raise ValueError(f"weights must sum to 1, got {sum(weights):g}")
        for name, models in groups:
            if len(models) != len(weights):
                raise ValueError(f"{len(weights)} weights but {name} has {len(models)} models")
        return weights

    @field_validator("data")
    @classmethod
    def _data_for_data_methods(cls, data, info: ValidationInfo):
        needs = [m for m in info.data.get("method", ()) if METHODS[m].needs_data]
        if data is None and needs:
            raise ValueError(
                f"method {needs[0]!r} learns from data: add a data section (dataset, files, zoo, or sampled: true)"
            )
        return data

    @field_validator("output")
    @classmethod
    def _push_target_per_run(cls, output: OutputSection, info: ValidationInfo):
        if isinstance(output.push_to_hub, bool):  # true: each run's folder, named as a merge's default repo is
            template = None
            if output.push_to_hub:
                parts = [default_repo_name(output.dir), *(["{group}"] if info.data.get("sweep") else []), "{method}"]
                template = "-".join(parts)
            output = output.model_copy(update={"push_to_hub": template})
        if output.push_to_hub is None:
            return output
        try:
            output.push_to_hub.format(group="g", method="m")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(
                f"push_to_hub: only {{group}} and {{method}} may be filled in, got {output.push_to_hub!r} ({err})"
            ) from None
        groups, methods = _groups_of(info.data), info.data.get("method", ())
        for key, count in (("group", len(groups)), ("method", len(methods))):
            if count > 1 and f"{{{key}}}" not in output.push_to_hub:
                raise ValueError(f"push_to_hub: {count} {key}s would push to one repo; put {{{key}}} in the repo id")
        return output

    # -- what runs -----------------------------------------------------------------------------

    @property
    def groups(self) -> list[tuple[str, list[ModelRef]]]:
        """``(name, models)`` of every group of models, in order."""
        return _groups_of({"name": self.name, "models": self.models, "sweep": self.sweep})

    def runs(self) -> list[tuple[str, str, list[ModelRef]]]:
        """``(group name, method, models)`` of every merge the recipe makes, in order."""
        return [(name, method, models) for name, models in self.groups for method in self.method]

    def run_folder(self, group: str, method: str) -> Path:
        """Where a run's merged model goes, relative to ``output.dir``."""
        return Path(group, method) if self.sweep is not None else Path(method)

    def alpha_or_weights(self, count: int) -> float | list[float] | None:
        if count == 2:
            return self.weights[1] if self.weights else (DEFAULT_ALPHA if self.alpha is None else self.alpha)
        return self.weights


def _groups_of(data: Mapping[str, Any]) -> list[tuple[str, list]]:
    if data.get("sweep"):
        return [(entry.name, entry.models) for entry in data["sweep"]]
    if data.get("models"):
        return [(data.get("name") or "models", data["models"])]
    return []


# -- loading -----------------------------------------------------------------------------------


def load_recipe(source: str | Path | Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> Recipe:
    """Read and validate a recipe (a YAML file or a mapping), after applying ``overrides``.

    ``overrides`` maps dotted keys to values (``{"zoo.steps": 3, "sweep.0.name": "tiny"}``), so a
    shipped recipe can be shortened or redirected without editing it. Raises :class:`RecipeError`
    with the file and every offending key on one line.
    """
    where = str(source) if isinstance(source, (str, Path)) else "recipe"
    if isinstance(source, (str, Path)):
        raw = _read_yaml(Path(source))
    else:
        raw = _plain(source)
    for key, value in (overrides or {}).items():
        raw = _set(raw, key, value, where)
    try:
        return Recipe.model_validate(raw)
    except ValidationError as err:
        raise RecipeError(f"{where}: {format_errors(err)}") from None


def parse_override(text: str) -> tuple[str, Any]:
    """``"eval.alphas=3"`` -> ``("eval.alphas", 3)``: the value is read as YAML, within the
    limits of a recipe file (:class:`_BoundedLoader`)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"--set takes KEY=VALUE (e.g. zoo.steps=50), got {clipped(text)}")
    if len(value.encode()) > MAX_RECIPE_BYTES:
        raise RecipeError(
            f"--set {clipped(key.strip())}: the value is over {MAX_RECIPE_BYTES // 10**6} MB; a recipe value is short"
        )
    try:
        return key.strip(), _bounded_load(value)
    except _TooLarge as err:
        raise RecipeError(f"--set {clipped(key.strip())}: {err}") from None
    except yaml.YAMLError as err:
        raise RecipeError(
            f"--set {clipped(key.strip())}: cannot read {clipped(value)} as YAML ({str(err).splitlines()[0]})"
        ) from None


#: Recipe limits, far above any real recipe and far below what costs time or memory to refuse:
#: bytes of YAML, nesting depth, and nodes once aliases are expanded (a "billion laughs" file is
#: a few hundred bytes of aliases that expand to 10^9 nodes when anything walks the result).
MAX_RECIPE_BYTES = 1_000_000
MAX_RECIPE_DEPTH = 32
MAX_RECIPE_NODES = 100_000


class _TooLarge(Exception):
    """A recipe past one of the limits (the message says which)."""


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses, while it composes the document (before anything is
    built from it), nesting deeper than :data:`MAX_RECIPE_DEPTH` (refused before Python's
    recursion limit could be reached), more than :data:`MAX_RECIPE_NODES` nodes counting each
    alias as the whole node it repeats, and an alias inside the node it names (a cycle)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._sizes: dict[int, int] = {}  # id(node) -> its node count with aliases expanded

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            anchored = self.anchors.get(self.peek_event().anchor)
            if anchored is not None and id(anchored) not in self._sizes:
                raise _TooLarge(f"alias *{self.peek_event().anchor} repeats a node that contains it (a cycle)")
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_RECIPE_DEPTH:
            raise _TooLarge(f"nested deeper than {MAX_RECIPE_DEPTH} levels")
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            children = []
        size = 1 + sum(self._sizes[id(child)] for child in children)
        if size > MAX_RECIPE_NODES:
            raise _TooLarge(f"over {MAX_RECIPE_NODES} values once its aliases are expanded")
        self._sizes[id(node)] = size
        return node


def _bounded_load(text: str):
    """One YAML document read with :class:`_BoundedLoader` (as ``yaml.safe_load`` reads it)."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _read_yaml(path: Path) -> dict:
    """A recipe file read as YAML, at most :data:`MAX_RECIPE_BYTES` of it, within the limits of
    :class:`_BoundedLoader`; a :class:`RecipeError` naming the file otherwise."""
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder, not a recipe; pass the recipe's YAML file")
    if not path.is_file():
        raise FileNotFoundError(f"no such recipe: {path}")
    with open(path, "rb") as file:
        data = file.read(MAX_RECIPE_BYTES + 1)
    if len(data) > MAX_RECIPE_BYTES:
        raise RecipeError(f"{path}: over {MAX_RECIPE_BYTES // 10**6} MB; a recipe is a short file of settings")
    try:
        raw = _bounded_load(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise RecipeError(f"{path}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start})") from None
    except _TooLarge as err:
        raise RecipeError(f"{path}: refused: {err}") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        raise RecipeError(f"{path}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {err.problem}") from None
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise RecipeError(
            f"{path}: a recipe is a mapping of keys (models, method, output, ...), got {type(raw).__name__}"
        )
    return raw


def _plain(value):
    """A mutable deep copy (mappings to dicts, sequences to lists) that overrides can edit."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _set(raw: dict, dotted: str, value, where: str) -> dict:
    raw = _plain(raw)
    node, parts = raw, dotted.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        here = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise RecipeError(
                    f"{where}: --set {dotted}: {'.'.join(parts[:i]) or 'recipe'} is a list of {len(node)}; use an index below {len(node)}"
                )
            part = int(part)
        elif not isinstance(node, dict):
            raise RecipeError(f"{where}: --set {dotted}: {'.'.join(parts[:i])} is not a mapping")
        if last:
            node[part] = _plain(value)
        else:
            if isinstance(node, dict) and node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, (dict, list)):
                raise RecipeError(f"{where}: --set {dotted}: {here} is a value, not a mapping")
    return raw


# -- errors ------------------------------------------------------------------------------------


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "tuple", "none"}  # no recipe key has these names


def key_path(loc: tuple) -> str:
    """``("models", 1, "revision")`` -> ``"models[1].revision"`` (pydantic's union tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in _UNION_TAGS:
            out += f".{part}" if out else part
    return out


def format_errors(err: ValidationError) -> str:
    """Every error of ``err`` as ``key.path: what is wrong``, joined on one line (the alternatives
    of a union under one key joined by "or")."""
    messages: dict[str, list[str]] = {}
    for error in err.errors():
        loc = error["loc"]
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = _unknown_key(loc)
        elif error["type"] == "missing":
            message = "required key is missing"
        path = key_path(loc)
        key, sep, rest = message.partition(": ")
        section = _section_at(loc)
        if sep and section is not None and key in section.model_fields:  # a section's check names its key
            path, message = key_path((*loc, key)), rest
        if message not in messages.setdefault(path, []):
            messages[path].append(message)
    return "; ".join(
        f"{path}: {' or '.join(found)}" if path else " or ".join(found) for path, found in messages.items()
    )


def _unknown_key(loc: tuple) -> str:
    section = _section_at(loc[:-1])
    if section is None:
        return "unknown key"
    allowed = list(section.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return f"unknown key; {hint}allowed: {', '.join(allowed)}"


def _section_at(loc: tuple) -> type[BaseModel] | None:
    section: type[BaseModel] | None = Recipe
    for part in loc:
        if isinstance(part, int) or not part.isidentifier():
            continue
        field = section.model_fields.get(part) if section else None
        section = _nested_section(field.annotation) if field else None
        if section is None:
            return None
    return section


def _nested_section(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _nested_section(arg)
        if found is not None:
            return found
    return None


def check_outputs(recipe: Recipe, given=None, *, tidy: bool = True) -> None:
    """Check, before any work, every folder the recipe writes (``output.dir`` and each run's
    training state under ``accelerate.checkpoint_dir``) against every path it reads (models,
    adapters, data and evaluation files, the recipe file ``given``) and against each other, and
    that each is one the run may write or replace (docs/design.md §6). ``tidy=False`` (``hf-lmc
    recipe check``) changes nothing on disk (no debris is tidied) and leaves out whether
    ``output.dir`` exists yet without ``overwrite``, which is the state of a run, not of the recipe."""
    final = Path(recipe.output.dir)
    read = [
        p
        for _, refs in recipe.groups
        for ref in refs
        for p in (ref.path, ref.adapter)
        if p and not p.startswith(ZOO_PREFIX)
    ]
    for data in (recipe.data, recipe.eval.data if recipe.eval is not None else None):
        if data is not None:
            read += [*(data.files or []), *([data.dataset] if data.dataset else [])]
    if isinstance(given, (str, Path)):
        read.append(given)
    try:
        check_output_path(final, "output.dir")
        if tidy:
            clean_stale(final)  # a dead run's set-aside output is put back before it is judged
        if tidy and os.path.lexists(final) and not is_empty_folder(final) and not recipe.output.overwrite:
            raise OutputExistsError(
                f"{final} already exists; set {{}}: true (hf-lmc run --overwrite) to replace it", "output.overwrite"
            )
        check_apart(final, read, "output.dir")
        if recipe.output.overwrite:
            check_replaceable(final, "output.dir")
        state = recipe.accelerate.checkpoint_dir
        if state is not None:
            check_output_path(state, "accelerate.checkpoint_dir")
            check_apart(state, read, "accelerate.checkpoint_dir")
            check_apart(state, [final], "accelerate.checkpoint_dir", role="the output", missing=True)
            for group, method, _ in recipe.runs():
                check_replaceable(
                    Path(state) / recipe.run_folder(group, method),
                    "accelerate.checkpoint_dir",
                    kinds=("training-state",),
                )
    except (ParameterError, OutputExistsError) as err:
        if err.parameter == "output.overwrite":
            raise
        raise RecipeError(err.named(err.parameter)) from None


# -- the models' configs -----------------------------------------------------------------------


class RecipeModelError(ValueError):
    """A model of a recipe that its merge would refuse, found from the configs alone (no weight
    read): a group whose models no merge covers, or a config that cannot be read. The message
    names the recipe, the group or key, and the models."""
