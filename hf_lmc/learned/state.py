"""The training state a killed run resumes from: tensors and JSON only, written atomically,
verified before anything is loaded.

A checkpoint folder holds a manifest, ``hf_lmc_state.json``, the safetensors file it names,
``state.safetensors``, and the marker of hf_lmc's output protocol (:mod:`hf_lmc.io.outputs`, kind
``training-state``). The tensors file holds every tensor a resume needs: the path's
``state_dict`` (trainable parameters and persistent buffers), Adam's per-parameter state, the
parameters of the lowest path seen (``_BestPath``) and each process's random states (torch's CPU
generator and that of the process's device). The manifest holds the rest as JSON (the step reached, accelerate's step
counter, the start's fingerprint, Adam's parameter groups, the learning-rate schedule's state,
fp16's loss scale, the lowest path's step and estimate) and the tensors file's size and sha256.
Python's and numpy's random states are not saved: the loop draws from torch's alone.

Nothing in the folder can run code: safetensors and JSON hold no objects, where the pickles of
``accelerator.save_state`` (which ``load_state`` unpickles with ``weights_only=False``) may.
A state written by an older hf_lmc in that format is refused, never unpickled.

Saving is atomic, by the output protocol: the state is written into a fresh staging folder
beside the checkpoint folder, the tensors first and the manifest last (both flushed to disk),
and the staging folder is then swapped onto the checkpoint folder
(:func:`~hf_lmc.io.outputs.move_into_place`). A run killed at any point of a save leaves the
previous complete state or the new one, never a mixture (or the previous one set aside whole,
which the next run puts back: :func:`~hf_lmc.io.outputs.clean_stale`); the step and the tensors are
one record, and the tensors file's metadata holds the digest of the manifest's record, so a
manifest edited after the save no longer matches. A folder that holds anything else is not a
state and is never written into.

On resume the manifest is parsed into a typed model, every file's size and sha256 checked, and
every tensor's name, shape and dtype checked against the live path, optimizer and lowest path
before anything is copied in; a state that does not validate is refused in one line naming the
file and the key, with nothing loaded.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, JsonValue, NonNegativeInt, PositiveInt, ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from hf_lmc.config.options import ParameterError, UsageError
from hf_lmc.io.outputs import check_replaceable, clean_stale, discard, move_into_place, staging_folder
from hf_lmc.symmetry.stored import file_sha256

MANIFEST = "hf_lmc_state.json"
FORMAT = 1
_KIND = "hf_lmc training state"
TENSORS = "state.safetensors"
#: The names ``accelerator.save_state`` gives its files and hf_lmc's progress file beside them, as
#: hf_lmc wrote its states before this format; such a folder is refused on resume, never read.
_OLDER_HF_LMC = re.compile(r"hf_lmc_progress\.json|.*\.pkl")
_OUTPUT_KIND = "training-state"  # the output protocol's name for the folder
_RECORD_KEY = "hf_lmc_record_sha256"  # the tensors file's metadata key for its record's digest
_LARGEST_MANIFEST = 64 << 20  # bytes: far above a real manifest, so a planted huge file is not read


class TrainingStateError(ValueError):
    """A checkpoint folder's training state does not validate (torn, edited, missing a file, or
    saved for other modules): refused before anything of it is loaded."""


class _StateFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Literal["state.safetensors"]
    size: NonNegativeInt
    sha256: str = Field(pattern=r"[0-9a-f]{64}")


class _LowestPath(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")
    steps: NonNegativeInt | None
    estimate: float | None
    backtracks: NonNegativeInt
    values: NonNegativeInt  # how many tensors, keyed best/0, best/1, ...


class StateRecord(BaseModel):
    """What a saved training state holds besides its tensors (see the module's docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")
    format: Literal[1]
    kind: Literal["hf_lmc training state"]
    step: NonNegativeInt
    accelerator_step: NonNegativeInt
    processes: PositiveInt
    start: dict[str, list[JsonValue]]
    optimizer_groups: list[dict[str, JsonValue]]
    scheduler: dict[str, JsonValue]
    scaler: dict[str, JsonValue] | None  # fp16's loss scale (accelerate's GradScaler), where the run has one
    lowest: _LowestPath

    def digest(self) -> str:
        """The record's sha256, which its tensors file's metadata holds: a manifest edited after
        the save (another step, another learning rate) no longer matches its tensors."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()


class StateManifest(StateRecord):
    """The manifest, ``hf_lmc_state.json``: the record and the tensors file it belongs with."""

    files: list[_StateFile] = Field(min_length=1, max_length=1)

    def record(self) -> StateRecord:
        return StateRecord.model_validate(self.model_dump(exclude={"files"}))


def check_folder(folder: Path) -> None:
    """Refuse ``folder`` as a checkpoint folder unless hf_lmc's training state may be written
    there: missing, empty, or a training-state folder hf_lmc wrote holding nothing else
    (:func:`~hf_lmc.io.outputs.check_replaceable`): a model's or a user's folder is never written
    into. A state of the older, pickled format is named as such."""
    names = []
    if folder.is_dir() and not folder.is_symlink():
        with os.scandir(folder) as entries:
            names = sorted(
                entry.name for entry in itertools.islice(entries, 10_000)
            )  # a huge folder is refused on its first names
    older = [name for name in names if _OLDER_HF_LMC.fullmatch(name)]
    if older:
        raise ParameterError(
            f"{{}}: {_braced(folder)} holds a training state written by an older hf_lmc ({_braced(older[0])}: accelerate's "
            "pickled format, which hf_lmc no longer loads); start afresh in a new folder, or delete that one",
            "checkpoint_dir",
        )
    check_replaceable(folder, "checkpoint_dir", kinds=(_OUTPUT_KIND,))


class TrainingState:
    """What a resumed run needs, as the live objects that hold it: ``path`` (its ``state_dict``),
    ``optimizer`` (the torch optimizer itself, not accelerate's wrapper), ``scheduler`` (a
    learning-rate scheduler whose ``state_dict`` is JSON), ``best`` (a ``state_dict`` of
    ``values``, a list of tensors or ``None``, with ``steps``, ``estimate`` and ``backtracks``,
    and its ``parameters``) and ``accelerator`` (its step counter, process, device and fp16 loss
    scaler)."""

    def __init__(self, path: nn.Module, optimizer: torch.optim.Optimizer, scheduler, best, accelerator):
        self.path, self.optimizer, self.scheduler = path, optimizer, scheduler
        self.best, self.accelerator = best, accelerator

    @property
    def _scaler(self):
        return getattr(self.accelerator, "scaler", None)

    def save(self, folder: Path, step: int, start: dict) -> None:
        """Save the state after ``step`` steps into ``folder`` (atomically, see the module's
        docstring). A collective under several processes (the random states are gathered);
        the main process writes."""
        rng = self._random_states()
        if not self.accelerator.is_main_process:
            return
        tensors = {f"path/{name}": value for name, value in self.path.state_dict().items()}
        optimizer = self.optimizer.state_dict()
        for index, entry in optimizer["state"].items():
            for key, value in entry.items():
                if not isinstance(value, Tensor):
                    raise TypeError(f"the optimizer's state {index}.{key} is not a tensor ({type(value).__name__})")
                tensors[f"optimizer/{index}/{key}"] = value
        lowest = dict(self.best.state_dict())
        values = lowest.pop("values") or []
        tensors |= {f"best/{i}": value for i, value in enumerate(values)}
        tensors |= rng
        record = {
            "format": FORMAT,
            "kind": _KIND,
            "step": step,
            "accelerator_step": self.accelerator.step,
            "processes": self.accelerator.num_processes,
            "start": start,
            "optimizer_groups": json.loads(json.dumps(optimizer["param_groups"])),  # tuples (betas) as lists
            "scheduler": self.scheduler.state_dict(),
            "scaler": self._scaler.state_dict() if self._scaler is not None else None,
            "lowest": {**lowest, "values": len(values)},
        }
        _write(folder, {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}, record)

    def load(self, folder: Path, budget: int, check_start: Callable[[dict], None]) -> int:
        """Put the state saved in ``folder`` back and return its step (0 where the folder holds
        none: the run starts afresh). ``check_start(saved_start)`` refuses another start. Every
        check runs before anything is copied in."""
        if self.accelerator.is_main_process:
            clean_stale(folder)  # a state that a save killed mid-swap set aside goes back first
        self.accelerator.wait_for_everyone()
        read = _read(folder)
        if read is None:
            return 0
        manifest, tensors = read
        accelerator = self.accelerator
        if manifest.processes != accelerator.num_processes:
            raise UsageError(
                f"resume: the training state in {_shown(folder)} was saved by {manifest.processes} processes and this "
                f"run has {accelerator.num_processes}; resume under the launch that saved it, or start afresh in another folder"
            )
        if manifest.step > budget:
            raise UsageError(
                f"resume: the training state in {_shown(folder)} is at step {manifest.step}, past this run's "
                f"{budget} steps; resume with the steps of the run that saved it, or start afresh in another folder"
            )
        check_start(manifest.start)
        if (manifest.scaler is None) != (self._scaler is None):
            raise UsageError(
                f"resume: the training state in {_shown(folder)} was saved {'with' if manifest.scaler is not None else 'without'} "
                "fp16's loss scaling and this run has the other; resume with the mixed precision of the run that saved it"
            )
        file = folder / manifest.files[0].name
        expect = _Expect(file, tensors)
        path_state = expect.prefixed("path/", {k: (v.shape, v.dtype) for k, v in self.path.state_dict().items()})
        optimizer_state = self._checked_optimizer(manifest, expect)
        values = expect.prefixed(
            "best/",
            {f"{i}": (p.shape, p.dtype) for i, p in enumerate(self.best.parameters)} if manifest.lowest.values else {},
        )
        rng = self._checked_random_states(expect)
        expect.nothing_else()
        # Everything checked: put it back.
        self.path.load_state_dict(path_state, strict=True)
        self.optimizer.load_state_dict(optimizer_state)
        self.scheduler.load_state_dict(dict(manifest.scheduler))
        if manifest.scaler:  # empty: a disabled scaler, which holds nothing
            self._scaler.load_state_dict(dict(manifest.scaler))
        lowest = manifest.lowest
        self.best.load_state_dict(
            {
                "steps": lowest.steps,
                "estimate": lowest.estimate,
                "backtracks": lowest.backtracks,
                "values": [values[f"{i}"] for i in range(lowest.values)] if lowest.values else None,
            }
        )
        for device, state in rng.items():
            if device == "cpu":
                torch.set_rng_state(state)
            else:
                torch.get_device_module(device).set_rng_state(state, accelerator.device)
        accelerator.step = manifest.accelerator_step
        return manifest.step

    def _checked_optimizer(self, manifest: StateManifest, expect: _Expect) -> dict:
        live = self.optimizer.state_dict()["param_groups"]
        saved = manifest.optimizer_groups
        parameters = dict(enumerate(p for group in self.optimizer.param_groups for p in group["params"]))
        if len(saved) != len(live) or any(
            set(s) != set(g) or s.get("params") != g["params"] for s, g in zip(saved, live)
        ):
            raise TrainingStateError(
                f"{_shown(expect.file.parent / MANIFEST)}: optimizer_groups are not this run's optimizer's "
                "(other parameters or settings); resume with what saved it, or start afresh in another folder"
            )
        groups = [{k: tuple(v) if isinstance(g[k], tuple) else v for k, v in s.items()} for s, g in zip(saved, live)]
        state: dict[int, dict[str, Tensor]] = {}
        for key in expect.remaining("optimizer/"):
            index, _, name = key.removeprefix("optimizer/").partition("/")
            if not index.isdigit() or int(index) not in parameters:
                raise expect.unexpected(key)
            parameter = parameters[int(index)]
            # Adam's moments are shaped as their parameter; its step is a float scalar
            shape, dtype = ((), None) if name == "step" else (parameter.shape, parameter.dtype)
            value = state.setdefault(int(index), {})[name] = expect.tensor(key, shape, dtype)
            if not value.is_floating_point():
                raise expect.unexpected(key)
        return {"state": state, "param_groups": groups}

    def _random_states(self) -> dict[str, Tensor]:
        """Every process's random states, keyed ``rng/<process>/<device type>`` (a collective)."""
        accelerator = self.accelerator
        local = {"cpu": torch.get_rng_state()}
        device = accelerator.device
        if device.type != "cpu":
            local[device.type] = torch.get_device_module(device).get_rng_state(device)
        if accelerator.num_processes == 1:
            return {f"rng/0/{kind}": state for kind, state in local.items()}
        gathered = {kind: accelerator.gather(state.to(device)[None]).cpu() for kind, state in local.items()}
        return {
            f"rng/{rank}/{kind}": rows[rank]
            for kind, rows in gathered.items()
            for rank in range(accelerator.num_processes)
        }

    def _checked_random_states(self, expect: _Expect) -> dict[str, Tensor]:
        """This process's saved random states; the device's only where it saved on the same kind of device."""
        rank, device = self.accelerator.process_index, self.accelerator.device
        states = {"cpu": expect.tensor(f"rng/{rank}/cpu", torch.get_rng_state().shape, torch.uint8)}
        if device.type != "cpu" and f"rng/{rank}/{device.type}" in expect.tensors:
            shape = torch.get_device_module(device).get_rng_state(device).shape
            states[device.type] = expect.tensor(f"rng/{rank}/{device.type}", shape, torch.uint8)
        for key in expect.remaining("rng/"):  # the other processes' states
            if not re.fullmatch(r"rng/\d+/[a-z]+", key):
                raise expect.unexpected(key)
            expect.seen.add(key)
        return states


class _Expect:
    """Checks a loaded tensors file's keys, shapes and dtypes against the live objects, naming the file and the key."""

    def __init__(self, file: Path, tensors: dict[str, Tensor]):
        self.file, self.tensors, self.seen = file, tensors, set()

    def tensor(self, key: str, shape, dtype: torch.dtype | None) -> Tensor:
        if key not in self.tensors:
            raise TrainingStateError(
                f"{_shown(self.file)}: {_shown(key)} is missing; the state is not this run's, or not whole; "
                "start afresh in another folder"
            )
        value = self.tensors[key]
        if tuple(value.shape) != tuple(shape) or (dtype is not None and value.dtype != dtype):
            raise TrainingStateError(
                f"{_shown(self.file)}: {_shown(key)} is {value.dtype} {tuple(value.shape)} where this run holds "
                f"{dtype or 'a tensor'} {tuple(shape)}; resume with what saved it, or start afresh in another folder"
            )
        self.seen.add(key)
        return value

    def prefixed(self, prefix: str, expected: dict[str, tuple]) -> dict[str, Tensor]:
        taken = {name: self.tensor(prefix + name, shape, dtype) for name, (shape, dtype) in expected.items()}
        extra = self.remaining(prefix)
        if extra:
            raise self.unexpected(extra[0])
        return taken

    def remaining(self, prefix: str) -> list[str]:
        return sorted(k for k in self.tensors if k.startswith(prefix) and k not in self.seen)

    def unexpected(self, key: str) -> TrainingStateError:
        return TrainingStateError(
            f"{_shown(self.file)}: {_shown(key)} is not part of this run's state; resume with what saved it, "
            "or start afresh in another folder"
        )

    def nothing_else(self) -> None:
        extra = sorted(set(self.tensors) - self.seen)
        if extra:
            raise self.unexpected(extra[0])


def _write(folder: Path, tensors: dict[str, Tensor], record: dict[str, Any]) -> None:
    """Write the tensors, then the manifest that names them, into a staging folder, and swap it onto ``folder``."""
    check_folder(folder)
    record = StateRecord.model_validate(record)
    staging = staging_folder(folder)
    try:
        save_file(tensors, staging / TENSORS, metadata={"format": "pt", _RECORD_KEY: record.digest()})
        _flush(staging / TENSORS)
        files = [
            {"name": TENSORS, "size": (staging / TENSORS).stat().st_size, "sha256": file_sha256(staging / TENSORS)}
        ]
        manifest = StateManifest.model_validate({**record.model_dump(), "files": files})
        # The manifest last: a folder without it is no state.
        (staging / MANIFEST).write_text(manifest.model_dump_json(), encoding="utf-8")
        _flush(staging / MANIFEST)
        _flush(staging)
        move_into_place(staging, folder, kind=_OUTPUT_KIND, overwrite=True, what="checkpoint_dir")
    except BaseException:
        discard(staging)  # gone already where it was moved
        raise
    _flush(folder.parent)


def _read(folder: Path) -> tuple[StateManifest, dict[str, Tensor]] | None:
    """The verified manifest and tensors of ``folder``'s state, or ``None`` where it holds none
    (:func:`~hf_lmc.io.outputs.clean_stale` has run: a state a killed save set aside is back)."""
    check_folder(folder)
    manifest_file = folder / MANIFEST
    if not manifest_file.is_file():
        if folder.is_dir() and any(folder.iterdir()):  # every save has its manifest: this folder was altered
            raise TrainingStateError(
                f"{_shown(folder)} holds no {MANIFEST}, so no whole training state; start afresh in another folder"
            )
        return None  # missing or empty: start afresh
    if manifest_file.stat().st_size > _LARGEST_MANIFEST:
        raise TrainingStateError(
            f"{_shown(manifest_file)}: larger than any training state's manifest; start afresh in another folder"
        )
    try:
        manifest = StateManifest.model_validate_json(manifest_file.read_bytes())
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the file"
        raise TrainingStateError(
            f"{_shown(manifest_file)}: not a valid hf_lmc training state ({_shown(where)}: "
            f"{_shown(first['msg'])}); start afresh in another folder"
        ) from None
    entry = manifest.files[0]
    file = folder / entry.name
    if not file.is_file():
        raise TrainingStateError(f"{_shown(file)} is missing, which {MANIFEST} names; start afresh in another folder")
    if file.stat().st_size != entry.size or file_sha256(file) != entry.sha256:
        raise TrainingStateError(
            f"{_shown(file)}: its size or sha256 is not what {MANIFEST} records (torn or edited); "
            "start afresh in another folder"
        )
    try:
        with safe_open(file, framework="pt") as opened:  # safetensors: tensors only, nothing to run
            digest = (opened.metadata() or {}).get(_RECORD_KEY)
            names = opened.keys()
            tensors = {key: opened.get_tensor(key) for key in names}
    except SafetensorError as err:
        raise TrainingStateError(
            f"{_shown(file)}: not a readable safetensors file ({_shown(str(err))}); start afresh in another folder"
        ) from None
    if digest != manifest.record().digest():
        raise TrainingStateError(
            f"{_shown(manifest_file)} was edited after the save: it no longer matches {_shown(file.name)}; "
            "start afresh in another folder"
        )
    return manifest, tensors


def _flush(path: Path) -> None:
    """Flush ``path`` (a file or a folder: the names in it) to disk."""
    if os.name == "nt" and path.is_dir():  # Windows opens no folder to flush; its renames are durable as they are
        return
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _shown(value, most: int = 200) -> str:
    """``value`` for a message: at most ``most`` characters (a long path or name is cut in the middle)."""
    text = str(value)
    return text if len(text) <= most else f"{text[: most // 2]}...{text[-most // 2 :]}"


def _braced(value) -> str:
    """:func:`_shown` for a :class:`~hf_lmc.config.options.ParameterError`'s template, whose braces name the parameter."""
    return _shown(value).replace("{", "{{").replace("}", "}}")
