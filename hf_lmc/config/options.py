"""Every user-facing option of a merge, declared once.

Each concern is one frozen pydantic model, and each field carries its default, its bounds or
choices, and a description. The command line (:mod:`hf_lmc.cli`) generates its flags from these
fields, recipes (:mod:`hf_lmc.config.recipe`) embed the models as their sections, and the Python API
takes them as arguments, so a default, a bound or an enum lives here alone.

The module imports neither torch nor transformers: ``hf-lmc --help`` builds its parser from it.
"""

from __future__ import annotations

import math
import numbers
import os
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

#: The parameterisations of the residual (orthogonal) maps.
ORTHOGONAL = ("cayley", "exp", "polar")
#: Where a trained map's factor sits (docs/design.md §4): ``"own"`` (``M_0 f(A)``), ``"target"``
#: (``f(A) M_0``) or ``"both"`` (``f(L) M_0 f(A)``).
FRAMES = ("own", "target", "both")
#: How unit and head assignments are handled while training: kept at the start's, or trained.
PERMUTATIONS = ("fixed", "ste", "sinkhorn")
#: What the path is trained toward: the batch's labels, or the endpoints' mixed predictions.
OBJECTIVES = ("labels", "ensemble")
#: Which grid points the ``worst_fraction`` of draws goes near.
FOCI = ("worst", "excess")
#: The symmetry groups an alignment searches.
SYMMETRIES = ("full", "permutation")
#: The symmetry group an alignment searches unless told otherwise.
DEFAULT_SYMMETRIES = "full"
#: The weight of the second of two models unless told otherwise: the midpoint of the path.
DEFAULT_ALPHA = 0.5
#: Dtypes a merge can be written in.
DTYPES = ("float32", "float16", "bfloat16")
#: Points of the evaluation grid along the path of two models unless told otherwise
#: (alpha = 0, 0.1, ..., 1); the learned matchers look for the path's worst point on it too.
PATH_POINTS = 11
#: Points per edge of the evaluation grid over the simplex of three or more models unless told otherwise.
SIMPLEX_POINTS = 5
#: Where a trained path's transforms start unless given one: weight (or, for three or more
#: models, universe) matching's solution, or the identity. A Python-only setting: the command
#: line always starts from weight matching.
INITS = ("weight", "identity")
DEFAULT_INIT = "weight"
#: How weight matching solves each RoPE head's per-frequency-pair scale-rotations (docs/design.md
#: §4): ``"moments"`` balances each model's pair on its own and takes the angle by Procrustes;
#: ``"joint"`` is Tran et al.'s appendix G.1, the least-squares map of Q and K together (Brent's
#: method on one scalar per pair). Both are exact on twins; which is the default is
#: [D-rotary-solve](decisions.md#d-rotary-solve)'s measurement. A Python-only setting
#: (``WeightMatcher(rotary_solve=...)``) until a measurement makes it worth a flag.
ROTARY_SOLVES = ("moments", "joint")
DEFAULT_ROTARY_SOLVE = "moments"
#: Training steps between re-locations of a path's worst point (and, with held-out batches,
#: barrier estimates). A Python-only setting of the training loop.
LOCATE_EVERY = 50
#: The training draws' seed when none is given, as ``transformers.TrainingArguments.seed``'s: one
#: merge for one set of inputs and settings, whatever the process drew before.
DEFAULT_SEED = 42
#: Where weight matching and the export's products can run.
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


class UsageError(ValueError):
    """A request that cannot be carried out as written (a flag, a recipe key or an argument with
    a value the merge cannot take, or two that conflict): the command line exits 2 for it, as
    argparse does for its own usage errors, and 1 when a run fails on what it reads or writes."""


#: What :meth:`_NamesParameter.named` replaces in a template: the ``{}`` that names the parameter,
#: and ``{{`` / ``}}`` (literal braces, as ``str.format`` writes them).
_PLACEHOLDER = re.compile(r"\{\}|\{\{|\}\}")


class _NamesParameter:
    """An error about one parameter, worded with a ``{}`` where the parameter is named, so that
    each front end names it its own way: the Python API by its keyword (``str(err)``), the command
    line by its flag and recipes by their key (:meth:`named`).

    Only ``{}`` is filled (and ``{{`` / ``}}`` read as braces); any other brace is text, so a value
    quoted from a file (a dict such as ``{'height': 8}``) never breaks the message."""

    def __init__(self, template: str, parameter: str):
        self.template, self.parameter = template, parameter
        super().__init__(self.named(parameter))

    def named(self, name: str) -> str:
        """The message with the parameter called ``name``."""
        return _PLACEHOLDER.sub(lambda found: name if found.group() == "{}" else found.group()[0], self.template)


class ParameterError(_NamesParameter, UsageError):
    """A value the merge cannot take; ``parameter`` is the keyword that holds it."""


class OutputExistsError(_NamesParameter, FileExistsError):
    """The output folder exists and ``parameter`` (overwrite) was not set: a usage error, like
    :class:`UsageError` (an ``OSError`` cannot also be a ``ValueError``)."""


def clipped(value, limit: int = 60) -> str:
    """``value`` as an error message shows it: its repr, cut to ``limit`` characters, so that a
    message never echoes unbounded input from a file or a flag."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def escape_controls(text, limit: int | None = None, keep: str = "") -> str:
    """``text`` (from a file, a flag or a folder name) safe to print to a terminal: every control
    or format character but those in ``keep`` (C0, DEL, C1, and Unicode's bidirectional and other
    invisible format characters, which can rewrite or reorder what a terminal shows) written as
    its Python escape, cut to ``limit`` characters where one is given."""
    shown = "".join(
        ch if ch in keep or unicodedata.category(ch) not in _UNSHOWN else ch.encode("unicode_escape").decode("ascii")
        for ch in str(text)
    )
    return shown if limit is None or len(shown) <= limit else shown[: limit - 3] + "..."


#: Unicode categories a terminal does not show as themselves: controls, format characters,
#: surrogates, private use and unassigned code points, and line and paragraph separators.
_UNSHOWN = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


#: The :func:`transformers.get_scheduler` names the training loop can run: those that need only
#: the warmup and total steps (the rest need a metric to step on or arguments of their own, and
#: would fail once training had started). Listed here, not read from transformers, so that a
#: schedule is checked before torch is imported; tests/test_cli.py holds it to transformers.
SCHEDULES = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
)


class Options(BaseModel):
    """Frozen, and unknown keys are errors: a misspelt option must not silently fall back to its default."""

    model_config = ConfigDict(extra="forbid", frozen=True)


_Model = TypeVar("_Model", bound=Options)


def with_overrides(model: type[_Model], options: _Model | None, overrides: dict[str, Any]) -> _Model:
    """``options`` (``None``: ``model``'s defaults) with the fields named in ``overrides`` set, and
    the whole checked again by ``model``: how the Python API takes an options object and
    keywords beside it, with the one set of checks the command line and recipes run. A keyword
    that is no field of ``model`` is a ``TypeError``, as for any function; a refused value a
    :class:`UsageError` in one line naming each refused keyword."""
    base = model() if options is None else options
    if not isinstance(base, model):
        raise TypeError(f"options must be a {model.__name__}, got {type(base).__name__}")
    unknown = [name for name in overrides if name not in model.model_fields]
    if unknown:
        raise TypeError(
            f"unexpected keyword argument {unknown[0]!r}: not a {model.__name__} field ({', '.join(model.model_fields)})"
        )
    if not overrides:
        return base
    try:
        return model(**{**base.model_dump(), **overrides})
    except ValidationError as err:
        raise UsageError("; ".join(_keyword_message(error) for error in err.errors())) from None


def _keyword_message(error: dict) -> str:
    """One refused value as ``keyword: what is wrong``; pydantic's own checks (bounds, choices)
    do not quote the value refused, so it is added (a check across fields names its field first)."""
    message = error["msg"].removeprefix("Value error, ")
    if not error["loc"]:
        return message
    if error["type"] != "value_error":
        message += f", got {clipped(error['input'])}"
    return f"{'.'.join(map(str, error['loc']))}: {message}"


def check_orthogonal(orthogonal: str, frame: str = "own") -> None:
    """Refuse an unknown residual-map parameterisation or frame, or a frame the parameterisation
    cannot take: polar projects a free matrix and has no fixed start to put a factor beside."""
    if orthogonal not in ORTHOGONAL:
        raise ValueError(f"unknown orthogonal parameterisation {orthogonal!r}; choose from {ORTHOGONAL}")
    if frame not in FRAMES:
        raise ValueError(f"unknown frame {frame!r}; choose from {FRAMES}")
    if orthogonal == "polar" and frame != "own":
        raise ValueError(
            f"the polar parameterisation has no fixed base to step around; frame={frame!r} needs 'cayley' or 'exp'"
        )


def parse_size(size: str | int, what: str = "shard size", zero: bool = False) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a number of bytes, as bytes (``what`` names the
    setting in errors; ``zero``: 0 is allowed)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = _SIZE.fullmatch(str(size).upper())
        if not m:
            raise ValueError(f"cannot read {what} {size!r}; use e.g. 5GB, 500MB or a number of bytes")
        if m.group(2) == "B":  # mergekit reads 5B as five billion parameters; here it would be five bytes
            raise ValueError(
                f"{what} {size!r} would be {m.group(1)} bytes; write the unit, e.g. {m.group(1)}GB, or a bare number of bytes"
            )
        value = int(float(m.group(1)) * _UNITS[m.group(2) or "B"])
    if value < 0 or (value == 0 and not zero):
        raise ValueError(f"{what} must be {'at least 0' if zero else 'positive'}, got {size!r}")
    return value


def check_device(device: str | None) -> str | None:
    """``cpu``, ``cuda`` or ``cuda:N`` (or ``None``: the default); whether CUDA runs is checked where it is used."""
    if device is not None and not _DEVICE.fullmatch(str(device)):
        raise ValueError(f"unknown device {device!r}; use cpu, cuda or cuda:N")
    return device


def check_orders(orders: int) -> int:
    """How many orders of the groups ``explain`` averages its parts over: a whole number, at least 1."""
    if isinstance(orders, bool) or not isinstance(orders, int) or orders < 1:
        message = f"{{}} is how many orders of the groups to average: at least 1, got {clipped(orders, 20)}"
        raise ParameterError(message, "orders")
    return orders


def default_warmup(steps: int) -> int:
    """Warmup steps when none are given: 5 % of the training steps."""
    return steps // 20


class LearnOptions(Options):
    """How learned and dual matching train their transforms (see :class:`hf_lmc.DualMatcher` and
    docs/learned-matching.md). Checked when built, so a conflict fails before any model loads."""

    steps: int = Field(
        1000,
        ge=0,
        description="training steps of learned and dual matching: the budget, when --target-barrier stops them sooner",
    )
    target_barrier: float | None = Field(
        0.02,
        ge=0,
        description=f"stop learned and dual matching of two models once the path's barrier, estimated every {LOCATE_EVERY} steps "
        "on the last eighth of the fitting batches (held out of training), is at most this many nats; 0 trains the whole budget",
    )
    patience: int | None = Field(
        None,
        ge=1,
        description=f"stop learned and dual matching of two models once this many barrier estimates in a row (one every "
        f"{LOCATE_EVERY} steps, on the held-out fitting batches) have not improved on the lowest (default: no plateau rule; "
        "the target and the budget stop them)",
    )
    lr: float = Field(
        1e-2, gt=0, description="Adam learning rate of learned and dual matching (the peak of the schedule)"
    )
    residual_lr: float | None = Field(
        None,
        gt=0,
        description="learning rate of the residual (orthogonal) maps, which turn every layer's stream at once (default: lr)",
    )
    schedule: str = Field(
        "cosine",
        description="learning-rate schedule: a transformers scheduler name that needs only the warmup and total steps (cosine, constant, linear, ...)",
    )
    warmup: int | None = Field(
        None, ge=0, description="linear warmup steps of the schedule (default: a twentieth of the steps)"
    )
    permutations: Literal["fixed", "ste", "sinkhorn"] = Field(
        "fixed",
        description="MLP unit and head permutations: fixed at weight matching's, or trained as straight-through Hungarian (ste) or Sinkhorn",
    )
    trained: Literal["all", "permutations"] = Field(
        "all",
        description="which groups learned matching trains: all (the residual rotation, per-head QK and OV maps, SwiGLU "
        "scales, and the unit and head orders as --permutations says) or permutations alone (the residual's dimensions, the "
        "MLP units and the heads, straight-through; every other map stays as permutation-only weight matching started "
        "it): Theus et al.'s 'learned matching (permutation only)'; needs --method learned, --symmetries permutation and "
        "--permutations ste or sinkhorn",
    )
    orthogonal: Literal["cayley", "exp", "polar"] = Field("cayley", description="parameterisation of the residual maps")
    frame: Literal["own", "target", "both"] = Field(
        "own",
        description="where each map's trained factor sits: after the start, stepping in the model's own coordinates (own), "
        "before it, in the coordinates of the model it is aligned to (target), or one factor on each side, as dual matching's "
        "relative map has (both); target and both need cayley or exp",
    )
    objective: Literal["labels", "ensemble"] = Field(
        "ensemble",
        description="train the merge toward the models' own predictions mixed at the same weights (ensemble: one extra "
        "forward per model and step), or toward the data's labels",
    )
    lambda_range: tuple[float, float] = Field(
        (0.4, 0.6), description="two models: interpolation weights are drawn uniformly from this range"
    )
    worst_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="two models: share of the weights drawn near the path's current worst point instead, re-located every "
        f"{LOCATE_EVERY} steps (0: all from lambda_range)",
    )
    draws: int = Field(
        1,
        ge=1,
        description="two models: interpolation weights drawn per step, each on its share of the batch's sequences (images): "
        "more draws cover the path with the same tokens, at one interpolated build per draw",
    )
    focus: Literal["worst", "excess"] = Field(
        "worst",
        description="two models: those draws go near the single worst grid point, or near every point above the line in "
        "proportion to its excess (for paths with two humps of about one height)",
    )
    input_noise: float = Field(
        0.0,
        ge=0,
        description="image models: std of Gaussian noise added to the training images at every step (0: none)",
    )
    concentration: float = Field(
        1.0,
        gt=0,
        description="three or more models: the weights of each step are drawn from Dirichlet(concentration * 1): 1 is uniform over "
        "the simplex, below 1 favours its vertices and edges, above 1 its centre",
    )
    target_cache: Annotated[str | int, Flag(metavar="SIZE")] = Field(
        "1GiB",
        description="memory for the endpoints' outputs on the fitting batches (the ensemble objective's targets, the held-out "
        "losses of the barrier estimates), kept so that later passes over the data do not run the endpoints again: the "
        "same merge, sooner; 0 runs them at every use",
    )
    seed: int | None = Field(
        DEFAULT_SEED,
        description="seed of the training draws (interpolation weights, input noise): the same seed, data and settings give the "
        "same merge, whatever ran before in the process (None: torch's RNG as it stands)",
    )

    @field_validator("target_cache")
    @classmethod
    def _target_cache(cls, value):
        parse_size(value, "target cache", zero=True)
        return value

    @property
    def target_cache_bytes(self) -> int:
        """``target_cache`` in bytes."""
        return parse_size(self.target_cache, "target cache", zero=True)

    @property
    def warmup_steps(self) -> int:
        """The warmup steps the schedule takes: ``warmup``, or 5 % of the steps when it is not set."""
        return default_warmup(self.steps) if self.warmup is None else self.warmup

    @field_validator("schedule")
    @classmethod
    def _scheduler_name(cls, value: str) -> str:
        if value not in SCHEDULES:
            raise ValueError(f"unknown schedule {clipped(value)}; choose from {', '.join(SCHEDULES)}")
        return value

    @field_validator("lambda_range")
    @classmethod
    def _in_unit_interval(cls, value: tuple[float, float]) -> tuple[float, float]:
        low, high = value
        if not 0.0 <= low <= high <= 1.0:
            raise ValueError(f"needs 0 <= low <= high <= 1, got [{low}, {high}]")
        return value

    @model_validator(mode="after")
    def _consistent(self):
        if self.trained == "permutations" and self.permutations == "fixed":
            raise ValueError(
                "trained: permutations alone train only as straight-through (ste) or Sinkhorn permutations; "
                "permutations 'fixed' keeps them where weight matching put them"
            )
        if self.warmup is not None and self.warmup > self.steps:
            raise ValueError(f"warmup: {self.warmup} warmup steps exceed the {self.steps} training steps")
        try:
            check_orthogonal(self.orthogonal, self.frame)
        except ValueError as err:
            raise ValueError(f"frame: {err}") from None
        return self


#: The settings of :class:`~hf_lmc.config.options.LearnOptions` a path reads when it is built; the
#: rest (steps, learning rates, schedule, stopping rule, seed) are the training loop's.
PATH_FIELDS = frozenset(
    {
        "permutations",
        "orthogonal",
        "frame",
        "objective",
        "lambda_range",
        "worst_fraction",
        "draws",
        "focus",
        "input_noise",
        "concentration",
    }
)


class AccelerateOptions(Options):
    """``accelerate.Accelerator`` settings of the learned and dual training loop. One process
    holds one mixed-precision setting, so a run that changes it needs a fresh process."""

    mixed_precision: Literal["no", "fp16", "bf16"] = Field(
        "no",
        description="autocast of the training loop; with --shard-endpoints also the dtype the models' layers are gathered in",
    )
    gradient_accumulation_steps: PositiveInt = Field(1, description="batches per optimiser step")
    shard_endpoints: bool = Field(
        False,
        description="under several processes (torchrun, accelerate launch), shard the frozen models' layers across them with "
        "FSDP2: each process keeps 1/N of every layer and gathers a layer when it is built",
    )
    shard_build: bool = Field(
        True,
        description="under several processes, each builds 1/N of the rows of every interpolated weight (layers, embeddings, "
        "heads) and all-gathers assemble them, or, where the launch's tokens are fewer than a layer's weights, the layers run "
        "tensor-parallel on the launch's batch (each process's heads and units, or its rows with the outputs gathered) instead; "
        "off, every process builds all of them",
    )
    offload_endpoints: bool = Field(
        False,
        description="with --shard-endpoints, keep each process's shards (in one process: the layers) in CPU memory and copy a layer "
        "to the GPU when it is gathered",
    )

    checkpoint_dir: str | None = Field(
        None,
        description="save the training state (transforms, optimiser, schedule, random state: safetensors and JSON, written "
        "atomically) to this folder every --checkpoint-every steps and at the end, so that a killed run can --resume; a new or "
        "empty folder, or one a run saved to",
    )
    checkpoint_every: PositiveInt = Field(
        100, description="steps between saves of the training state to --checkpoint-dir"
    )
    resume: bool = Field(
        False,
        description="continue from the state last saved in --checkpoint-dir (run with the same models, data, settings and number "
        "of processes): the merge is the one an uninterrupted run makes; with no state saved yet, start afresh",
    )

    @field_validator("checkpoint_dir", mode="before")
    @classmethod
    def _folder_name(cls, value):
        """A ``Path`` given from Python, as text."""
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @model_validator(mode="after")
    def _consistent(self):
        if self.offload_endpoints and not self.shard_endpoints:
            raise ValueError("offload_endpoints: offloading keeps the shards in CPU memory; it needs shard_endpoints")
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume: resuming reads the state a run saved; name its folder with checkpoint_dir")
        return self


class EvalOptions(Options):
    """How a data set is cut into batches, and which split of a datasets id is read."""

    batch_size: PositiveInt = Field(8, description="sequences (images) per batch")
    seq_len: PositiveInt | None = Field(
        None, description="tokens per sequence (default: min(128, the model's context))"
    )
    max_batches: PositiveInt | None = Field(None, description="use at most this many batches of the data")
    split: str = Field("test", description="split of a datasets id to read")
    name: str | None = Field(None, description="configuration of a datasets id with several, e.g. wikitext-103-raw-v1")


#: How evaluation data is batched unless told otherwise: the barrier sums a loss over the
#: batches, so their size changes memory, not the result.
EVAL_OPTIONS = EvalOptions()
#: How fitting data (activation, learned and dual matching) is batched unless told otherwise:
#: the training split, in batches of their own size. Learned and dual matching take one step per
#: batch: on the same text a larger batch alone changes little, but where the text holds more
#: than the steps would read in small batches, larger ones lower the barrier they reach
#: (docs/decisions.md#d-fit-batch-32), at the activation memory of the larger batch.
FIT_OPTIONS = EvalOptions(split="train", batch_size=32)


@dataclass(frozen=True)
class Flag:
    """How the command line offers a field of :class:`MergeRequest` whose flag needs more than
    the field's type and description say (the flag itself is the field's name, ``eval_data``
    -> ``--eval-data``, as for every options model). Declared on the field (``Annotated[...,
    Flag(...)]``), so the flag is generated from the one definition of the field.

    Attributes:
        help: the flag's help, where it is worded for the command line (default: the description).
        metavar: the name of its value in the help (default: the field name's last word, in capitals).
        type: the type of each value on the command line, where the field's own is wider.
        nargs: how many values it takes (``"+"``: one per model; ``"?"``: an optional value).
        const: the value of a flag given without its optional value (``--push-to-hub`` alone: ``True``).
        choices: the values it takes, where the field's type does not list them.
        aliases: further names of the flag (``-o``).
        required: whether every command that offers it needs it.
    """

    help: str | None = None
    metavar: str | None = None
    type: type | None = None
    nargs: str | None = None
    const: Any = None
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()
    required: bool = False


def flag_of(field) -> Flag:
    """The :class:`Flag` declared on a pydantic field (an empty one where none is)."""
    return next((item for item in field.metadata if isinstance(item, Flag)), Flag())


class DemoOptions(Options):
    """``hf-lmc demo`` (:func:`hf_lmc.commands.demo.run_demo`): where it writes, and what it trains."""

    output: Annotated[str, Flag(metavar="DIR", aliases=("-o",))] = Field(
        "hf-lmc-demo", description="where to write the merge (default: ./hf-lmc-demo)"
    )
    train: bool = Field(
        False,
        description="train the pair here from its seeds (minutes) instead of unpacking the pair the package ships, trained the "
        "same way",
    )
    steps: PositiveInt | None = Field(
        None, description="training steps per model (default: the zoo's 600; trains the pair here)"
    )
    eval_chars: PositiveInt = Field(16384, description="held-out characters to evaluate")
    cache_dir: Annotated[str | None, Flag(metavar="DIR")] = Field(
        None, description="folder for trained zoo models (default: $HF_LMC_CACHE/zoo or ~/.cache/hf_lmc/zoo)"
    )
    write_plays: Annotated[str | None, Flag(metavar="DIR")] = Field(
        None,
        description="write the Shakespeare plays the package ships as text and stop: DIR/train.txt (the plays the pair "
        "trained on) and DIR/plays.txt (the two held-out plays), the files the examples read",
    )


class CheckOptions(Options):
    """``hf-lmc check``: the dtype, seed and symmetry group of the exactness check."""

    dtype: Literal["float32", "float64"] = Field(
        "float32",
        description="compute dtype; float64 checks to 1e-9 (LLaMA's RMSNorm runs without its float32 downcast)",
    )
    seed: Annotated[int, Flag(metavar="SEED")] = Field(0, description="seed of the random symmetry and inputs")
    symmetries: Literal[SYMMETRIES] = Field(DEFAULT_SYMMETRIES, description="group to sample from")


#: Batches of the evaluation data ``hf-lmc explain`` reads unless ``--max-batches`` says another
#: count or ``--all-eval-data`` lifts the cap: every one of its passes (two per group, order and
#: path, 110 on the demo's GPT-2) reads them all. 16 batches of 8 x 128 tokens are 16,384 tokens,
#: the demo's own evaluation text.
EXPLAIN_EVAL_BATCHES = 16


class ExplainOptions(Options):
    """``hf-lmc explain`` (:func:`hf_lmc.evaluation.explain.explain`): how many orders its parts average over,
    and whether it reads all of the evaluation data."""

    orders: int = Field(
        2,
        description="orders of moving the groups to average over: 2 is input to output and back, more add random orders "
        "in reversed pairs; each costs two evaluations per group and path",
    )
    all_eval_data: bool = Field(
        False,
        description=f"evaluate on all of --eval-data; by default explain reads its first {EXPLAIN_EVAL_BATCHES} batches "
        "(or --max-batches), since each of its passes reads them all",
    )


class ApplyOptions(Options):
    """``hf-lmc apply`` (:func:`hf_lmc.commands.apply.apply_transforms`): where the moved model or adapter
    goes, which of the merge's models the transform to apply is, and for an adapter which models
    it was trained on and is moved for."""

    output: Annotated[str, Flag(metavar="DIR", aliases=("-o",), required=True)] = Field(
        description="folder to write (must not exist unless --overwrite)"
    )
    member: Annotated[str | None, Flag(metavar="NAME")] = Field(
        None,
        description="which of the merge's models' transforms moves MODEL (an adapter: its base): a letter (A, B, ...), a "
        "number from 1 or its label (default: the model MODEL is by its content; needed to move another checkpoint of "
        "the same shape)",
    )
    base_model: Annotated[str | None, Flag(metavar="MODEL")] = Field(
        None, description="an adapter's: the model it was trained on (default: the one its adapter_config.json names)"
    )
    moved_base: Annotated[str | None, Flag(metavar="REF")] = Field(
        None,
        description="an adapter's: the base model the moved adapter's config records (default: the merge the transforms "
        "come from)",
    )
    revision: Annotated[str | None, Flag(metavar="REV")] = Field(
        None, description="Hub revision of MODEL (an adapter: of its base model)"
    )


class PairOptions(Options):
    """What a merge of exactly two models takes beside its :class:`MergeRequest`: B's weight and
    each model's Hub revision by letter (:func:`hf_lmc.merge`'s ``alpha``, ``revision_a``,
    ``revision_b``; ``--alpha``, ``--revision-a``, ``--revision-b``). The request itself holds
    them as ``weights`` and ``revisions``, which any number of models share."""

    alpha: float | None = Field(
        None, ge=0, le=1, description=f"two models: weight of MODEL_B in [0, 1] (default: {DEFAULT_ALPHA})"
    )
    revision_a: Annotated[str | None, Flag(metavar="REV")] = Field(None, description="Hub revision of MODEL_A")
    revision_b: Annotated[str | None, Flag(metavar="REV")] = Field(None, description="Hub revision of MODEL_B")


class RecipeRunOptions(Options):
    """``hf-lmc run`` (:func:`hf_lmc.merging.sweep.run_recipe`): what a recipe does when one of its runs
    fails. Recipes hold the field as ``output.fail_fast``, the command line as ``--fail-fast``."""

    fail_fast: bool = Field(
        False,
        description="stop at the first run that fails (default: record it in the summary and go on with the next run); "
        "the merges finished before it and the summary are written either way",
    )


#: How ``tokenizer_from`` names the two models of a pair, as messages call them.
_MODEL_LETTERS = {"a": 0, "b": 1}


class OutputOptions(Options):
    """How the merged checkpoint is written and published."""

    shard_size: str | int = Field("5GB", description="maximum shard size, e.g. 5GB or 500MB")
    dtype: Literal["float32", "float16", "bfloat16"] | None = Field(
        None, description="dtype of the written weights (default: the first model's)"
    )
    push_to_hub: Annotated[
        str | bool | None,
        Flag(
            help="upload the written folder to this Hub model repo (given alone: the output folder's name, under the "
            "token's namespace, as transformers' push_to_hub does); the token, the namespace and the Hub are checked "
            "before any work",
            metavar="REPO_ID",
            type=str,
            nargs="?",
            const=True,
        ),
    ] = Field(
        None,
        description="Hub model repo to upload the merged folder to; true: the output folder's name under the token's "
        "namespace",
    )
    private: bool = Field(False, description="create the Hub repo as private")
    overwrite: bool = Field(False, description="replace an existing output folder")
    save_transforms: Annotated[
        bool,
        Flag(
            help="do not write the transforms the merge found into the output folder (by default every aligned "
            "merge writes transforms.safetensors and its manifest transforms.json beside the weights)"
        ),
    ] = Field(
        True,
        description="write the transforms an aligned merge found (transforms.safetensors and its manifest "
        "transforms.json) into the output folder",
    )
    inherit_from_a: bool = Field(
        False,
        description="use the first model's tokenizer, image processor, label names and generation config where another model's "
        "differ in a way that changes what its weights mean (refused otherwise); the card names what differed",
    )
    tokenizer_from: str | int | None = Field(
        None,
        description="the model whose tokenizer files the merge carries: a or b, or the model's number (1, 2, ...); naming it "
        "accepts its tokenizer where another model's differs, as the card then records (default: the first model's, and a "
        "tokenizer that differs is refused)",
    )

    @property
    def tokenizer_model(self) -> int:
        """The index of the model whose tokenizer the merge carries (0 unless ``tokenizer_from`` names another)."""
        named = self.tokenizer_from
        return 0 if named is None else _MODEL_LETTERS[named] if isinstance(named, str) else named - 1

    @field_validator("tokenizer_from", mode="before")
    @classmethod
    def _model_name(cls, value):
        """``A``, ``b`` or ``"2"`` as typed on a command line: a letter in lower case, a number as a number."""
        if isinstance(value, str):
            value = value.strip().lower()
            value = int(value) if value.isdigit() else value
        if (
            value is None
            or value in _MODEL_LETTERS
            or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
        ):
            return value
        raise ValueError(f"name a model: a, b or its number (1, 2, ...), got {clipped(value)}")

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_name(cls, value):
        return None if value is None else str(value).removeprefix("torch.")  # a torch.dtype prints as torch.float16

    @field_validator("shard_size")
    @classmethod
    def _size(cls, value):
        parse_size(value)
        return value


class MergeRequest(OutputOptions):
    """Everything one merge needs, frozen: the stages of :mod:`hf_lmc.merging.pipeline` (resolve, align,
    measure, write, push) read it, :func:`hf_lmc.merge` and :func:`hf_lmc.merge_models` build
    it from keywords, and a recipe is a list of them. The output settings are inherited from
    :class:`OutputOptions`."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    models: tuple[str, ...] = Field(
        min_length=2, description="local folders or Hub ids; the first one's config, tokenizer and dtype are used"
    )
    output: Annotated[
        str,
        Flag(
            help="folder to write: new, empty, or with --overwrite one hf-lmc wrote (default: named after the models, "
            "./MODEL_A-MODEL_B-merged)",
            metavar="DIR",
            aliases=("-o",),
        ),
    ] = Field(description="folder to write")
    revisions: Annotated[
        tuple[str | None, ...] | None,
        Flag(
            help="Hub revision of every model, in order ('-' for the default branch)",
            metavar="REV",
            type=str,
            nargs="+",
        ),
    ] = Field(None, description="Hub revision per model (None entries: the default branch)")
    weights: Annotated[tuple[float, ...] | None, Flag(metavar="W", type=float, nargs="+")] = Field(
        None, description="one weight per model, >= 0, summing to 1 (default: uniform)"
    )
    method: Annotated[str, Flag(help="alignment before interpolation")] = Field(
        "weight", description="alignment method (hf_lmc.config.methods)"
    )
    symmetries: Annotated[Any, Flag(help="symmetry group the alignment searches", type=str, choices=SYMMETRIES)] = (
        Field(
            DEFAULT_SYMMETRIES,
            description="symmetry group the alignment searches: full, permutation, or a set of kinds",
        )
    )
    device: Annotated[
        str | None,
        Flag(
            help="where weight matching and the export's products run: cpu, cuda or cuda:N (default: a GPU when torch "
            "sees one, else cpu)"
        ),
    ] = Field(
        None, description="where weight matching and the export's products run (default: a GPU when torch sees one)"
    )
    data: Annotated[
        Any,
        Flag(
            help="data the alignment fits on: text file or folder, datasets id or saved dataset, .pt tensors for ViT, "
            "or 'sampled': text sampled from the language models themselves (--max-batches batches of --batch-size, "
            "default 8192 sequences)",
            metavar="DATA",
            type=str,
        ),
    ] = Field(
        None,
        description="fitting data of activation, learned and dual matching (anything hf_lmc.evaluation.batches.load_batches reads)",
    )
    data_options: EvalOptions = Field(FIT_OPTIONS, description="how the fitting data is batched")
    learn: LearnOptions = Field(LearnOptions(), description="learned and dual matching")
    accelerate: AccelerateOptions = Field(AccelerateOptions(), description="accelerate settings of the training loop")
    eval_data: Annotated[
        Any,
        Flag(
            help="held-out data the barrier is measured on: text file or folder, datasets id or saved dataset, .pt "
            "tensors for ViT",
            metavar="DATA",
            type=str,
        ),
    ] = Field(None, description="held-out data: the barrier table and plot go into the card")
    eval_options: EvalOptions = Field(EVAL_OPTIONS, description="how the evaluation data is batched")
    alphas: Annotated[
        int | tuple[float, ...] | None,
        Flag(
            help="points on the alpha grid; for 3+ models per edge of the simplex grid "
            f"(default: {PATH_POINTS}; {SIMPLEX_POINTS})",
            metavar="N",
            type=int,
        ),
    ] = Field(
        None,
        description=f"evaluation grid: points per edge (default {PATH_POINTS} for two models, {SIMPLEX_POINTS} for more), or the "
        "alpha grid itself",
    )
    labels: tuple[str | None, ...] | None = Field(
        None,
        description="how the model card names each model (default, or None: a Hub id as given, a local folder by its name)",
    )
    made_with: str | None = Field(
        None,
        description="markdown for the card's Reproduce section: the command line or recipe that made the merge (default: these settings)",
    )
    repo_hint: str | None = Field(
        None,
        description="what the card's usage example loads the merge from (default: push_to_hub, else the output folder's name)",
    )
    eval_data_name: str | None = Field(
        None,
        description="how the card's model-index names the evaluation data when it is passed loaded: a Hub dataset id is named "
        "as one, any other name as local data (default: eval_data itself when it is a path or id, else local data by its type)",
    )

    @field_validator("models", mode="before")
    @classmethod
    def _as_strings(cls, models):
        return tuple(str(m) for m in models)

    @model_validator(mode="before")
    @classmethod
    def _push_target(cls, data):
        """``push_to_hub=True`` (``--push-to-hub`` alone) names the output folder's repo under the
        token's namespace, as transformers' ``push_to_hub=True`` does; ``False`` pushes nothing."""
        if isinstance(data, dict) and isinstance(data.get("push_to_hub"), bool):
            data = {**data, "push_to_hub": default_repo_name(data.get("output")) if data["push_to_hub"] else None}
        return data

    @field_validator("alphas")
    @classmethod
    def _a_grid(cls, alphas):
        """Checked here, before any work: a grid of fewer than two points (``--alphas 0``) has no line to measure above."""
        if isinstance(alphas, int) and alphas < 2:
            raise ValueError(f"the evaluation grid needs at least 2 points, got {alphas}")
        if isinstance(alphas, tuple) and (
            len(alphas) < 2 or list(alphas) != sorted(alphas) or alphas[0] != 0 or alphas[-1] != 1
        ):
            raise ValueError("an explicit alpha grid runs from 0 to 1, increasing, with at least 2 points")
        return alphas

    @field_validator("output", "device", mode="before")
    @classmethod
    def _as_string(cls, value):
        """A ``Path`` or ``torch.device`` given from Python, as text (the device is checked where it is used)."""
        return None if value is None else str(value)


# -- names a merge gives itself ----------------------------------------------------------------

#: What the Hub allows in a repo name (``huggingface_hub.utils.validate_repo_id``'s rule), and
#: its longest one.
_REPO_NAME = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9][A-Za-z0-9._-]*(?<![.-])$")
_REPO_NAME_LENGTH = 96


def default_output(models: Sequence[str | Path]) -> str:
    """The folder a merge writes when none is given: ``MODEL_A-MODEL_B-merged`` in the current
    folder, each model by its name (a Hub id's repo name, a folder's last part, ``@rev`` dropped),
    made a valid Hub repo name, so ``--push-to-hub`` alone can push it under that name."""
    names = []
    for model in models:
        name = re.split(r"[/\\]", str(model).rstrip("/\\"))[-1].partition("@")[0]  # org/name@rev -> name
        names.append(re.sub(r"[^A-Za-z0-9._]+", "-", name).strip("-.") or "model")
    stem = re.sub(r"-{2,}|\.{2,}", "-", "-".join(names))[: _REPO_NAME_LENGTH - len("-merged")].strip("-.")
    return f"{stem or 'model'}-merged"


def default_repo_name(output) -> str:
    """The Hub repo name ``push_to_hub=True`` pushes to: the output folder's own name, which must
    be one the Hub accepts (a :class:`ValueError` saying how to name the repo otherwise)."""
    if output is None:
        raise ValueError("push_to_hub=True names the repo after the output folder: give the output")
    name = Path(os.path.abspath(str(output))).name
    if len(name) > _REPO_NAME_LENGTH or not _REPO_NAME.match(name):
        raise ValueError(
            f"the output folder's name {name!r} is not a Hub repo name (letters, digits, '-', '_', '.', at most "
            f"{_REPO_NAME_LENGTH}); give the repo id: --push-to-hub USER/NAME"
        )
    return name


# -- checks of values a merge is given -------------------------------------------------------


def pair_weights(alpha: float) -> tuple[float, float]:
    """The weights ``(1 - alpha, alpha)`` of two models, ``alpha`` checked to be a number in [0, 1]."""
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise ParameterError(f"{{}} must be a number in [0, 1], got {type(alpha).__name__}", "alpha")
    if not 0.0 <= alpha <= 1.0 or math.isnan(alpha):
        raise ParameterError(f"{{}} must lie in [0, 1], got {alpha}", "alpha")
    return 1 - alpha, alpha


def simplex_weights(weights: Sequence[float] | None, count: int, parameter: str = "weights") -> tuple[float, ...]:
    """``weights`` checked to be a point of the simplex (``count`` entries, >= 0, sum 1);
    ``None`` gives uniform weights."""
    if weights is None:
        return (1.0 / count,) * count
    if isinstance(weights, (str, bytes)) or not all(
        isinstance(w, numbers.Real) and not isinstance(w, bool) for w in weights
    ):
        raise ParameterError(f"{{}} must be one number per model, got {clipped(weights)}", parameter)
    weights = tuple(float(w) for w in weights)
    if len(weights) != count:
        raise ParameterError(f"{{}} needs one weight per model: got {len(weights)} for {count} models", parameter)
    if not all(w >= 0 and math.isfinite(w) for w in weights):
        raise ParameterError(f"{{}} must be >= 0, got {' '.join(f'{w:g}' for w in weights)}", parameter)
    if abs(sum(weights) - 1) > 1e-6:
        raise ParameterError(
            f"{{}} must sum to 1, got {' '.join(f'{w:g}' for w in weights)} (sum {sum(weights):g})", parameter
        )
    return weights


def revisions_per_model(revisions: Sequence[str | None] | None, count: int) -> list[str | None]:
    """One Hub revision per model (``None``: the default branch); fails on a list of the wrong length."""
    if revisions is None:
        return [None] * count
    if len(revisions) != count:
        raise ParameterError(
            f"{{}} needs one entry per model (None for the default): got {len(revisions)} for {count} models",
            "revisions",
        )
    return list(revisions)
