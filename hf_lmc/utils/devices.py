"""Where hf_lmc runs its large tensor products (weight matching, export), and at what float32 precision."""

from __future__ import annotations

import contextlib
import os

import torch

from hf_lmc.config.options import UsageError


def parse_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, or a one-line error naming the forms to use (nothing
    is checked against the machine: a recipe naming cuda can be read where there is none)."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None


def compute_device(device: str | torch.device | None = None) -> torch.device:
    """``device`` if given, else the current CUDA device when there is one, else the CPU.

    Under ``accelerate launch`` each process's current CUDA device is its own GPU.
    """
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = parse_device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            f"device {str(device)!r} asked for, but torch sees no CUDA device; use cpu (or leave the device unset)"
        )
    return device


def launch_device(device: str | torch.device | None = None) -> torch.device:
    """``device`` if given (as :func:`compute_device` checks it), else this process's device as
    ``accelerate launch`` / ``torchrun`` set it up, read from the environment (nothing is
    initialised): the CPU under ``accelerate launch --cpu`` (``ACCELERATE_USE_CPU``) or without
    CUDA; GPU ``LOCAL_RANK`` in a multi-process launch, so that each process uses its own GPU
    before any ``Accelerator`` exists; else :func:`compute_device`'s default.
    """
    from accelerate.utils import parse_flag_from_env

    if device is not None:
        return compute_device(device)
    if parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None:
        return torch.device("cuda", int(local_rank) % torch.cuda.device_count())
    return compute_device()


@contextlib.contextmanager
def full_float32_products():
    """Float32 matrix products in full float32 for the duration (restored after).

    ``torch.set_float32_matmul_precision("high")``, which many training scripts set, lets GPUs
    multiply float32 in TF32 (10 mantissa bits) and oneDNN in bfloat16: about 1e-3 relative
    error, enough to leave a merged twin visibly off. Weight matching and export are exact
    transforms, so they run at ``"highest"``.
    """
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def launched_count() -> int:
    """How many processes the launcher started (``WORLD_SIZE``; 1 outside a launch), read
    without setting up any process group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def computed_on_main(compute):
    """``compute()`` as the main process of a launch computes it, sent to the others (which do
    not compute it): one result for all, where a GPU's nondeterminism could otherwise give each
    process its own. Without a process group of several, simply ``compute()``. A collective
    under a launch: every process calls it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return compute()
    box = [compute() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def launched_processes():
    """``accelerate.PartialState`` when this process is one of several that a launcher started
    (``torchrun``, ``accelerate launch``: ``WORLD_SIZE > 1``), else ``None``. Creating it sets
    up the process group (gloo on CPUs, NCCL on GPUs) that every later ``Accelerator`` of the
    process, the training loop's among them, shares. On CPUs it is asked for by name:
    accelerate's default state would see one process each (``DistributedType.NO``)."""
    if launched_count() <= 1:
        return None
    from accelerate import PartialState  # deferred: a one-process run never needs it

    return PartialState(cpu=launch_device().type == "cpu")


def wait_for_others(processes) -> None:
    """Meet the other launched processes (``processes``: :func:`launched_processes`' state, or
    ``None`` in a one-process run, where there is nothing to wait for)."""
    if processes is not None:
        processes.wait_for_everyone()
