"""The training loop of the trainable paths, and learned and dual matching under the shared contract.

:func:`train` runs Adam under :mod:`accelerate` on any path module whose call is the loss at a
sampled point of its path (:class:`~hf_lmc.learned.paths.TrainedPath`: the modules'
``.fit`` is this function). The loop is its own piece so that the path modules stay plain
``nn.Module`` s a user can equally train in a loop of their own.

:class:`TrainedMatcher` is learned or dual matching as every search method is called,
``fit(models, weights) -> list[Transform]``: it builds the path from the models, trains it
with the settings of :class:`~hf_lmc.config.options.LearnOptions` and
:class:`~hf_lmc.config.options.AccelerateOptions`, and returns the hardened transforms.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import Tensor, nn

from hf_lmc.canonical.form import CanonicalModel
from hf_lmc.config.options import (
    DEFAULT_SYMMETRIES,
    LOCATE_EVERY,
    PATH_FIELDS,
    AccelerateOptions,
    LearnOptions,
    UsageError,
    with_overrides,
)
from hf_lmc.learned.endpoints import EndpointSharding
from hf_lmc.learned.params import OrthogonalParam
from hf_lmc.learned.state import TrainingState, check_folder
from hf_lmc.learned.targets import TargetCache
from hf_lmc.learned.trainable import TrainableTransform
from hf_lmc.matching.universe import UniverseMatcher
from hf_lmc.symmetry import Transform
from hf_lmc.utils import allocator
from hf_lmc.utils.devices import launch_device, launched_count, launched_processes
from hf_lmc.utils.progress import bar as progress_bar

logger = logging.getLogger(__name__)
#: ``train(holdout=SPLIT)``, the default: hold out what ``hf-lmc merge`` holds out (:func:`holdout_for`).
SPLIT = "split"
#: ``train``'s keywords of old that name an options field another way.
_ALIASES = {"warmup_steps": "warmup"}

#: A held-out estimate above DIVERGING_RISE x the lowest seen + DIVERGING_MARGIN nats means the steps
#: diverge (a learning rate too high for the models): training goes back to the lowest path at half
#: the rate, and a run that ends so far up returns the lowest path. Chosen on the benchmark suite so
#: that the wandering of a healthy run's small-sample estimate stays inside (docs/decisions.md#d-divergence-guard).
DIVERGING_RISE, DIVERGING_MARGIN = 2.0, 0.1
_SHOW_EVERY = 10  # steps between the progress bar's loss readings (each one waits for the device)


def train(
    path: nn.Module,
    batches: Iterable[dict[str, Tensor]],
    options: LearnOptions | None = None,
    *,
    accelerate: AccelerateOptions | None = None,
    accelerator=None,
    holdout: Sequence[dict[str, Tensor]] | str | None = SPLIT,
    locate_every: int = LOCATE_EVERY,
    progress: bool = True,
    callback: Callable[[int, nn.Module], None] | None = None,
    **overrides,
) -> list[float]:
    """Train ``path``'s transforms with Adam under :mod:`accelerate`, as ``hf-lmc merge`` does.

    ``options`` (:class:`~hf_lmc.config.options.LearnOptions`; default: the path's own, :attr:`learn`,
    which it was built with, else the defaults) set the steps, learning rates, schedule,
    stopping rule and seed, and ``accelerate`` (:class:`~hf_lmc.config.options.AccelerateOptions`) the
    accumulation, mixed precision and checkpoints; ``overrides`` set fields of either by name
    (``path.fit(batches, steps=20, checkpoint_dir=...)``; ``warmup_steps`` names ``warmup``),
    checked as the command line's flags are. The settings the path was built with (its
    parameterisation, draws and objective) cannot change here. The same path, batches and
    settings give the same transforms as ``hf-lmc merge`` with those flags.

    ``path(batch)`` is the loss at a sampled point of the path; ``path.label`` names the
    progress bar, and where ``path.seeks_worst`` holds, ``path.locate_worst(batches)`` runs on
    the latest two batches every ``locate_every`` steps.

    ``batches`` is read in passes until ``steps`` batches are drawn: a re-iterable (a list, a
    ``DataLoader``) is iterated anew on every pass, so a shuffling loader reshuffles and no
    batch is held past its step; a one-shot iterator's batches are kept and replayed. Under
    several processes give each its own shard (``accelerator.prepare(loader)`` does).
    ``schedule`` is a :func:`transformers.get_scheduler` name of :data:`~hf_lmc.config.options.SCHEDULES`
    over the optimizer steps, the first ``warmup`` of them warming up linearly. ``residual_lr``
    sets the residual (orthogonal) maps' learning rate apart from the rest: one step of it turns
    every layer's stream at once. Without ``accelerator``, one is made from the accumulation
    and mixed-precision settings. With a ``seed``, torch's RNG is seeded for the run and the
    caller's state restored afterwards.

    With ``checkpoint_dir`` (a new or empty folder, or one holding a state this function saved),
    the training state is saved there every ``checkpoint_every`` steps (at the next optimizer
    step) and at the end, as tensors and JSON, atomically (:mod:`hf_lmc.learned.state`);
    ``resume=True`` continues from the last saved step, replaying the data order, after the
    saved state is verified. ``callback(step, path)`` runs after every batch (e.g. to evaluate the
    barrier during training). Returns the loss of every step.

    ``holdout`` batches (a slice of the data never trained on) serve the stopping rule of a path
    that locates its worst point. By default (:data:`SPLIT`) they are cut from ``batches`` as
    ``hf-lmc merge`` cuts them (:func:`holdout_for`: with a ``target_barrier``, the last eighth
    of a list); ``None`` holds none out. With them, the worst point is located on them instead,
    before the first step, every ``locate_every`` steps and after the last, and the largest
    excess found is the path's barrier estimate; with ``target_barrier``, training stops as soon
    as the estimate is at most that. Where an estimate diverges (above ``DIVERGING_RISE`` times
    the lowest plus ``DIVERGING_MARGIN``), training goes back to the lowest path (possibly the
    start's) at half the learning rate, and a run that ends there returns it. What was reached
    is left in ``path.stopping`` (a :class:`Stopping`).
    """
    learn, accelerate = training_options(path, options, accelerate, overrides)
    if locate_every < 1:
        raise ValueError(f"locate_every must be >= 1, got {locate_every}")
    if isinstance(holdout, str):
        if holdout != SPLIT:
            raise ValueError(f"holdout is a list of batches, None or {SPLIT!r}, got {holdout!r}")
        batches, holdout = holdout_for(path, batches, learn)
    try:
        # A step allocates the same MiB-sized temporaries every time: from the heap, not fresh pages.
        with seeded(learn.seed), allocator.reused_memory():
            return _train(path, batches, learn, accelerate, accelerator, holdout, locate_every, progress, callback)
    finally:
        if getattr(path, "targets", None) is not None:
            path.targets = None  # the endpoints' outputs kept for the run are freed with it


def training_options(
    path: nn.Module, options: LearnOptions | None, accelerate: AccelerateOptions | None, overrides: dict
) -> tuple[LearnOptions, AccelerateOptions]:
    """The loop's :class:`~hf_lmc.config.options.LearnOptions` and :class:`~hf_lmc.config.options.AccelerateOptions`:
    ``options`` (default: the path's own) and ``accelerate`` with ``overrides`` set by field
    name, refusing a change to what the path was built with."""

    overrides = {_ALIASES.get(name, name): value for name, value in overrides.items()}
    built = getattr(path, "learn", None)
    base = options if options is not None else built
    loop = {name: value for name, value in overrides.items() if name not in AccelerateOptions.model_fields}
    learn = with_overrides(LearnOptions, base, loop)
    accelerate = with_overrides(
        AccelerateOptions,
        accelerate,
        {name: value for name, value in overrides.items() if name in AccelerateOptions.model_fields},
    )
    if isinstance(built, LearnOptions):
        changed = [name for name in sorted(PATH_FIELDS) if getattr(learn, name) != getattr(built, name)]
        if changed:
            raise UsageError(
                f"{changed[0]}: the path was built with {changed[0]}={getattr(built, changed[0])!r}; "
                "build it with the setting instead (it shapes the path, not the training loop)"
            )
    return learn, accelerate


def holdout_for(path: nn.Module, batches, learn: LearnOptions):
    """``(training, held-out)`` batches as ``hf-lmc merge`` trains on them: with a
    ``target_barrier`` (0 included: estimated, not stopped on) and a path that locates its worst
    point, :func:`holdout_split`; otherwise ``(batches, None)``."""
    if learn.target_barrier is not None and hasattr(path, "locate_worst"):
        return holdout_split(batches)
    return batches, None


def _train(
    path: nn.Module,
    batches,
    learn: LearnOptions,
    accelerate: AccelerateOptions,
    accelerator,
    holdout,
    locate_every: int,
    progress: bool,
    callback,
) -> list[float]:
    """:func:`train`'s loop, with its settings resolved."""
    from transformers import (
        get_scheduler,  # deferred: transformers.optimization is slow to import, and only training needs it
    )

    steps, schedule, warmup_steps, target_barrier = (
        learn.steps,
        learn.schedule,
        learn.warmup_steps,
        learn.target_barrier,
    )
    checkpoint_dir, checkpoint_every, resume = accelerate.checkpoint_dir, accelerate.checkpoint_every, accelerate.resume
    if accelerator is None:
        accelerator = Accelerator(
            gradient_accumulation_steps=accelerate.gradient_accumulation_steps,
            mixed_precision=accelerate.mixed_precision,
        )
    optimizer = torch.optim.Adam(_parameter_groups(path, learn.residual_lr), lr=learn.lr)
    updates = max(math.ceil(steps / accelerator.gradient_accumulation_steps), 1)  # optimizer steps
    if schedule == "constant" and warmup_steps:
        schedule = "constant_with_warmup"  # transformers' "constant" ignores warmup
    scheduler = get_scheduler(schedule, optimizer, num_warmup_steps=warmup_steps, num_training_steps=updates)
    model, optimizer = accelerator.prepare(path, optimizer)
    # The scheduler is stepped here rather than prepared: accelerate's wrapper advances a prepared
    # scheduler once per process, which would run the schedule faster with more processes.
    best = _BestPath([p for p in path.parameters() if p.requires_grad])
    folder = Path(checkpoint_dir) if checkpoint_dir is not None else None
    start, origin = 0, start_fingerprint(path) | _data_fingerprint(batches, accelerator) if folder is not None else None
    if folder is not None:  # a resumed run still knows the best path seen before it
        state = TrainingState(path, getattr(optimizer, "optimizer", optimizer), scheduler, best, accelerator)
        check_folder(folder)  # before any step: a folder that is not hf_lmc's state is never written into
        if resume:
            start = state.load(folder, steps, lambda saved: _check_same_start(saved, origin, folder))
        if start:
            logger.info("%s: resuming from step %d of %s", path.label, start, folder)
    saved_at = start
    stream = _passes(batches)
    recent = collections.deque(maxlen=2)  # where the worst point is located
    for _ in range(start):  # replay the data order up to where the saved run stopped
        recent.append(next(stream)[1])
    # The endpoints' outputs on the fitting batches, kept between passes (hf_lmc.learned.targets);
    # only list batches have a place a batch is known by from one pass to the next.
    targets = None
    if learn.target_cache_bytes and getattr(path, "reuses_targets", False):
        targets = path.targets = TargetCache(learn.target_cache_bytes)
    losses = []  # on the device, read once at the end
    watch = holdout is not None and hasattr(path, "locate_worst")
    stopping = path.stopping = Stopping(
        target_barrier if watch else None,
        len(holdout) if watch else 0,
        budget=steps,
        backtracks=best.backtracks,
        patience=learn.patience if watch else None,
        started=time.perf_counter(),
    )

    def offer(done: int) -> bool:  # a new estimate after ``done`` steps, timed from the start of training
        return best.offer(stopping, done, _estimate(path, holdout, accelerator), time.perf_counter() - stopping.started)

    # The estimate before the first step; a resumed run re-estimates only where the saved run
    # did (every locate_every steps), since locating moves the worst point its draws follow.
    if watch and start % locate_every == 0 and offer(start):
        steps = start  # the start already reaches the target
    bar = progress_bar(range(start, steps), desc=path.label, show=progress and accelerator.is_local_main_process)
    timing = _StepTiming.of(path, accelerator)
    for step in bar:
        index, raw = next(stream)
        recent.append(raw)
        if targets is not None:
            targets.batch = index
        batch = {k: v.to(accelerator.device) for k, v in raw.items()}
        with accelerator.accumulate(model):
            loss = model(batch)
            accelerator.backward(loss)
            optimizer.step()
            if accelerator.sync_gradients:
                scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.detach())  # no host sync: a GPU keeps the next step's kernels queued
        located = (step + 1) % locate_every == 0
        if located and watch:
            offer(step + 1)
            if best.diverging(stopping):
                _back_off(path, best, stopping, optimizer, scheduler, lambda: _estimate(path, holdout, accelerator))
        elif located and path.seeks_worst:
            path.locate_worst([{k: v.to(accelerator.device) for k, v in b.items()} for b in recent])
        if timing is not None:
            timing.step(step + 1, steps)
        if callback is not None:
            callback(step + 1, path)
        if not bar.disable and ((step + 1) % _SHOW_EVERY == 0 or step + 1 == steps):
            shown = {"loss": f"{losses[-1].item():.4f}"}
            if stopping.estimate is not None:  # where the path's barrier stands, as the stopping rule reads it
                shown["barrier"] = f"{stopping.estimate:.4f}"
            bar.set_postfix(shown)
        last = step + 1 == steps or stopping.stop
        # Saved at an optimizer step (a state mid-accumulation would lose the gradients summed so far,
        # which differ between processes): the first after each checkpoint_every steps, and the last.
        due = bool(checkpoint_every) and (step + 1) // checkpoint_every > saved_at // checkpoint_every
        if folder is not None and (last or (due and accelerator.sync_gradients)):
            state.save(folder, step + 1, origin)
            saved_at = step + 1
        if last:
            break
    if timing is not None:
        timing.clock.running = False
    if watch and stopping.steps != start + len(losses):  # the estimate reported is the final path's
        offer(start + len(losses))
    if watch:
        best.restore_if_diverged(stopping)
    history = torch.stack(losses).tolist() if losses else []
    if history:
        tail = history[-min(len(history), _SHOW_EVERY) :]
        logger.info(
            "%s: %d steps, mean loss of the last %d %.4f", path.label, len(history), len(tail), sum(tail) / len(tail)
        )
    if stopping.estimate is not None:
        logger.info("%s: %s", path.label, stopping.describe())
    return history


#: What counts as an improvement of the held-out barrier estimate for the plateau rule
#: (``LearnOptions.patience``): a fall below the lowest estimate yet by more than the larger of
#: these, in nats and as a fraction of the lowest. Smaller falls are the estimate's own wander.
PLATEAU_NATS, PLATEAU_FRACTION = 0.002, 0.02


@dataclass
class Stopping:
    """The stopping rule of a training run and what it reached: the path's barrier estimated on
    ``holdout_batches`` held-out batches (``estimate``, after ``steps``), against ``target``
    (``None`` or 0: no target, every step of ``budget`` runs) and, with ``patience``, stopped
    once that many estimates in a row have not improved on the lowest (:data:`PLATEAU_NATS`,
    :data:`PLATEAU_FRACTION`). ``curve`` holds every estimate as ``(steps, seconds, estimate)``,
    seconds counted from the start of training (``started``, a ``time.perf_counter`` reading)."""

    target: float | None
    holdout_batches: int
    budget: int
    steps: int = 0
    estimate: float | None = None
    last: tuple[int, float] | None = None  # (steps, estimate) of the last path, where an earlier, lower one was kept
    backtracks: int = 0  # times a diverging run went back to its lowest path at half the learning rate
    patience: int | None = None
    started: float | None = None
    curve: list[tuple[int, float | None, float]] = field(default_factory=list)
    lowest: float | None = None  # the lowest estimate yet, as the plateau rule counts improvements
    stale: int = 0  # estimates in a row that did not improve on it

    @property
    def reached(self) -> bool:
        return bool(self.target) and self.estimate is not None and self.estimate <= self.target

    @property
    def plateaued(self) -> bool:
        """Whether ``patience`` estimates in a row have not improved on the lowest."""
        return bool(self.patience) and self.stale >= self.patience

    @property
    def stop(self) -> bool:
        """Whether training stops here: the target reached or the estimate on a plateau."""
        return self.reached or self.plateaued

    @property
    def reason(self) -> str:
        """Why training ended: ``"target"``, ``"plateau"`` or ``"budget"`` (every step run)."""
        return "target" if self.reached else "plateau" if self.plateaued else "budget"

    def record(self, step: int, estimate: float, seconds: float | None = None) -> bool:
        """A new estimate after ``step`` steps, ``seconds`` into training: onto the curve and
        into the plateau count; whether training should stop."""
        self.curve.append((step, seconds, estimate))
        if self.lowest is None or estimate < self.lowest - max(PLATEAU_NATS, PLATEAU_FRACTION * self.lowest):
            self.lowest, self.stale = estimate, 0
        else:
            self.stale += 1
        return self.check(step, estimate)

    def check(self, step: int, estimate: float) -> bool:
        """Set the path's estimate after ``step`` steps (a new one, or the kept path's where
        training went back to it); whether training should stop."""
        self.steps, self.estimate = step, estimate
        return self.stop

    def describe(self) -> str:
        """One sentence for messages and model cards."""
        if self.estimate is None:
            return f"trained all {self.budget} steps (no held-out estimate)"
        found = f"barrier {self.estimate:.4f} nats on {self.holdout_batches} held-out batches after {self.steps} steps"
        if self.last is not None:
            found += f" (kept: the lowest estimate seen; the path after {self.last[0]} steps read {self.last[1]:.4f})"
        if self.backtracks:
            found += f" (learning rate halved {self.backtracks} time{'s' if self.backtracks > 1 else ''} as the estimate rose)"
        if self.plateaued and not self.reached:
            found += (
                f": stopped on a plateau, {self.patience} estimates in a row without improving on {self.lowest:.4f}"
            )
            return found + (f" (target {self.target:g} not reached)" if self.target else "")
        if not self.target:
            return found
        if self.reached:
            return f"{found}: target {self.target:g} reached"
        return f"{found}: target {self.target:g} not reached within the budget of {self.budget} steps"

    def time_to_final(self, within: float = 0.1) -> tuple[int, float | None] | None:
        """``(steps, seconds)`` of the first estimate within ``within`` (10 %) of the final one, or of
        the target where it was reached: when the run had bought what it ends with. ``None``
        without estimates."""
        if not self.curve or self.estimate is None:
            return None
        goal = (self.target if self.reached else self.estimate) * (1 + within)
        return next(((step, seconds) for step, seconds, estimate in self.curve if estimate <= goal + 1e-12), None)


class _BestPath:
    """The trained parameters at the lowest barrier estimate the stopping rule has seen, restored
    when training diverges (:meth:`diverging`) and when it ends there, as
    ``transformers.Trainer``'s ``load_best_model_at_end`` keeps the best checkpoint: a run whose
    steps make the path worse, e.g. a learning rate too high for the models, does not return a
    path far worse than its start. Short of that the last path is returned: the estimate, on a
    few batches, wanders, and the suite's barriers are those of the last path. The estimate is
    the same on every process (its losses are all-reduced), so every process keeps the same
    step. Kept in CPU memory; part of the saved training state, so a resumed run keeps it too."""

    def __init__(self, parameters: list[nn.Parameter]):
        self.parameters = parameters
        self.steps: int | None = None
        self.estimate: float | None = None
        self.values: list[Tensor] | None = None
        self.backtracks = 0  # times training went back here at half the learning rate

    def offer(self, stopping: Stopping, steps: int, estimate: float, seconds: float | None = None) -> bool:
        """Record ``estimate`` after ``steps`` (``seconds`` into training) in ``stopping``, keep the
        path if it is the lowest yet; whether training should stop."""
        logger.debug("barrier estimate %.4f on the held-out batches after %d steps", estimate, steps)
        if self.estimate is None or estimate < self.estimate:
            self.steps, self.estimate = steps, estimate
            self.values = [
                p.detach().to("cpu", copy=True) for p in self.parameters
            ]  # off the accelerator: it holds the models
        return stopping.record(steps, estimate, seconds)

    def diverging(self, stopping: Stopping) -> bool:
        """Whether the last estimate rose so far above the lowest (above ``DIVERGING_RISE`` times
        it plus ``DIVERGING_MARGIN`` nats) that the steps are diverging rather than wandering."""
        if self.estimate is None or stopping.estimate is None:
            return False
        return stopping.estimate > self.estimate * DIVERGING_RISE + DIVERGING_MARGIN

    def restore_if_diverged(self, stopping: Stopping) -> None:
        """Put the kept parameters back where the last estimate is :meth:`diverging`."""
        if self.diverging(stopping):  # a lowest path is kept whenever there is an estimate
            self.restore()
            stopping.last = (stopping.steps, stopping.estimate)
            stopping.check(self.steps, self.estimate)

    def restore(self) -> None:
        """Put the kept parameters back."""
        with torch.no_grad():
            for parameter, value in zip(self.parameters, self.values):
                parameter.copy_(value)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "estimate": self.estimate, "values": self.values, "backtracks": self.backtracks}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.estimate, self.values = state["steps"], state["estimate"], state["values"]
        self.backtracks = state.get("backtracks", 0)  # states saved before the count was kept lack it


def _back_off(
    path: nn.Module, best: _BestPath, stopping: Stopping, optimizer, scheduler, estimate: Callable[[], float]
) -> None:
    """A diverging run goes back to its lowest path, with Adam's moments (the diverged steps')
    cleared and the learning rate halved for the rest of the schedule."""
    logger.info(
        "%s: barrier estimate rose to %.4f; back to the path after %d steps (%.4f), learning rate halved",
        path.label,
        stopping.estimate,
        best.steps,
        best.estimate,
    )
    best.restore()
    estimate()  # locates the worst point the draws follow on the restored path
    stopping.check(best.steps, best.estimate)
    best.backtracks += 1
    stopping.backtracks = best.backtracks
    optimizer.state.clear()
    scheduler.base_lrs = [lr / 2 for lr in scheduler.base_lrs]  # the schedule multiplies these
    for group in optimizer.param_groups:
        group["lr"] /= 2


class _StepTiming:
    """Per-step wall time and its shares, logged at INFO (``hf-lmc merge -v``) every
    ``_SHOW_EVERY`` steps: building the interpolated weights, waiting in gathers (the interpolant's
    :class:`~hf_lmc.learned.interpolant.BuildClock`), and the rest (the tokens' compute, the
    build's backward, the gradients' all-reduce, locating the worst point)."""

    def __init__(self, path: nn.Module, clock, accelerator):
        self.label, self.clock, self.accelerator = path.label, clock, accelerator
        self.clock.reset()
        self.clock.running = True
        self.since, self.started = None, time.perf_counter()

    @staticmethod
    def of(path: nn.Module, accelerator) -> _StepTiming | None:
        clock = getattr(getattr(path, "interpolant", None), "clock", None)
        if clock is None or not logger.isEnabledFor(logging.INFO) or not accelerator.is_main_process:
            return None
        return _StepTiming(path, clock, accelerator)

    def step(self, done: int, steps: int) -> None:
        if self.since is None:
            self.since = done - 1
        if done % _SHOW_EVERY and done != steps:
            return
        if self.accelerator.device.type == "cuda":
            torch.cuda.synchronize(self.accelerator.device)
        count, wall = done - self.since, time.perf_counter() - self.started
        build, gathers = self.clock.build / wall, self.clock.gathers / wall
        logger.info(
            "%s: steps %d-%d: %.3f s a step (%d process%s): build %.0f%%, gathers %.0f%%, tokens and the rest %.0f%%",
            self.label,
            self.since + 1,
            done,
            wall / count,
            self.accelerator.num_processes,
            "es" if self.accelerator.num_processes > 1 else "",
            100 * build,
            100 * gathers,
            100 * (1 - build - gathers),
        )
        self.clock.reset()
        self.since, self.started = done, time.perf_counter()


def _estimate(path: nn.Module, holdout: Sequence[dict[str, Tensor]], accelerator) -> float:
    """The path's barrier on ``holdout``: its largest excess over the line on the 11-point grid
    (:meth:`~hf_lmc.learned.paths.PairPath.locate_worst` also moves the worst point there)."""
    kept = {"held_out": True} if getattr(path, "targets", None) is not None else {}  # a run that keeps targets
    path.locate_worst([{k: v.to(accelerator.device) for k, v in b.items()} for b in holdout], **kept)
    return max(0.0, float(path.grid_excess.max()))


#: Relative difference at which two float fingerprints count as different starts: far above the
#: rounding a recomputed start may differ by, far below what another start changes.
_START_TOLERANCE = 1e-4


def start_fingerprint(path: nn.Module) -> dict[str, list]:
    """Where ``path``'s transforms start, in a few numbers per tensor: every tensor of its
    :class:`~hf_lmc.learned.trainable.TrainableTransform` modules (the fixed parts, such as the
    start's permutations, signs and bases, and the trainable parameters' starting values).

    A saved training state holds trained factors relative to that start; resumed on another
    (other models, or an hf_lmc that matches them differently) it would train on as if
    nothing had changed. Integer tensors are fingerprinted exactly, float ones by their absolute
    sum and a fixed random projection, compared up to :data:`_START_TOLERANCE`, so that a start
    recomputed with other rounding (another GPU kernel) still resumes."""
    prints = {}
    for name, module in path.named_modules():
        if isinstance(module, TrainableTransform):
            for key, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
                prints[f"{name}.{key}"] = _tensor_fingerprint(tensor.detach())
    return prints


#: The key of the training data's entry in a start fingerprint.
_DATA_KEY = "data:"


def _data_fingerprint(batches, accelerator) -> dict[str, list]:
    """The training batches' entry of a start fingerprint: every tensor of the first and last
    batch of every process's share, in process order (a resumed run replays the data's order, so
    other data is another run), the same on every process so that all refuse or resume alike.
    Data given as a loader or iterator cannot be read ahead, and has none."""
    local = None
    if isinstance(batches, (list, tuple)) and batches:
        local = [
            [key, *_tensor_fingerprint(tensor.to(torch.int64) if not tensor.is_floating_point() else tensor)]
            for batch in (batches[0], batches[-1])
            for key, tensor in sorted(batch.items())
            if isinstance(tensor, Tensor)
        ]
    shares = [local]
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        shares = gather_object([local])
    if any(share is None for share in shares):
        return {}
    return {_DATA_KEY: [entry for share in shares for entry in share]}


def _tensor_fingerprint(tensor: Tensor) -> list:
    values = tensor.reshape(-1).cpu()
    if not values.is_floating_point():
        return [list(tensor.shape), hashlib.sha256(values.to(torch.int64).numpy().tobytes()).hexdigest()]
    values = values.to(torch.float64)
    weights = torch.rand(values.numel(), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return [list(tensor.shape), values.abs().sum().item(), (values * weights).sum().item()]


def _check_same_start(saved: dict | None, current: dict, folder: Path) -> None:
    """Refuse to resume a state saved from another start (a state saved before fingerprints were
    recorded is taken as it is)."""
    if saved is None:
        return

    def same(a: list, b: list) -> bool:
        if a[0] != b[0] or isinstance(a[1], str) or isinstance(b[1], str):
            return a == b
        return all(abs(x - y) <= _START_TOLERANCE * max(abs(a[1]), abs(b[1]), 1e-12) for x, y in zip(a[1:], b[1:]))

    def same_data(a: list, b: list) -> bool:  # one [key, *fingerprint] per tensor
        return len(a) == len(b) and all(x[0] == y[0] and same(x[1:], y[1:]) for x, y in zip(a, b))

    if _DATA_KEY in saved and _DATA_KEY in current and not same_data(saved[_DATA_KEY], current[_DATA_KEY]):
        raise UsageError(
            f"resume: the training state in {folder} was saved training on other data than this run's (--data, its "
            "split or its batching differ); resume with the data that saved it, or start afresh in another folder"
        )
    saved, current = ({k: v for k, v in d.items() if k != _DATA_KEY} for d in (saved, current))
    changed = sorted(set(saved) ^ set(current)) or [name for name in current if not same(saved[name], current[name])]
    if changed:
        raise UsageError(
            f"resume: the training state in {folder} was saved from another start than this run's ({changed[0]} differs: "
            "other models, or an hf_lmc that matches them differently); resume with what saved it, or start afresh in another folder"
        )


def holdout_split(batches, share: float = 0.125, most: int = 8):
    """``(training, held-out)`` batches: the last ``share`` of a list (at least one batch, at
    most ``most``) is held out for the stopping rule. Data given as a loader or iterator has no
    length to cut, and gives ``(batches, None)``; so does a list of fewer than two batches."""
    if not isinstance(batches, (list, tuple)) or len(batches) < 2:
        return batches, None
    count = min(most, max(1, int(len(batches) * share)))
    return list(batches[:-count]), list(batches[-count:])


def _parameter_groups(path: nn.Module, residual_lr: float | None) -> list[dict]:
    """Adam parameter groups: the residual maps' at ``residual_lr`` (when given), the rest at the base rate."""
    trainable = [p for p in path.parameters() if p.requires_grad]
    if residual_lr is None:
        return [{"params": trainable}]
    residual = {id(p) for m in path.modules() if isinstance(m, OrthogonalParam) for p in m.parameters()}
    groups = [
        {"params": [p for p in trainable if id(p) not in residual]},
        {"params": [p for p in trainable if id(p) in residual], "lr": residual_lr},
    ]
    return [group for group in groups if group["params"]]


def _passes(batches: Iterable[dict[str, Tensor]]) -> Iterator[tuple[int | None, dict[str, Tensor]]]:
    """``batches`` without end, each with its index in ``batches`` where that is a list or tuple
    (the same batch at the same index every pass; otherwise ``None``). ``itertools.cycle``
    would keep every batch of the first pass (a whole dataset's worth from a ``DataLoader``)
    and replay that pass's order; a re-iterable is iterated again instead. A one-shot iterator
    cannot be, so its batches are kept."""
    indexed = isinstance(batches, (list, tuple))
    if isinstance(batches, Iterator):
        batches = itertools.cycle(batches)
    while True:
        empty = True
        for index, batch in enumerate(batches):
            empty = False
            yield (index if indexed else None), batch
        if empty:
            raise ValueError("fit: batches yielded no batch; pass a non-empty list, DataLoader or iterator of batches")


@contextlib.contextmanager
def seeded(seed: int | None):
    """Run with torch's RNG seeded to ``seed`` and restore the caller's state afterwards
    (``None``: the RNG as it stands). Every process of a launch seeds alike, so all draw the
    same interpolation weights, as the trainable paths require."""
    if seed is None:
        yield
        return
    # GPUs' states are saved only where CUDA already runs: reading them would start it (a context
    # per device) in a process launched to stay on the CPU.
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _rows_of_process(batch: dict[str, Tensor], index: int, count: int) -> dict[str, Tensor]:
    """Process ``index``'s share of ``batch``: an equal slice of its rows, so that DDP's mean of
    the processes' gradients is the whole batch's (for a loss averaged over rows of one length).
    A batch whose rows do not split evenly is kept whole on every process: the same gradient."""
    rows = {v.shape[0] for v in batch.values() if isinstance(v, Tensor) and v.dim() > 0}
    if len(rows) != 1 or next(iter(rows)) % count:
        return batch
    return {k: v.chunk(count)[index] if isinstance(v, Tensor) and v.dim() > 0 else v for k, v in batch.items()}


class TrainedMatcher:
    """Learned or dual matching under the contract every search method shares:
    ``fit(models, weights) -> list[Transform]``, one transform per model.

    Args:
        path_class: the two-model path to train, :class:`~hf_lmc.DualMatcher` (both models'
            transforms train) or :class:`~hf_lmc.LearnedMatcher` (B's only). Three or more
            models train its simplex form, ``path_class.over_simplex``
            (:class:`~hf_lmc.SimplexMatcher`), whose first model's transform trains as A's
            does in ``path_class``.
        batches: the training batches (as for :func:`train`).
        learn: the path's and the loop's settings (``seed`` seeds the training draws).
        accelerate: the loop's ``accelerate.Accelerator`` settings.
        symmetries: the group the weight-matching (or, for 3+ models, universe-matching) start searches.
        progress: show progress bars.
        device: where the weight-matching start runs (default: this process's launch device).
        **path_kwargs: further arguments of the path's constructor (e.g. ``dtype``,
            ``checkpoint_layers``).

    ``fit`` trains a fresh path on every call; ``losses`` holds the last call's loss per step,
    ``stopping`` what its stopping rule reached (``learn.target_barrier``: two models given a list
    of batches hold the last eighth of them out, at most 8, to estimate the barrier on).
    """

    def __init__(
        self,
        path_class: type[nn.Module],
        batches: Iterable[dict[str, Tensor]],
        *,
        learn: LearnOptions | None = None,
        accelerate: AccelerateOptions | None = None,
        symmetries=DEFAULT_SYMMETRIES,
        progress: bool = True,
        device: str | torch.device | None = None,
        **path_kwargs,
    ):
        self.path_class = path_class
        self.batches = batches
        self.learn = LearnOptions() if learn is None else learn
        self.accelerate = AccelerateOptions() if accelerate is None else accelerate
        self.symmetries = symmetries
        self.progress = progress
        self.device = device
        self.path_kwargs = path_kwargs
        self.losses: list[float] = []
        self.stopping: Stopping | None = None

    def fit(self, models: Sequence[CanonicalModel], weights: Sequence[float] | None = None) -> list[Transform]:
        """One trained, hardened transform per model; the merge is ``sum_k weights[k] T_k(models[k])``.

        Two models train ``path_class(a, b)`` from weight matching's start (``weights`` do not
        change it: the draws cover the path). More train the simplex from universe matching's
        start at ``weights``.
        """
        settings = {"symmetries": self.symmetries, "shard_endpoints": self._endpoint_sharding(), **self.path_kwargs}
        if len(models) < 2:
            raise ValueError(f"{self.path_class.__name__} aligns two or more models, got {len(models)}")
        if len(models) == 2:
            path = self.path_class(*models, self.learn, init_device=self.device, **settings)
        else:
            # a learned refinement follows: unless asked, start where the launch put this process
            device = launch_device(self.device)
            start = UniverseMatcher(self.symmetries, progress=self.progress, device=device).fit(models, weights)
            path = self.path_class.over_simplex(models, self.learn, init=start, **settings)
        self._train(path)
        return list(path.transforms())

    def _endpoint_sharding(self) -> EndpointSharding | bool:
        """``accelerate``'s endpoint settings as the path takes them: FSDP2 gathers in the
        mixed-precision dtype, as accelerate's own FSDP2 plugin casts parameters."""
        accelerate = self.accelerate
        shared_build = accelerate.shard_build and launched_count() > 1
        if not accelerate.shard_endpoints and not shared_build:
            return False
        launched_processes()  # torch.distributed set up (under a launch) before the endpoints are sharded
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerate.mixed_precision)
        return EndpointSharding(
            offload=accelerate.offload_endpoints,
            dtype=dtype,
            build=accelerate.shard_build,
            layers=accelerate.shard_endpoints,
        )

    def _train(self, path: nn.Module) -> None:
        # The held-out batches of train()'s default, cut here so that under a launch only the
        # training batches are split across the processes (every process estimates on all of them).
        batches, holdout = holdout_for(path, self.batches, self.learn)
        processes = launched_processes()
        if processes is not None and isinstance(batches, Sequence):
            batches = [_rows_of_process(b, processes.process_index, processes.num_processes) for b in batches]
        self.losses = path.fit(batches, self.learn, accelerate=self.accelerate, holdout=holdout, progress=self.progress)
        self.stopping = getattr(path, "stopping", None)  # a fit that is not the package loop may leave none
